"""Each request gets its own rows: a real node (all-MiniLM-L6-v2, an empty exact-tier namespace, its own exact tier
off, so every row is computed) merges concurrent requests whose inputs collide, refuses some of them, loses a client
mid-call, and every row it answers must be the plain model's vector of that request's own text."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.nodes import NodeProcess, tiny_store
from tests.support.vectors import row_cosines
from tests.support.wait import wait_until

pytestmark = pytest.mark.real_model

BASE = [
    "Failed password for invalid user admin from 10.0.0.1 port 22 ssh2",
    "Receiving block blk_-1608999687919862906 src: /10.250.19.102:54106",
    "Connection closed by 192.168.1.7 [preauth]",
    "A man is playing a guitar.",
    "ok",
]
LONG = " ".join(["word"] * 300) + " the end"  # past minilm's 256 tokens


def _pool() -> list[str]:
    """Texts built to collide: case and whitespace variants minilm tokenizes alike, and texts over its limit."""
    texts: list[str] = []
    for text in BASE:
        texts += [text, text.upper(), text.lower(), "  " + text.replace(" ", "   ") + "\t", text.title()]
    return [*texts, LONG, LONG.upper(), "x " * 400]


POOL = _pool()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, minilm_model):
    workdir = tmp_path_factory.mktemp("node-isolation")
    process = NodeProcess("minilm", tiny_store(workdir / "store", minilm_model), workdir,
                          args=("--no-warmup", "--max-wait-ms", "30", "--max-batch-tokens", "16384",
                                "--exact-cache-bytes", "0")).start()
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def reference(minilm_model) -> dict[str, np.ndarray]:
    """Each text of the pool sent alone to the plain model (``SentenceTransformer.encode``, which truncates)."""
    vectors = minilm_model.sentence_transformer.encode(POOL)
    return dict(zip(POOL, vectors, strict=True))


def test_a_refused_request_never_hands_its_texts_to_another_client_in_100_of_100_rounds(node, minilm_model) -> None:
    own = [f"hello from B, round {k}" for k in range(100)]
    secrets = [f"SECRET of client A, round {k}" for k in range(100)]
    expected = minilm_model.sentence_transformer.encode(own)

    async def rounds() -> list[tuple[httpx.Response, httpx.Response]]:
        answers = []
        async with httpx.AsyncClient(base_url=node.url, timeout=60) as client:
            for k in range(100):
                refused = client.post("/embed", json={"inputs": ["word " * 600, secrets[k]]})
                served = client.post("/v1/embeddings", json={"model": "minilm", "input": [own[k]]})
                answers.append(tuple(await asyncio.gather(refused, served)))
        return answers

    answers = asyncio.run(rounds())
    assert [(a.status_code, a.json()["error"]["code"]) for a, _ in answers] == [(400, "context_length_exceeded")] * 100
    assert [b.status_code for _, b in answers] == [200] * 100
    vectors = np.array([b.json()["data"][0]["embedding"] for _, b in answers], np.float32)
    assert row_cosines(vectors, expected).min() >= 0.9999
    tokens = [len(row) for row in minilm_model.sentence_transformer.tokenizer(own)["input_ids"]]
    assert [b.json()["usage"]["prompt_tokens"] for _, b in answers] == tokens


# One request: its route, its inputs (indices into POOL, or -1 for an empty string) and, for /embed, truncate.
_request = st.tuples(st.sampled_from(["/v1/embeddings", "/embed"]),
                     st.lists(st.integers(-1, len(POOL) - 1), min_size=1, max_size=6), st.booleans())


def _send(client: httpx.Client, route: str, texts: list[str], truncate: bool) -> httpx.Response:
    if route == "/embed":
        return client.post(route, json={"inputs": texts, "truncate": truncate})
    return client.post(route, json={"model": "minilm", "input": texts})


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(requests=st.lists(_request, min_size=2, max_size=6))
def test_concurrent_requests_with_colliding_inputs_each_get_their_own_texts_rows(node, reference, minilm_model,
                                                                                 requests) -> None:
    tokenizer = minilm_model.sentence_transformer.tokenizer
    sent = [(route, ["" if i < 0 else POOL[i] for i in picks], truncate) for route, picks, truncate in requests]
    with httpx.Client(base_url=node.url, timeout=60) as client, ThreadPoolExecutor(len(sent)) as senders:
        answers = list(senders.map(lambda request: _send(client, *request), sent))
    for (route, texts, truncate), answer in zip(sent, answers, strict=True):
        if "" in texts:
            assert (answer.status_code, answer.json()["error"]["code"]) == (400, "empty_input")
            continue
        too_long = any(len(tokenizer(text)["input_ids"]) > 256 for text in texts)
        if route == "/embed" and too_long and not truncate:
            assert (answer.status_code, answer.json()["error"]["code"]) == (400, "context_length_exceeded")
            continue
        assert answer.status_code == 200, answer.text
        rows = answer.json() if route == "/embed" else [item["embedding"] for item in answer.json()["data"]]
        expected = np.stack([reference[text] for text in texts])
        assert row_cosines(np.array(rows, np.float32), expected).min() >= 0.9999, (route, texts)


def _many() -> list[str]:
    """A's 600 long lines (about 20,600 minilm tokens)."""
    generator = random.Random(7)
    words = ["disk", "block", "user", "session", "port", "node", "error", "warning", "kernel", "module"]
    return [" ".join(generator.choice(words) for _ in range(30)) + f" line {i}" for i in range(600)]


