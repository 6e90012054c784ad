"""A node's answers to hostile input and to slow or vanishing clients: a real node process (tiny model, embedded
store) over real HTTP and raw loopback sockets. Each was found by probing the node as an attacker would."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.support.caches import sentences
from tests.support.nodes import NodeProcess, tiny_store
from tests.support.wait import wait_until

READ_TIMEOUT = 2.0  # seconds the node gives a request's headers, then its body (--read-timeout)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, model):
    folder, loaded = model
    workdir = tmp_path_factory.mktemp("node-faults")
    process = NodeProcess(str(folder), tiny_store(workdir / "store", loaded), workdir,
                          args=("--no-warmup", "--max-wait-ms", "20", "--read-timeout", str(READ_TIMEOUT))).start()
    yield process
    assert process.stop() == 0, process.log()


def _post_raw(node: NodeProcess, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{node.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)


def _requests(node: NodeProcess, route: str, status: int) -> float:
    prefix = f'attnstore_node_requests_total{{route="{route}",status="{status}"}} '
    for line in httpx.get(f"{node.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[1])
    return 0.0


def test_a_lone_surrogate_is_a_400_naming_its_input_and_the_node_keeps_serving(node: NodeProcess, model) -> None:
    folder, _ = model
    body = b'{"model": ' + json.dumps(str(folder)).encode() + b', "input": ["a fine line", "\\ud800"]}'
    refused = _post_raw(node, "/v1/embeddings", body)
    assert refused.status_code == 400, refused.text
    assert (refused.json()["error"]["code"], refused.json()["error"]["param"]) == ("invalid_input", "input[1]")
    served = httpx.post(f"{node.url}/v1/embeddings", json={"model": str(folder), "input": sentences(2, seed=4)},
                        timeout=60)
    assert served.status_code == 200, served.text
    assert len(served.json()["data"]) == 2
    assert httpx.get(f"{node.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("nesting", [b"[" * 100_000 + b"]" * 100_000, b"[" * 50_000])
def test_deeply_nested_json_is_a_400_invalid_json(node: NodeProcess, model, nesting: bytes) -> None:
    folder, _ = model
    body = b'{"model": ' + json.dumps(str(folder)).encode() + b', "input": ' + nesting + b"}"
    refused = _post_raw(node, "/v1/embeddings", body)
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_json")
    assert "Traceback" not in node.log()


def test_a_client_that_disconnects_mid_body_is_counted_as_499_without_a_traceback(node: NodeProcess) -> None:
    before = _requests(node, "/v1/embeddings", 499)
    with socket.create_connection(("127.0.0.1", node.port)) as conn:
        conn.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"input": [')
    # Closed with part of the body sent: TCP hands the node the head and that part before the close, so the app
    # reads them and then finds the client gone, however late it runs.
    wait_until(lambda: _requests(node, "/v1/embeddings", 499) >= before + 1, 30,
               lambda: f"the disconnect counted as 499; the log:\n{node.log()[-3000:]}")
    assert _requests(node, "/v1/embeddings", 500) == 0
    assert "Traceback" not in node.log() and "ClientDisconnect" not in node.log()


def test_unknown_paths_and_wrong_methods_get_openai_json_errors_and_are_counted(node: NodeProcess) -> None:
    wrong = httpx.get(f"{node.url}/v1/embeddings", timeout=10)
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (405, "method_not_allowed")
    assert wrong.headers["allow"] == "POST"
    unknown = httpx.post(f"{node.url}/v1/chat/completions", json={}, timeout=10)
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "not_found")
    assert unknown.json()["error"]["type"] == "invalid_request_error"
    assert _requests(node, "/v1/embeddings", 405) == 1
    assert _requests(node, "other", 404) == 1


def _trickle(conn: socket.socket, data: bytes, stop: threading.Event) -> None:
    """Send ``data`` a byte every 0.2 s until it is all sent, the node closes, or ``stop`` is set."""
    for byte in data:
        if stop.wait(0.2):
            return
        try:
            conn.send(bytes([byte]))
        except OSError:
            return


def _answer_until_closed(conn: socket.socket, within: float) -> tuple[bytes, float]:
    """What the node sends on ``conn`` until it closes it, and the seconds that took (at most ``within``)."""
    started = time.monotonic()
    conn.settimeout(within)
    received = b""
    try:
        while piece := conn.recv(65536):
            received += piece
    except (ConnectionResetError, TimeoutError):
        pass
    return received, time.monotonic() - started


def test_clients_trickling_headers_or_body_get_408_and_are_closed_and_silent_ones_are_closed(node) -> None:
    body = b'{"input": "' + b"x" * 500 + b'"}'
    headers = (b"POST /v1/embeddings HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    cases = {"headers": headers + body, "body": None, "silent": b""}
    stop = threading.Event()
    answers: dict[str, tuple[bytes, float]] = {}
    conns = {name: socket.create_connection(("127.0.0.1", node.port)) for name in cases}
    try:
        conns["body"].sendall(headers)
        senders = [threading.Thread(target=_trickle, args=(conns["headers"], cases["headers"], stop)),
                   threading.Thread(target=_trickle, args=(conns["body"], body, stop))]
        for sender in senders:
            sender.start()
        for name, conn in conns.items():
            answers[name] = _answer_until_closed(conn, within=30)
    finally:
        stop.set()
        for conn in conns.values():
            conn.close()
    for name in ("headers", "body"):
        received, seconds = answers[name]
        status, _, rest = received.partition(b"\r\n")
        assert status == b"HTTP/1.1 408 Request Timeout", (name, received[:300])
        assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        assert seconds < 25, (name, seconds)
    assert answers["silent"][0] == b"" and answers["silent"][1] < 25
    assert _requests(node, "other", 408) == 1 and _requests(node, "/v1/embeddings", 408) == 1
    assert httpx.get(f"{node.url}/health", timeout=10).status_code == 200
