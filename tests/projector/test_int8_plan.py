"""The int8 plan: its record, and its place in a projector blob's metadata."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import safetensors.numpy

from attnstore.errors import ConfigError, FormatVersionError
from attnstore.projector.blob import int8_plan_from_projector
from attnstore.projector.int8_plan import INT8_METADATA_KEY, Int8Plan
from attnstore_client.projector import Projector, ProjectorConfig

PLAN = Int8Plan(("encoder.layer.0.attention.self.query", "encoder.layer.1.output.dense"), fidelity=0.99,
                target=0.995, share=0.998, rows=512, flops_share=0.25)


def test_a_plan_survives_json_unchanged() -> None:
    assert Int8Plan.from_json(PLAN.to_json()) == PLAN
    with_graph = dataclasses.replace(PLAN, graph_linears=PLAN.linears, graph_share=1.0)
    assert Int8Plan.from_json(with_graph.to_json()) == with_graph


def test_a_plan_written_before_graph_layers_reads_with_none() -> None:
    record = json.loads(PLAN.to_json())
    del record["graph_linears"], record["graph_share"]
    plan = Int8Plan.from_json(json.dumps(record))
    assert (plan.graph_linears, plan.graph_share) == ((), 0.0) and plan.linears == PLAN.linears


@pytest.mark.parametrize(("field", "value"), [("share", 1.5), ("fidelity", -0.1), ("target", float("nan")),
                                              ("rows", 0), ("linears", ("",)),
                                              ("graph_linears", (3,)), ("graph_share", 2.0)])
def test_a_plan_with_a_bad_value_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(PLAN, **{field: value})


def test_malformed_plan_json_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="malformed"):
        Int8Plan.from_json('{"linears": ["a"]}')


def test_a_projector_carries_its_plan_through_its_blob() -> None:
    projector = Projector(ProjectorConfig(hidden=8, segments=2, width=4, dim=4))
    assert Projector.from_safetensors_bytes(projector.to_safetensors_bytes()).int8 is None
    projector.int8 = PLAN
    blob = projector.to_safetensors_bytes()
    assert int8_plan_from_projector(blob) == PLAN
    assert Projector.from_safetensors_bytes(blob).int8 == PLAN


def test_a_malformed_stored_plan_is_a_format_error() -> None:
    blob = safetensors.numpy.save({"x": np.zeros(1, np.float32)}, metadata={INT8_METADATA_KEY: "{not json"})
    with pytest.raises(FormatVersionError, match="Int8Plan"):
        int8_plan_from_projector(blob)
