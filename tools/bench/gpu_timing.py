"""The timings of ``attnstore bench gpu``: plain, packed and replaying forwards on one device, and what fetching a
hit's maps and copying them there costs against the forward the hit saves.

Per model and length, one batch of random token ids (fixed seed) is captured once by the fp32 model on the CPU
(``Adapter.capture`` keeps maps in fp32 host buffers) and its maps are kept on the device in fp16 (what a store
holds); per dtype, a copy of the model is cast and moved to the device. The plain forward (the model's ``sdpa``
attention: the baseline), the packed forward (rows end to end, ``forward_packed``) and the all-hit replaying
forward then run round-robin (``timing.time_rounds``), each call ending with a device synchronisation, so a time
is the call's end to end. The attention modules' own time is read in separate passes with hooks that synchronise
around each module (they slow the pass they run in, which is why it is not the timed one).

Fetch and copy: one entry per length is written to an LMDB store in a scratch folder; fetching its maps through
an embedded connection and copying them to the device through pinned memory (as the map tier does) is timed
against a plain and a replaying forward of that one row.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from attnstore_tools.timing import median_ms, time_rounds

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = ("plain", "packed", "replay")


@dataclass(frozen=True, slots=True)
class ForwardTiming:
    """One (model, dtype, length) row of the table: medians in ms, speedups against the plain (sdpa) forward."""

    model: str
    dtype: str
    length: int
    batch: int
    plain_ms: float
    packed_ms: float
    replay_ms: float
    plain_attention_ms: float
    packed_attention_ms: float
    replay_attention_ms: float
    replay_speedup: float  # plain / replay, end to end
    replay_attention_speedup: float  # plain / replay, attention modules only
    max_abs_diff: float  # replay's last hidden states against the plain forward's


@dataclass(frozen=True, slots=True)
class FetchTiming:
    """One (model, length) row: a hit's maps fetched and copied to the device, against the forward it saves."""

    model: str
    dtype: str
    length: int
    map_bytes: int
    fetch_ms: float  # read from the store (embedded LMDB), every layer
    fetch_copy_ms: float  # read and copied to the device through pinned memory
    plain_ms: float  # one row's plain forward
    replay_ms: float  # one row's replaying forward, maps already on the device
    saved_ms: float  # plain - replay: what the hit saves
    net_ms: float  # saved - fetch_copy: positive when a hit pays even without overlap


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_rows(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    """``batch`` rows of ``length`` random token ids, above the low ids where tokenizers keep special tokens."""
    generator = torch.Generator().manual_seed(seed + length)
    return torch.randint(min(1000, vocab // 2), vocab, (batch, length), generator=generator).tolist()


def attention_ms(adapter, call: Callable[[], object], device: torch.device, *, passes: int = 3) -> float:
    """The attention modules' time in one call of ``call`` (median of ``passes``), synchronising around each."""
    totals: list[float] = []
    starts: dict[int, float] = {}
    spent = [0.0]

    def before(module: torch.nn.Module, _inputs: object) -> None:
        synchronize(device)
        starts[id(module)] = time.perf_counter()

    def after(module: torch.nn.Module, _inputs: object, _output: object) -> None:
        synchronize(device)
        spent[0] += time.perf_counter() - starts.pop(id(module))

    handles = []
    try:
        for module in adapter.attention_modules:
            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(after))
        for _ in range(passes):
            spent[0] = 0.0
            call()
            totals.append(spent[0] * 1000.0)
    finally:
        for handle in handles:
            handle.remove()
    return statistics.median(totals)


def captured_maps(loaded, rows: list[list[int]]) -> list[torch.Tensor]:
    """Each row's maps ``(layers, H, L, L)`` in fp16, captured by the fp32 model on the CPU (``Adapter.capture``
    keeps its maps in fp32 host buffers, so it runs where the model is fp32 and on the CPU)."""
    from attnstore_client.adapters import adapter_for
    from attnstore_client.adapters.batch import batch_from_ids

    with torch.inference_mode():
        return [m.to(torch.float16) for m in adapter_for(loaded).capture(batch_from_ids(rows, pad_id=0)).maps]


def on_device(loaded, device: torch.device, dtype: str):
    """A copy of the (CPU, fp32) loaded model cast to ``dtype`` on ``device``; the original stays as it was."""
    from dataclasses import replace

    model = copy.deepcopy(loaded.model).to(device=device, dtype=DTYPES[dtype])
    return replace(loaded, model=model, sentence_transformer=None)


def time_forwards(loaded, alias: str, dtypes: Sequence[str], lengths: Sequence[int], *, batch: int, repeats: int,
                  warmup: int, seed: int, device: torch.device) -> list[ForwardTiming]:
    """The table's rows for one model (``loaded``: fp32 on the CPU, left so), every dtype and length."""
    from attnstore_client.adapters import adapter_for
    from attnstore_client.adapters.batch import batch_from_ids
    from attnstore_client.adapters.packed import pack

    vocab = loaded.model.config.vocab_size
    inputs = {length: random_rows(vocab, batch, length, seed) for length in lengths}
    maps = {length: captured_maps(loaded, rows) for length, rows in inputs.items()}  # per row (layers, H, L, L)
    rows_out = []
    for dtype in dtypes:
        adapter = adapter_for(on_device(loaded, device, dtype))
        for length in lengths:
            padded = batch_from_ids(inputs[length], pad_id=0).to(device)
            packed = pack(inputs[length]).to(device)
            replay = {row: m.to(device) for row, m in enumerate(maps[length])}
            rows_out.append(_time_length(adapter, alias, dtype, length, padded, packed, replay, repeats=repeats,
                                         warmup=warmup, device=device))
            del replay
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del adapter
    return rows_out


def _time_length(adapter, alias: str, dtype: str, length: int, padded, packed, replay, *, repeats: int,
                 warmup: int, device: torch.device) -> ForwardTiming:
    def plain() -> torch.Tensor:
        out = adapter.forward(padded)  # (B, L, hidden)
        synchronize(device)
        return out

    def packed_forward() -> torch.Tensor:
        out = adapter.forward_packed(packed)[0]  # (B * L, hidden)
        synchronize(device)
        return out

    def replayed() -> torch.Tensor:
        out = adapter.forward(padded, replay)  # (B, L, hidden)
        synchronize(device)
        return out

    calls: dict[str, Callable[[], torch.Tensor]] = {"plain": plain, "packed": packed_forward, "replay": replayed}
    samples = time_rounds(calls, repeats=repeats, warmup=warmup, rotate=True)
    ms = {name: median_ms(s.seconds for s in samples[name]) for name in VARIANTS}
    attention = {name: attention_ms(adapter, calls[name], device) for name in VARIANTS}
    diff = (samples["replay"][0].value.float() - samples["plain"][0].value.float()).abs().max().item()
    return ForwardTiming(
        model=alias, dtype=dtype, length=length, batch=padded.size,
        plain_ms=round(ms["plain"], 4), packed_ms=round(ms["packed"], 4), replay_ms=round(ms["replay"], 4),
        plain_attention_ms=round(attention["plain"], 4), packed_attention_ms=round(attention["packed"], 4),
        replay_attention_ms=round(attention["replay"], 4),
        replay_speedup=round(ms["plain"] / ms["replay"], 3),
        replay_attention_speedup=round(attention["plain"] / attention["replay"], 3) if attention["replay"] else 0.0,
        max_abs_diff=round(diff, 5),
    )


def time_fetches(loaded, alias: str, dtype: str, lengths: Sequence[int], *, repeats: int, warmup: int, seed: int,
                 device: torch.device) -> list[FetchTiming]:
    """The fetch-and-copy rows for one model (``loaded``: fp32 on the CPU, left so) at one dtype."""
    from attnstore.service import AttnStoreService
    from attnstore.store import NamespaceLayout, NewEntry
    from attnstore_client.adapters import adapter_for
    from attnstore_client.adapters.batch import batch_from_ids
    from attnstore_client.connection.local import LocalConnection
    from attnstore_client.keys import token_hash

    adapter = adapter_for(on_device(loaded, device, dtype))
    vocab = loaded.model.config.vocab_size
    rows_out = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-store-") as scratch, \
            AttnStoreService.open(Path(scratch) / "store", create=True) as service:
        layout = NamespaceLayout(layers=adapter.num_layers, heads=adapter.num_heads, causal=adapter.causal,
                                 hidden=adapter.hidden_size, feature_dim=16)
        service.create_namespace("gpu", model=alias, fingerprint="bench-gpu", layout=layout)
        connection = LocalConnection(f"local:{scratch}/store", service)
        for length in lengths:
            row = random_rows(vocab, 1, length, seed)
            maps = captured_maps(loaded, row)[0]  # (layers, H, L, L) fp16
            entry = NewEntry(maps=maps.numpy(), token_hash=token_hash(torch.tensor(row[0])),
                             outputs=None, feature=np.zeros(16, dtype=np.float32))
            entry_id = service.ingest("gpu", "bench-gpu", [entry]).entry_ids[0]
            batch = batch_from_ids(row, pad_id=0).to(device)
            replay = {0: maps.to(device)}

            def fetch(copy: bool, entry_id: int = entry_id, length: int = length) -> None:
                stream = connection.fetch_maps("gpu", "bench-gpu", [(entry_id, length)], timeout=None)
                for layer in range(adapter.num_layers):
                    layer_maps = torch.from_numpy(stream.layer(0, layer))  # (H, L, L), zero-copy
                    if copy and device.type != "cpu":
                        layer_maps.pin_memory().to(device, non_blocking=True)
                stream.close()
                synchronize(device)

            def plain(batch=batch) -> None:
                adapter.forward(batch)
                synchronize(device)

            def replayed(batch=batch, replay=replay) -> None:
                adapter.forward(batch, replay)
                synchronize(device)

            calls: dict[str, Callable[[], None]] = {
                "fetch": lambda fetch=fetch: fetch(False), "fetch_copy": lambda fetch=fetch: fetch(True),
                "plain": plain, "replay": replayed,
            }
            samples = time_rounds(calls, repeats=repeats, warmup=warmup, rotate=True)
            ms = {name: median_ms(s.seconds for s in samples[name]) for name in calls}
            saved = ms["plain"] - ms["replay"]
            rows_out.append(FetchTiming(
                model=alias, dtype=dtype, length=length, map_bytes=int(maps.numel() * maps.element_size()),
                fetch_ms=round(ms["fetch"], 4), fetch_copy_ms=round(ms["fetch_copy"], 4),
                plain_ms=round(ms["plain"], 4), replay_ms=round(ms["replay"], 4), saved_ms=round(saved, 4),
                net_ms=round(saved - ms["fetch_copy"], 4),
            ))
    return rows_out


def table(rows: Sequence[ForwardTiming | FetchTiming], columns: Sequence[tuple[str, str, int]]) -> str:
    """``rows`` as a fixed-width table: (field, title, width) per column."""
    lines = ["".join(title.rjust(width) for _, title, width in columns)]
    for row in rows:
        values = asdict(row)
        lines.append("".join(f"{values[key]}".rjust(width) for key, _, width in columns))
    return "\n".join(lines)


FORWARD_COLUMNS: Sequence[tuple[str, str, int]] = (
    ("model", "model", 9), ("dtype", "dtype", 6), ("length", "L", 5), ("batch", "B", 4),
    ("plain_ms", "sdpa ms", 10), ("packed_ms", "packed ms", 11), ("replay_ms", "replay ms", 11),
    ("plain_attention_ms", "attn sdpa", 11), ("packed_attention_ms", "attn pack", 11),
    ("replay_attention_ms", "attn repl", 11), ("replay_speedup", "x e2e", 8),
    ("replay_attention_speedup", "x attn", 8), ("max_abs_diff", "max diff", 10),
)
FETCH_COLUMNS: Sequence[tuple[str, str, int]] = (
    ("model", "model", 9), ("dtype", "dtype", 6), ("length", "L", 5), ("map_bytes", "map bytes", 11),
    ("fetch_ms", "fetch ms", 10), ("fetch_copy_ms", "+copy ms", 10), ("plain_ms", "sdpa ms", 10),
    ("replay_ms", "replay ms", 11), ("saved_ms", "saved ms", 10), ("net_ms", "net ms", 10),
)
