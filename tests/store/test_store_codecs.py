"""Codecs: lossless ones are exact over fp16, q8 stays within its documented bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnstore.errors import ChecksumError, ConfigError
from attnstore.protocol.records import CODECS
from attnstore.store.codecs import codec_for, q8_error_bound, q8_quantize, to_fp16
from tests.support.stores import small_layout, softmax_maps


def _round_trip(codec_name: str, maps: np.ndarray) -> np.ndarray:
    codec = codec_for(codec_name)
    layers = [codec.encode_layer(layer) for layer in maps]
    out = np.empty(maps.shape, dtype=np.float16)
    codec.decode_into(layers, out)
    return out


@pytest.mark.parametrize("codec", ["fp16", "zstd"])
def test_lossless_codecs_return_the_fp16_bits(codec):
    maps = softmax_maps(2, 3, 17, seed=1)
    assert np.array_equal(_round_trip(codec, maps), maps.astype(np.float16))


@pytest.mark.parametrize("codec", ["q8", "q8+zstd"])
def test_q8_codecs_stay_within_the_error_bound(codec):
    maps = softmax_maps(2, 3, 64, seed=2, logit_std=5.0)
    decoded = _round_trip(codec, maps).astype(np.float32)
    assert (np.abs(decoded - maps) <= q8_error_bound(maps.max(axis=-1))[..., None]).all()


@settings(max_examples=60, deadline=None)
@given(
    row_max=st.floats(min_value=0.0, max_value=1.0),
    seed=st.integers(0, 2**16),
    n=st.integers(1, 300),
)
def test_q8_quantisation_error_is_at_most_half_a_step(row_max, seed, n):
    rows = np.random.default_rng(seed).uniform(0.0, row_max, size=(3, n)).astype(np.float32)
    rows[:, 0] = row_max
    codes, scales = q8_quantize(rows)
    s = scales.astype(np.float32)[:, None]
    assert (s * 255 >= rows.max(axis=-1, keepdims=True)).all()  # no code clips
    assert (np.abs(codes * s - rows) <= s / 2 * (1 + 1e-6)).all()
    assert (s <= row_max / 255 * (1 + 2**-10) + 2**-24).all()


def test_all_zero_rows_quantise_to_zero():
    codes, scales = q8_quantize(np.zeros((2, 5), dtype=np.float32))
    assert not codes.any() and not scales.any()


def test_q8_codes_are_smaller_and_zstd_shrinks_causal_maps():
    maps = softmax_maps(1, 4, 64, seed=3)
    sizes = {name: sum(len(c) for c in codec_for(name).encode_layer(maps[0])) for name in CODECS}
    assert sizes["q8"] < 0.6 * sizes["fp16"]
    assert sizes["q8+zstd"] < 0.5 * sizes["q8"]
    assert sizes["zstd"] < sizes["fp16"]


def test_a_truncated_stored_object_raises_checksum_error():
    codec = codec_for("fp16")
    out = np.empty((1, 2, 4, 4), dtype=np.float16)
    with pytest.raises(ChecksumError, match="bytes"):
        codec.decode_into([(b"\x00" * 10,)], out)
    with pytest.raises(ChecksumError, match="zstd"):
        codec_for("zstd").decode_into([(b"garbage",)], out)


def test_unknown_codecs_are_refused_with_the_choices():
    with pytest.raises(ConfigError, match="choose one of"):
        codec_for("lz4")


def test_to_fp16_casts_like_numpy_and_passes_fp16_through():
    values = np.random.default_rng(0).normal(size=(7, 33)).astype(np.float32)
    assert np.array_equal(to_fp16(values), values.astype(np.float16))
    already = values.astype(np.float16)
    assert to_fp16(already) is already


def test_codec_arrays_describe_standard_zarr_arrays():
    maps, scales = codec_for("q8+zstd").arrays(small_layout("q8+zstd"), 16)
    assert (maps.name, maps.dtype, scales.name, scales.dtype) == ("maps", "uint8", "scales", "float16")
    assert [c["name"] for c in maps.zarr_codecs] == ["bytes", "zstd"]
    assert maps.object_key("ns", 16, 12, 3) == b"ns/maps/L16/c/12/3/0/0/0"
    assert scales.object_key("ns", 16, 12, 3) == b"ns/scales/L16/c/12/3/0/0"
