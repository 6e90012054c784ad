"""``attnstore build`` stores the prefix blocks of a causal model's prompts (tiny local decoder, real LMDB)."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.protocol.prefix import chain_hashes
from attnstore.service import AttnStoreService
from attnstore_client.models import load_model
from attnstore_tools.build.command import BuildConfig, build_namespace
from attnstore_tools.build.prefix import PrefixBuildConfig
from tests.support.adapters import save_tiny_decoder


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    folder = save_tiny_decoder(tmp_path_factory.mktemp("tiny") / "model", full_vocab=True)
    return load_model(str(folder))


def _prompts(count: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "field", "cloud"]
    header = " ".join(rng.choice(words, size=40))  # the shared instruction
    return [f"{header} question {i} " + " ".join(rng.choice(words, size=6)) for i in range(count)]


def test_build_stores_each_prompts_blocks_once_and_a_second_build_runs_no_prompt_again(decoder, tmp_path):
    prompts = _prompts(20)
    config = BuildConfig(calibration=None, prefix=PrefixBuildConfig(block_size=8, min_shared=1))
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        report = build_namespace(decoder, prompts, service, config, progress=False)
        assert report.prefix is not None and report.prefix.prompts == 20
        layout = service.prefixes.layout("default")
        assert layout.block_size == 8 and layout.dtype == "float32"
        ids = [decoder.tokenizer(p)["input_ids"] for p in prompts]
        distinct = {h for row in ids for h in chain_hashes(row, 8)}
        assert report.prefix.blocks == len(distinct) == service.store.stats().prefix_blocks
        assert all(service.store.prefixes.match("default", chain_hashes(row, 8)) == len(row) // 8 for row in ids)
        again = build_namespace(decoder, prompts, service, config, progress=False)
        assert again.prefix.prompts == 0 and again.prefix.blocks == 0


def test_build_without_prefix_blocks_stores_none(decoder, tmp_path):
    config = BuildConfig(calibration=None, prefix_blocks=False)
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        report = build_namespace(decoder, _prompts(20), service, config, progress=False)
        assert report.prefix is None and service.prefixes.layout("default") is None


def test_a_corpus_whose_prompts_share_no_block_records_no_prefix_layout(decoder, tmp_path):
    config = BuildConfig(calibration=None, prefix=PrefixBuildConfig(block_size=8))
    prompts = [f"{i} " + p for i, p in enumerate(_prompts(20))]  # each starts differently
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        report = build_namespace(decoder, prompts, service, config, progress=False)
        assert report.prefix.blocks == 0 and service.prefixes.layout("default") is None


def test_by_default_only_blocks_that_several_prompts_start_with_are_stored(decoder, tmp_path):
    prompts = _prompts(20)
    with AttnStoreService.open(tmp_path / "store", create=True) as service:
        report = build_namespace(decoder, prompts, service, BuildConfig(calibration=None), progress=False)
        ids = [decoder.tokenizer(p)["input_ids"] for p in prompts]
        shared = min(len(a) for a in ids)
        while len({tuple(row[:shared]) for row in ids}) > 1:
            shared -= 1
        blocks = shared // 32  # the default block size
        assert blocks >= 1 and report.prefix.blocks == blocks
        assert all(service.store.prefixes.match("default", chain_hashes(row, 32)) == blocks for row in ids)