@pytest.fixture(scope="module")
def sharing_node(tmp_path_factory: pytest.TempPathFactory, minilm_model):
    """A node whose call of A's lines alone waits (up to 60 s) for another request: its token budget is A's
    tokens and one more, so the call begins the moment a second request is queued beside A, whenever that is."""
    tokens = sum(len(row) for row in minilm_model.sentence_transformer.tokenizer(_many())["input_ids"])
    workdir = tmp_path_factory.mktemp("node-sharing")
    process = NodeProcess("minilm", tiny_store(workdir / "store", minilm_model), workdir,
                          args=("--no-warmup", "--max-wait-ms", "60000", "--max-batch-tokens", str(tokens + 1),
                                "--exact-cache-bytes", "0")).start()
    yield process
    assert process.stop() == 0, process.log()


def test_a_request_cancelled_mid_call_still_leaves_its_shared_rows_to_the_other_request(sharing_node,
                                                                                        minilm_model) -> None:
    node = sharing_node
    many = _many()
    shared = [many[3], many[300].upper(), many[599], "a text only B sends"]
    begun = node.metric("attnstore_node_batch_wait_seconds_count")
    calls = node.metric("attnstore_node_call_requests_count")
    merged = node.metric("attnstore_node_call_requests_sum")
    cancelled = node.metric("attnstore_node_cancelled_requests_total")
    body = json.dumps({"model": "minilm", "input": many}).encode()
    answer: list[httpx.Response] = []
    with socket.create_connection(("127.0.0.1", node.port)) as gone:
        gone.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # A first: B is sent once A is queued, where A's call waits for it (the node's token budget).
        wait_until(lambda: node.metric("attnstore_node_queue_requests") >= 1, 60, "A queued")
        other = threading.Thread(target=lambda: answer.append(httpx.post(
            f"{node.url}/v1/embeddings", json={"model": "minilm", "input": shared}, timeout=120)))
        other.start()
        wait_until(lambda: node.metric("attnstore_node_batch_wait_seconds_count") >= begun + 2, 60,
                   "A's and B's call begun")
    # A's client is gone while the call runs.
    other.join(120)
    assert answer and answer[0].status_code == 200, answer
    vectors = np.array([item["embedding"] for item in answer[0].json()["data"]], np.float32)
    assert row_cosines(vectors, minilm_model.sentence_transformer.encode(shared)).min() >= 0.9999
    wait_until(lambda: node.metric("attnstore_node_cancelled_requests_total") >= cancelled + 1, 60,
               "A's disconnect seen (its request cancelled)")
    wait_until(lambda: node.metric("attnstore_node_call_requests_count") >= calls + 1, 60, "the call counted")
    assert node.metric("attnstore_node_call_requests_count") == calls + 1  # one call, of both requests:
    assert node.metric("attnstore_node_call_requests_sum") == merged + 2  # B's rows were A's too
