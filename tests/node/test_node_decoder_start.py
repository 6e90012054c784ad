"""A decoder node is healthy within 30 s of its start, warm-up on: the warm-up's forwards stop at their time budget."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from attnstore_client.cache import AttnCache
from attnstore_node.warmup import FORWARD_TOKENS, ROW_LENGTHS, warm_up
from tests.support.nodes import NodeProcess, decoder_store, save_tiny_llama
from tests.support.wait import wait_until

READY_SECONDS = 30.0


def healthy_within(node: NodeProcess, seconds: float) -> float:
    """Start ``node`` and poll ``/health`` until 200; returns the seconds from the start."""
    started = time.monotonic()
    node.start(timeout=seconds)
    wait_until(lambda: httpx.get(f"{node.url}/health", timeout=5).status_code == 200,
               seconds - (time.monotonic() - started), f"/health answering 200 within {seconds:g} s of the start")
    return time.monotonic() - started


def test_the_warm_up_stops_at_its_time_budget_and_times_the_rest_a_step_at_a_time(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    loaded = save_tiny_llama(folder)
    with AttnCache(str(folder), decoder_store(tmp_path / "store", loaded)) as cache:
        warmup = warm_up(cache, seconds=0.0)  # the untimed first forward only
        assert warmup.forwards == 0 and not warmup.done
        assert cache.cost_model.forward_cost() is None  # no fit yet: the budget's default applies
        while not warmup.done:
            warmup.step()
        assert warmup.forwards == len(FORWARD_TOKENS) * len(ROW_LENGTHS)
        assert cache.cost_model.forward_cost() is not None


def test_an_idle_node_times_the_warm_up_forwards_left_and_serves_meanwhile(tmp_path: Path, monkeypatch) -> None:
    import asyncio

    from attnstore_node import model as served
    from attnstore_node.batcher import Batcher
    from attnstore_node.settings import BatcherSettings

    folder = tmp_path / "tiny-llama"
    loaded = save_tiny_llama(folder)
    store = decoder_store(tmp_path / "store", loaded)
    monkeypatch.setattr(served, "warm_up", lambda cache: warm_up(cache, seconds=0.0))  # all left to the idle loop
    batcher = Batcher(lambda: AttnCache(str(folder), store), "tiny", BatcherSettings(max_wait_ms=1))

    async def scenario():
        await asyncio.to_thread(wait_until, lambda: batcher.info is not None, 60, "the batcher's model loaded")
        return await batcher.score(["a short prompt"], [1037, 1038], softmax=True, max_input_tokens=64)

    batcher.start()
    try:
        scored = asyncio.run(scenario())
        assert scored.vectors.shape == (1, 2)
        wait_until(lambda: batcher.cache.cost_model.forward_cost() is not None, 60,
                   "the idle batcher's warm-up done (a forward cost fitted)")
    finally:
        batcher.stop()


def test_a_tiny_decoder_node_warms_up_and_is_healthy_within_30_s(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    loaded = save_tiny_llama(folder)
    node = NodeProcess(str(folder), decoder_store(tmp_path / "store", loaded), tmp_path / "node")
    try:
        seconds = healthy_within(node, READY_SECONDS)
        assert seconds < READY_SECONDS and "event=warmed_up" in node.log(), node.log()
    finally:
        node.kill()


@pytest.mark.real_model
def test_a_smollm2_node_is_healthy_within_30_s_and_scores_as_the_plain_forward(tmp_path: Path) -> None:
    # The node's start is its imports, the model read from the de-quantised folder load_model keeps (the GGUF
    # file is de-quantised once, by the load_model below on a fresh machine) and a warm-up held to its budget.
    import re

    import numpy as np
    import torch

    from attnstore_client.models import load_model

    loaded = load_model("smollm2")
    node = NodeProcess("smollm2", decoder_store(tmp_path / "store", loaded), tmp_path / "node")
    try:
        seconds = healthy_within(node, READY_SECONDS)
        assert seconds < READY_SECONDS, node.log()
        warmed = re.search(r"event=warmed_up .*? seconds=([\d.]+)", node.log())
        assert warmed is not None and float(warmed.group(1)) < 15.0, node.log()
        example = {"query": "The capital of France is", "items": [" Paris", " London", " Berlin"],
                   "label_token_ids": [9454, 2753], "apply_softmax": False}
        answer = httpx.post(f"{node.url}/v1/score", json=example, timeout=300)
        assert answer.status_code == 200, answer.text
        rows = [loaded.tokenizer(example["query"] + item)["input_ids"] for item in example["items"]]
        expected = []
        with torch.inference_mode():
            for row in rows:
                last = loaded.model(input_ids=torch.tensor([row])).last_hidden_state[0, -1]  # (hidden,)
                probabilities = torch.softmax(loaded.lm_head(last).float(), -1)  # (vocab,)
                expected.append(probabilities[example["label_token_ids"]].numpy())
        assert np.abs(np.array(answer.json()["scores"]) - np.array(expected)).max() < 1e-4
    finally:
        node.kill()
