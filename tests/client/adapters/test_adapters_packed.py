"""Packed forwards (``Adapter.forward_packed``): every family gives the padded forward's outputs, nothing padded.

The rows of a packed forward run end to end in one sequence, positions restarting
per row, attention per run of equal-length rows: with and without map replay,
keeping maps for write-back, sliding windows (Mistral's, ModernBERT's local layers) and RoBERTa's positions.
"""

from __future__ import annotations

import pytest
import torch

from attnstore.errors import ConfigError, MapShapeError
from attnstore_client.adapters import Adapter, adapter_for
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.adapters.fused import FusedLinears, padded_tokens
from attnstore_client.adapters.packed import SHORT_ROW, pack, with_filler
from tests.support.adapters import max_diff, pad_id, random_rows, tiny_model

TOL = 1e-4
# Longest first, with runs of equal lengths (the order the client packs rows in); longer than Mistral's window.
LENGTHS = [11, 9, 9, 9, 6, 3, 3]
KINDS = ["bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "modernbert", "llama", "mistral", "qwen2", "qwen3",
         "gemma3_text", "embeddinggemma"]


@pytest.fixture(params=KINDS, scope="module")
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def adapter(kind: str) -> Adapter:
    return adapter_for(tiny_model(kind))


@pytest.fixture(scope="module")
def rows() -> list[list[int]]:
    return random_rows(LENGTHS, seed=4)


def _padded_rows(adapter: Adapter, rows: list[list[int]], kind: str, replay=None) -> list[torch.Tensor]:
    batch = batch_from_ids(rows, pad_id(kind))
    out = adapter.forward(batch, replay)  # (B, P, hidden)
    return [out[r, :length] for r, length in enumerate(batch.lengths)]


def test_a_packed_forward_gives_every_row_the_padded_forwards_outputs(adapter: Adapter, rows, kind: str) -> None:
    packed = pack(rows)
    out, kept = adapter.forward_packed(packed)
    assert out.shape == (sum(LENGTHS), adapter.hidden_size) and kept == {}
    for r, expected in enumerate(_padded_rows(adapter, rows, kind)):
        assert max_diff(packed.row(out, r), expected) < TOL


def test_rows_replaying_maps_in_a_packed_forward_match_the_padded_replay(adapter: Adapter, rows, kind: str) -> None:
    captured = adapter.capture(batch_from_ids(rows, pad_id(kind))).maps  # per row (layers, H, L, L) fp32
    replay = {1: captured[1], 5: captured[5], 6: captured[6]}  # a whole run of 3-token rows, and one of a run
    packed = pack(rows)
    out, _ = adapter.forward_packed(packed, replay)
    expected = _padded_rows(adapter, rows, kind, replay)
    for r in range(len(rows)):
        assert max_diff(packed.row(out, r), expected[r]) < TOL


def test_a_packed_forward_of_replaying_rows_only_computes_no_queries_or_keys(adapter: Adapter, rows, kind) -> None:
    captured = adapter.capture(batch_from_ids(rows, pad_id(kind))).maps
    called: list[int] = []
    own = adapter._queries_keys

    def counted(*args, **kwargs):
        called.append(1)
        return own(*args, **kwargs)

    adapter._queries_keys = counted  # type: ignore[method-assign]
    try:
        packed = pack(rows)
        out, _ = adapter.forward_packed(packed, dict(enumerate(captured)))
    finally:
        del adapter._queries_keys
    assert called == []
    for r, expected in enumerate(_padded_rows(adapter, rows, kind)):
        assert max_diff(packed.row(out, r), expected) < TOL  # its own maps: the plain outputs


def test_kept_maps_of_a_packed_forward_are_the_captured_maps_and_outputs_stay_the_plain_ones(
    adapter: Adapter, rows, kind: str
) -> None:
    captured = adapter.capture(batch_from_ids(rows, pad_id(kind))).maps
    packed = pack(rows)
    out, kept = adapter.forward_packed(packed, {0: captured[0]}, keep=[2, 4])
    assert sorted(kept) == [2, 4]
    for row in (2, 4):
        assert kept[row].dtype == torch.float16 and kept[row].shape == captured[row].shape
        assert max_diff(kept[row].float(), captured[row]) < 1e-3  # fp16 as stored
    for r, expected in enumerate(_padded_rows(adapter, rows, kind)):
        assert max_diff(packed.row(out, r), expected) < TOL


def test_a_row_cannot_both_replay_and_keep_its_maps(adapter: Adapter, rows, kind: str) -> None:
    captured = adapter.capture(batch_from_ids(rows[:2], pad_id(kind))).maps
    with pytest.raises(MapShapeError, match="cannot keep"):
        adapter.forward_packed(pack(rows[:2]), {0: captured[0]}, keep=[0])
    with pytest.raises(MapShapeError, match="cannot keep"):
        adapter.forward_packed(pack(rows[:2]), keep=[7])


def test_packing_no_rows_or_an_empty_row_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="at least one row"):
        pack([])
    with pytest.raises(ConfigError, match="row 1 is empty"):
        pack([[5, 6], []])


def test_a_packed_batch_keeps_each_rows_positions_and_place() -> None:
    packed = pack([[7, 8, 9], [10], [11, 12]])
    assert packed.input_ids.tolist() == [7, 8, 9, 10, 11, 12]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert (packed.lengths, packed.starts, packed.size, packed.tokens) == ((3, 1, 2), (0, 3, 4), 3, 6)
    assert packed.row(packed.input_ids, 2).tolist() == [11, 12]


