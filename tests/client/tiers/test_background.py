"""The background sender under write-back of rows and of chunks: batching, a full queue, flush and close."""

from __future__ import annotations

import threading

from attnstore_client.tiers.background import BackgroundSender


class _Recorder(BackgroundSender[bytes]):
    """Sends nothing anywhere: keeps each batch, and can be held inside a send until released."""

    def __init__(self, *, max_queued: int = 100, batch_items: int = 100, batch_bytes: int = 1000) -> None:
        super().__init__(name="test-sender", max_queued=max_queued, batch_items=batch_items, batch_bytes=batch_bytes,
                         counts=("sent",))
        self.batches: list[list[bytes]] = []
        self.release = threading.Event()
        self.release.set()
        self.sending = threading.Event()
        self._start()

    def put(self, item: bytes) -> bool:
        return self._offer(item)

    def _size(self, item: bytes) -> int:
        return len(item)

    def _send(self, batch: list[bytes]) -> None:
        self.sending.set()
        self.release.wait()
        self.batches.append(batch)
        self._add(pending=-len(batch), sent=len(batch))


def _held(sender: _Recorder) -> None:
    """Hold the thread inside a send of one item, so that what is put next waits on the queue."""
    sender.release.clear()
    sender.put(b"x")
    assert sender.sending.wait(5)


def test_what_waits_is_sent_in_batches_within_the_item_and_byte_limits_in_queue_order() -> None:
    sender = _Recorder(batch_items=3, batch_bytes=10)
    _held(sender)
    items = [bytes([i]) * 4 for i in range(5)] + [b"y" * 25, b"z"]  # 25 bytes: over a batch, it goes alone
    assert all(sender.put(item) for item in items)
    sender.release.set()
    assert sender.flush(5)
    assert sender.batches[1:] == [items[0:2], items[2:4], [items[4]], [items[5]], [items[6]]]
    assert sender._snapshot()["sent"] == 8 and sender._snapshot()["queued"] == 8
    sender.close()


def test_a_full_queue_drops_the_new_item_without_waiting_and_counts_it() -> None:
    sender = _Recorder(max_queued=2)
    _held(sender)
    assert sender.put(b"a") and sender.put(b"b") and not sender.put(b"c")
    assert sender._snapshot()["dropped_full"] == 1
    sender.release.set()
    assert sender.flush(5) and [b for batch in sender.batches for b in batch] == [b"x", b"a", b"b"]
    sender.close()


def test_flush_times_out_while_a_send_is_held_and_returns_once_it_ends() -> None:
    sender = _Recorder()
    _held(sender)
    assert not sender.flush(0.05)
    sender.release.set()
    assert sender.flush(5) and sender._snapshot()["pending"] == 0
    sender.close()


def test_close_sends_what_is_queued_then_stops_the_thread() -> None:
    sender = _Recorder()
    for i in range(10):
        sender.put(bytes([i]))
    sender.close()
    assert not sender._thread.is_alive() and sum(len(batch) for batch in sender.batches) == 10


def test_a_sender_turned_off_drops_what_it_is_offered_and_counts_it() -> None:
    sender = _Recorder()
    sender._disabled = "the store refused the token"
    assert not sender.put(b"a") and sender._snapshot()["dropped_failed"] == 1 and sender.flush(1)
    sender.close()
