"""Waiting out failovers (attnstore.store.redis.connection.retried): what is sent again and what is not; Redis's
errors as clients read them (``redis_message``, ``translated``)."""

from __future__ import annotations

import pytest
import redis

from attnstore.errors import StoreFullError
from attnstore.store.redis.connection import RetryCounts, RetryTotals, redis_message, retried, translated


def failing_then(failures: list[BaseException], result: str = "ok"):
    """A call that raises each of ``failures`` in turn, then returns ``result``."""
    pending = list(failures)

    def call() -> str:
        if pending:
            raise pending.pop(0)
        return result

    return call


@pytest.mark.parametrize(
    "failure",
    [
        redis.ConnectionError("Connection closed by server."),
        # redis-py's races at a failover, when another thread's cluster client disconnects the connection
        # this one is reading from: its parser's buffer is gone, or its socket file is closed; or reloads
        # the slot map while another thread adds a node to its table.
        AttributeError("'NoneType' object has no attribute 'readline'"),
        ValueError("I/O operation on closed file."),
        RuntimeError("dictionary changed size during iteration"),
    ],
)
def test_a_transient_failure_or_a_dropped_connection_race_is_sent_again_and_counted(failure):
    counts = RetryCounts()
    assert retried(failing_then([failure, failure]), seconds=5.0, counts=counts) == "ok"
    assert counts.totals() == RetryTotals(retries=2, waited_out=1, gave_up=0)


@pytest.mark.parametrize("failure", [AttributeError("'Foo' object has no attribute 'bar'"), ValueError("bad id 7"),
                                     RuntimeError("no namespace")])
def test_an_attribute_value_or_runtime_error_of_our_own_is_raised_at_once_never_sent_again(failure):
    counts = RetryCounts()
    with pytest.raises(type(failure), match=str(failure)):
        retried(failing_then([failure]), seconds=5.0, counts=counts)
    assert counts.totals() == RetryTotals(retries=0, waited_out=0, gave_up=0)


def test_a_failure_lasting_past_the_deadline_gives_up_with_its_own_error():
    counts = RetryCounts()
    with pytest.raises(redis.TimeoutError):
        retried(failing_then([redis.TimeoutError("timed out")] * 100), seconds=0.2, counts=counts)
    totals = counts.totals()
    assert totals.gave_up == 1 and totals.waited_out == 0 and totals.retries >= 1


def _pipeline_error(command: tuple[object, ...]) -> redis.exceptions.OutOfMemoryError:
    """The error redis-py raises for a pipeline's refused command: annotated with the command and its arguments."""
    error = redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
    redis.client.Pipeline.annotate_exception(None, error, 1, command)  # type: ignore[arg-type]
    return error


def test_a_pipelines_refused_command_is_named_without_its_arguments_bytes() -> None:
    error = _pipeline_error(("HSET", b"attnstore:ns:entry:7", "record", bytes(range(256)) * 40))
    assert "\\x" in str(error) or not str(error).isprintable()  # what redis-py's own message carries
    message = redis_message(error)
    assert message == "HSET (command 1 of a pipeline): command not allowed when used memory > 'maxmemory'."


def test_redis_full_while_writing_is_a_store_full_error_saying_what_was_written_and_what_to_do() -> None:
    with pytest.raises(StoreFullError) as refused, translated("writing entries into 'ns'"):
        raise _pipeline_error(("HSET", b"key", "maps/0", b"\x00\xff" * 1000))
    message = str(refused.value)
    assert message.startswith("Redis is full while writing entries into 'ns' (HSET (command 1 of a pipeline): ")
    assert message.isprintable() and "\\x" not in message and "maxmemory-policy volatile-lru" in message