def test_onednn_linear_kernels_give_the_same_outputs_and_leave_the_model_as_it_was(adapter: Adapter, rows) -> None:
    packed = pack(rows)
    adapter.fused_linears = False
    plain, _ = adapter.forward_packed(packed)
    adapter.fused_linears = True
    fused, _ = adapter.forward_packed(packed)
    assert max_diff(fused, plain) < 1e-5
    assert not any("forward" in module.__dict__ for module in adapter.model.modules())  # nothing left patched


def test_released_onednn_kernels_leave_forwards_on_torchs_own_with_the_same_outputs(adapter: Adapter, rows) -> None:
    packed = pack(rows)
    adapter.fused_linears = True
    fused, _ = adapter.forward_packed(packed)
    adapter.release_fused_linears()
    assert adapter.linear_kernels == "torch" and adapter._fused is None  # the reordered weights given back
    plain, _ = adapter.forward_packed(packed)
    assert adapter._fused is None and max_diff(fused, plain) < 1e-5


def test_fused_linears_see_few_token_counts_and_pad_little() -> None:
    counts = range(1, 8193)
    assert len({padded_tokens(tokens) for tokens in counts}) <= 96  # oneDNN keeps a kernel per shape
    for tokens in counts:
        assert 0 <= padded_tokens(tokens) - tokens <= max(63, tokens // 32)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_fused_linears_give_each_row_the_plain_layers_output_whatever_the_token_count() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    fused = FusedLinears(model, {})
    x = torch.randn(200, 8)
    with torch.no_grad():
        expected = model(x)
        with fused.installed():
            outputs = [model(x[:tokens]) for tokens in range(1, 201)]
    for tokens, out in enumerate(outputs, start=1):  # an unrounded count is padded inside, never seen outside
        assert out.shape == (tokens, 4) and torch.allclose(out, expected[:tokens], atol=1e-5)


def test_a_rounded_token_count_rounds_to_itself() -> None:
    for tokens in range(1, 20_000):
        rounded = padded_tokens(tokens)
        assert padded_tokens(rounded) == rounded


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_a_packed_forward_runs_its_linear_layers_at_rounded_counts_only(adapter: Adapter, rows, kind: str) -> None:
    adapter.fused_linears = True
    seen: list[int] = []
    linears = [m for m in adapter.model.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[-2])) for m in linears]
    try:
        packed = pack(rows)  # 50 tokens: filler rows make 64 of them
        out, _ = adapter.forward_packed(packed)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen and all(tokens == padded_tokens(tokens) for tokens in seen)
    assert out.shape == (packed.tokens, adapter.hidden_size)
    for r, expected in enumerate(_padded_rows(adapter, rows, kind)):  # the filler is invisible to the rows
        assert max_diff(packed.row(out, r), expected) < TOL


def test_filler_rows_follow_the_rows_and_leave_them_in_place() -> None:
    packed = pack([[7, 8, 9], [10]])
    filled = with_filler(packed, 130)
    assert filled.tokens == 134 and filled.lengths == (3, 1, 64, 64, 2)
    assert filled.row(filled.input_ids, 0).tolist() == [7, 8, 9] and filled.row(filled.input_ids, 1).tolist() == [10]
    assert filled.position_ids[4:].tolist() == list(range(64)) * 2 + [0, 1]
    assert with_filler(packed, 0) is packed


def _linear_token_counts(adapter: Adapter, packed) -> list[int]:
    seen: list[int] = []
    linears = [m for m in adapter.model.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[-2])) for m in linears]
    try:
        adapter.forward_packed(packed)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize(("capability", "kernels"), [("AVX512", "onednn"), ("AVX2", "torch")])
def test_auto_runs_the_linear_layers_on_onednn_only_where_the_cpu_runs_avx512(
    rows, monkeypatch: pytest.MonkeyPatch, capability: str, kernels: str
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    adapter = adapter_for(tiny_model("bert"))
    assert adapter.fused_linears == "auto" and adapter.linear_kernels == kernels
    packed = pack(rows)  # 50 tokens
    counts = _linear_token_counts(adapter, packed)
    assert set(counts) == ({padded_tokens(packed.tokens)} if kernels == "onednn" else {packed.tokens})
    assert (adapter._fused is not None) == (kernels == "onednn")  # no second copy of the weights on torch's
    adapter.fused_linears = capability != "AVX512"  # forced the other way
    assert adapter.linear_kernels != kernels


def test_short_rows_attend_as_the_models_own_kernel_does(kind: str) -> None:
    adapter = adapter_for(tiny_model(kind))
    lengths = [SHORT_ROW + 9, SHORT_ROW + 1, SHORT_ROW, SHORT_ROW, 5]  # both sides of the threshold, in one forward
    rows = random_rows(lengths, seed=11)
    packed = pack(rows)
    out, _ = adapter.forward_packed(packed)
    for r, expected in enumerate(_padded_rows(adapter, rows, kind)):
        assert max_diff(packed.row(out, r), expected) < TOL


def test_packed_forwards_on_two_threads_at_once_give_what_each_gives_alone(kind: str) -> None:
    import threading

    adapter = adapter_for(tiny_model(kind))
    batches = [pack(random_rows([12, 7, 7, 3], seed=seed)) for seed in range(6)]
    alone = [adapter.forward_packed(batch)[0] for batch in batches]
    together: dict[int, torch.Tensor] = {}
    start = threading.Barrier(2)

    def worker(indices: range) -> None:
        start.wait()
        for i in indices:
            together[i] = adapter.forward_packed(batches[i])[0]

    threads = [threading.Thread(target=worker, args=(range(k, 6, 2),)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(max_diff(together[i], alone[i]) < 1e-6 for i in range(6))
    assert not any("forward" in module.__dict__ for module in adapter.model.modules())  # nothing left patched
