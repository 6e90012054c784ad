"""int8 computing: the quantised copy of a model, and ``AttnCache(int8=True)`` on a namespace's plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from attnstore.errors import ConfigError
from attnstore.index import ExactIndex
from attnstore.projector.int8_plan import Int8Plan
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.adapters import adapter_for
from attnstore_client.cache import AttnCache
from attnstore_client.connection.local import LocalConnection
from attnstore_client.int8 import int8_candidates, linear_flops, quantized_model
from attnstore_client.models import LoadedModel
from attnstore_tools.build.namespace_layout import token_limits
from tests.support.caches import capture_entries, fill_namespace, mean_pooled, sentences, tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess
from tests.support.vectors import row_cosines

TEXTS = sentences(12, seed=3)
STORED = TEXTS[:4]


@pytest.fixture(scope="module")
def bert() -> LoadedModel:
    return tiny_loaded("bert")


def _attention_linears(loaded: LoadedModel) -> tuple[str, ...]:
    return tuple(name for name in int8_candidates(adapter_for(loaded)) if ".attention." in name)


def _service(loaded: LoadedModel, plan: Int8Plan | None) -> AttnStoreService:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, loaded, STORED, int8=plan)
    return service


def _plan(linears: tuple[str, ...]) -> Int8Plan:
    return Int8Plan(linears, fidelity=0.99, target=0.995, share=1.0, rows=8, flops_share=0.5)


def test_the_candidates_are_the_linear_layers_inside_the_blocks(bert: LoadedModel) -> None:
    candidates = int8_candidates(adapter_for(bert))
    layers = bert.model.config.num_hidden_layers
    assert len(candidates) == 6 * layers  # q, k, v, attention output, intermediate, output
    assert all(name.startswith("encoder.layer.") for name in candidates)  # not the pooler
    assert linear_flops(bert.model, candidates[:1]) == bert.model.config.hidden_size ** 2


def test_a_quantised_copy_shares_every_tensor_it_does_not_quantise(bert: LoadedModel) -> None:
    chosen = _attention_linears(bert)[:2]
    quantized = quantized_model(bert.model, chosen)
    modules = dict(quantized.named_modules())
    originals = dict(bert.model.named_modules())
    for name in chosen:
        assert isinstance(modules[name], torch.ao.nn.quantized.dynamic.Linear)
        assert type(originals[name]) is nn.Linear  # the fp32 model is left as it was
    shared = {name: t.data_ptr() for name, t in quantized.state_dict().items() if isinstance(t, torch.Tensor)}
    for name, tensor in bert.model.state_dict().items():
        if not any(name.startswith(f"{linear}.") for linear in chosen):
            assert shared[name] == tensor.data_ptr(), name


def test_a_plan_naming_a_layer_the_model_lacks_is_refused_naming_it(bert: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="encoder.layer.99.output.dense"):
        quantized_model(bert.model, ["encoder.layer.99.output.dense"])


def test_int8_rows_are_close_to_fp32_counted_and_kept_nowhere(bert: LoadedModel) -> None:
    service = _service(bert, _plan(_attention_linears(bert)))
    with AttnCache(bert, LocalConnection("local:memory", service), maps=False, int8=True) as cache:
        first = cache.encode(TEXTS, batch_size=4)
        stats = cache.last_stats
        assert (stats.exact_hits, stats.misses, stats.int8_rows) == (4, 8, 8)
        expected = mean_pooled(bert, TEXTS)
        np.testing.assert_allclose(first[:4], expected[:4], atol=2e-3)  # exact hits: the stored fp32 outputs
        assert not np.allclose(first[4:], expected[4:], atol=1e-5)  # computed in int8 ...
        assert row_cosines(first[4:], expected[4:]).min() > 0.99  # ... and close
        cache.encode(TEXTS, batch_size=4)
        again = cache.last_stats
        assert (again.local_hits, again.int8_rows) == (0, 8)  # no int8 row entered this process's exact tier
        cache.int8 = False
        np.testing.assert_allclose(cache.encode(TEXTS[4:], batch_size=4), expected[4:], atol=1e-5)
        assert cache.last_stats.int8_rows == 0


def test_int8_in_a_namespace_without_a_plan_is_refused_naming_it(bert: LoadedModel) -> None:
    service = _service(bert, None)
    with AttnCache(bert, LocalConnection("local:memory", service), int8=True) as cache:
        with pytest.raises(ConfigError, match="'default' has none.*--int8"):
            cache.encode(TEXTS)


def test_int8_is_a_boolean_setting(bert: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="int8 must be True or False"):
        AttnCache(bert, LocalConnection("local:memory", _service(bert, None)), int8="yes")  # type: ignore[arg-type]


def test_rows_the_daemon_admits_are_computed_in_fp32_and_written_back_exact(bert: LoadedModel, tmp_path) -> None:
    daemon = DaemonProcess(tmp_path / "store", tmp_path, extra_args=("--admit-after", "1")).start()
    try:
        captured = capture_entries(bert, STORED)
        captured.projector.int8 = _plan(_attention_linears(bert))
        with daemon.client(ADMIN_TOKEN) as admin:
            admin.create_namespace("default", model=bert.name, fingerprint=captured.fingerprint,
                                   layout=captured.layout, projector=captured.projector.to_safetensors_bytes(),
                                   limits=token_limits(bert))  # what write-back checks token ids against
            admin.ingest("default", captured.fingerprint, captured.entries)
        url, expected = f"grpc://{daemon.target}", mean_pooled(bert, TEXTS)
        with AttnCache(bert, url, token=WRITE_TOKEN, write_back=True, maps=False, int8=True) as writer:
            written = writer.encode(TEXTS, batch_size=4)
            assert (writer.last_stats.misses, writer.last_stats.int8_rows) == (8, 0)  # every miss admitted: fp32
        np.testing.assert_allclose(written[4:], expected[4:], atol=1e-5)  # computed in fp32 (the rest: stored)
        unseen = sentences(4, seed=99)
        with AttnCache(bert, url, token=READ_TOKEN, maps=False, int8=True, exact_cache_bytes=0) as reader:
            served = reader.encode(TEXTS + unseen, batch_size=4)
            stats = reader.last_stats
        assert (stats.exact_hits, stats.int8_rows) == (12, 4)  # what was written back, then the unseen in int8
        np.testing.assert_allclose(served[:12], expected, atol=2e-3)  # the stored fp32 outputs (fp16)
    finally:
        daemon.kill()
