"""Pinned-memory staging: what the tiers copy from the host to the GPU (stored outputs, streamed maps) arrives
whole, on the device, as the CPU has it."""

from __future__ import annotations

import numpy as np
import torch

from attnstore.index import ExactIndex
from attnstore.service import AttnStoreService
from attnstore.store import MemoryMapStore
from attnstore_client.cache import AttnCache
from attnstore_client.connection.local import LocalConnection
from attnstore_client.tiers.maps import StreamedLayers
from tests.support.caches import fill_namespace, sentences, tiny_loaded


class _Stream:
    """A map stream whose layers are host arrays (as a connection delivers them)."""

    def __init__(self, maps: np.ndarray) -> None:
        self.maps = maps  # (layers, H, L, L)
        self.asked: list[int] = []

    def layer(self, row: int, layer: int) -> np.ndarray:
        self.asked.append(layer)
        return self.maps[layer]


def _cache(device: torch.device) -> AttnCache:
    service = AttnStoreService(MemoryMapStore(), make_index=ExactIndex)
    fill_namespace(service, tiny_loaded("bert"), sentences(2))
    return AttnCache(tiny_loaded("bert"), LocalConnection("local:memory", service), device=device)


def test_stored_outputs_are_staged_to_the_device_as_fp32(device) -> None:
    context = _cache(device)._context
    outputs = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float16)
    staged = context.to_device(outputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert staged.device.type == device.type and staged.dtype == torch.float32
    assert torch.equal(staged.cpu(), torch.from_numpy(outputs).float())


def test_streamed_maps_are_staged_layer_by_layer_when_the_forward_asks(device) -> None:
    context = _cache(device)._context
    maps = np.random.default_rng(1).random((3, 4, 9, 9), dtype=np.float32).astype(np.float16)
    stream = _Stream(maps)
    layers = StreamedLayers(stream, 0, 3, context)
    assert stream.asked == []
    second = layers[1]
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert stream.asked == [1] and second.device.type == device.type
    assert torch.equal(second.cpu(), torch.from_numpy(maps[1]))
    assert all(torch.equal(got.cpu(), torch.from_numpy(want)) for got, want in zip(layers[:], maps, strict=True))


def test_many_staged_copies_in_flight_each_arrive_whole(device) -> None:
    context = _cache(device)._context
    arrays = [np.full((64, 64), i, dtype=np.float16) for i in range(32)]
    staged = [context.to_device(a) for a in arrays]  # non-blocking copies queued back to back
    if device.type == "cuda":
        torch.cuda.synchronize()
    for i, tensor in enumerate(staged):
        assert bool((tensor == i).all())
