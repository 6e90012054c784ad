"""A node's life as a process (tiny model, embedded store): drain on SIGTERM under load, and a refused start."""

from __future__ import annotations

import json
import signal
import socket
import threading
from pathlib import Path

import httpx
import pytest

from tests.support.caches import sentences
from tests.support.nodes import NodeProcess, tiny_store
from tests.support.wait import wait_until


@pytest.fixture
def node(tmp_path: Path, model):
    """A node whose requests wait up to 5 s to be batched: a request is surely queued when the test acts. One per
    test: the SIGTERM test stops its node, and tests run in any order."""
    folder, loaded = model
    process = NodeProcess(str(folder), tiny_store(tmp_path / "store", loaded), tmp_path,
                          args=("--no-warmup", "--max-wait-ms", "5000")).start()
    yield process
    process.kill()


def test_a_client_that_disconnects_frees_its_queued_rows(node: NodeProcess, model) -> None:
    folder, _ = model
    body = json.dumps({"model": str(folder), "input": sentences(3, seed=9)}).encode()
    with socket.create_connection(("127.0.0.1", node.port)) as conn:
        conn.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: node.metric("attnstore_node_queue_requests") >= 1, 30, "the request queued")
    wait_until(lambda: node.metric("attnstore_node_freed_rows_total") >= 3, 30,
               "the disconnected request's 3 rows taken out of the queue")
    assert node.metric("attnstore_node_cancelled_requests_total") == 1
    assert node.metric("attnstore_node_queue_rows") == 0


def test_sigterm_during_load_answers_every_request_in_flight_and_exits_0(node: NodeProcess, model) -> None:
    folder, _ = model
    answers: list[httpx.Response | BaseException] = []

    def send(seed: int) -> None:
        texts = sentences(1 + seed, seed=seed)
        try:
            answers.append(httpx.post(f"{node.url}/v1/embeddings", json={"model": str(folder), "input": texts},
                                      timeout=60))
        except httpx.HTTPError as exc:
            answers.append(exc)

    senders = [threading.Thread(target=send, args=(seed,)) for seed in range(8)]
    for sender in senders:
        sender.start()
    wait_until(lambda: node.metric("attnstore_node_queue_requests") >= 8, 30, "the 8 requests queued")
    assert node.process is not None
    node.process.send_signal(signal.SIGTERM)
    for sender in senders:
        sender.join(60)
    code = node.stop()
    assert [a.status_code if isinstance(a, httpx.Response) else repr(a) for a in answers] == [200] * 8
    assert sorted(len(a.json()["data"]) for a in answers if isinstance(a, httpx.Response)) == list(range(1, 9))
    assert code == 0, node.log()
    assert "event=draining signal=SIGTERM" in node.log()
    assert not node.ready_file.exists()


def test_a_node_whose_namespace_is_missing_exits_2(tmp_path: Path, model) -> None:
    folder, loaded = model
    process = NodeProcess(str(folder), tiny_store(tmp_path / "store", loaded), tmp_path,
                          args=("--namespace", "nope", "--no-warmup"))
    with pytest.raises(RuntimeError, match="exited with 2"):
        process.start()
    assert "NamespaceNotFoundError" in process.log() or "no namespace" in process.log().lower()
