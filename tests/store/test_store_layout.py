"""Namespace layout and info: validation with clear messages, JSON round trip."""

from __future__ import annotations

import pytest

from attnstore.errors import ConfigError
from attnstore.protocol.records import NamespaceInfo, NamespaceLayout, check_namespace_name


def test_layout_json_round_trip_and_sizes():
    layout = NamespaceLayout(layers=30, heads=9, causal=True, hidden=576, codec="q8+zstd")
    assert NamespaceLayout.from_json_dict(layout.to_json_dict()) == layout
    assert layout.map_nbytes(128) == 8_847_360
    assert layout.outputs_nbytes(128) == 128 * 576 * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": 0}, "layers must be a positive int"),
        ({"heads": 2.0}, "heads must be a positive int"),
        ({"codec": "lz4"}, r"codec 'lz4' is not supported; choose one of \('fp16', 'zstd', 'q8', 'q8\+zstd'\)"),
        ({"dtype": "float32"}, "dtype 'float32' is not supported"),
        ({"causal": 1}, "causal must be a bool"),
    ],
)
def test_invalid_layouts_name_the_bad_value_and_the_choices(kwargs, message):
    fields = {"layers": 2, "heads": 2, "causal": True, "hidden": 4, **kwargs}
    with pytest.raises(ConfigError, match=message):
        NamespaceLayout(**fields)


def test_layout_from_json_with_a_missing_field_raises():
    with pytest.raises(ConfigError, match="missing field 'codec'"):
        NamespaceLayout.from_json_dict(
            {"layers": 1, "heads": 1, "causal": True, "hidden": 1, "feature_dim": 1, "dtype": "float16"}
        )


def test_namespace_info_round_trips_with_its_projector_kept_apart():
    layout = NamespaceLayout(layers=1, heads=1, causal=False, hidden=4)
    info = NamespaceInfo("n", "model", "ab" * 32, layout, 1, 123.0, b"blob")
    data = info.to_json_dict()
    assert "projector" not in data
    assert NamespaceInfo.from_json_dict(data, b"blob") == info


@pytest.mark.parametrize("name", ["", "a/b", "-x", "a\x00b", "x" * 129, 3])
def test_bad_namespace_names_are_refused(name):
    with pytest.raises(ConfigError, match="namespace name"):
        check_namespace_name(name)
