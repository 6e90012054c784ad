"""A namespace's int8 plan: which of the model's linear layers a client may run in int8, and how faithful that was.

Dynamically quantised int8 linears (int8 weights per output channel, activations quantised per call) are
about twice as fast as fp32 on a CPU, but not every layer survives it: on 600 held-out log lines,
all-MiniLM-L6-v2 with every feed-forward layer quantised kept 18% (output layers) and 52% (intermediate layers)
of them at cosine >= 0.99 to the fp32 model, with every attention projection quantised all of them. So which
layers to quantise is chosen when a namespace is built (``attnstore build --int8``,
``attnstore_tools.build.int8``), on texts from its own corpus, as the fidelity gate is: quantised together,
the layers the plan names kept at least ``target`` of those texts at cosine >= ``fidelity`` to the fp32
model's output. A client asked for ``int8=True`` computes the rows no tier served with them; its exact tiers
hold only fp32 outputs.

The plan travels in the namespace's projector blob (``attnstore.projector.blob``), under
``INT8_METADATA_KEY``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from attnstore.errors import ConfigError

INT8_METADATA_KEY = "attnstore.int8_plan"


@dataclass(frozen=True, slots=True)
class Int8Plan:
    """The linear layers to run in int8 and what that kept on the build's calibration rows.

    Attributes:
        linears: module names of the model's ``nn.Linear`` layers to quantise (``model.named_modules()``).
        fidelity: the cosine to the fp32 output a row had to keep.
        target: the share of calibration rows that had to keep it.
        share: the share that did, with every layer of ``linears`` quantised.
        rows: calibration rows.
        flops_share: the share of the linear layers' multiply-adds per token that ``linears`` hold.
        graph_linears: the linear layers an OpenVINO graph runs in int8 (``attnstore_client.tiers.engines.int8``:
            its activations quantised per group of values, finer than torch's, keep more layers faithful); empty
            when none kept the target (or the build had no OpenVINO).
        graph_share: the share of the calibration rows that kept ``fidelity`` on that graph.
    """

    linears: tuple[str, ...]
    fidelity: float
    target: float
    share: float
    rows: int
    flops_share: float
    graph_linears: tuple[str, ...] = ()
    graph_share: float = 0.0

    def __post_init__(self) -> None:
        for field in ("linears", "graph_linears"):
            names = getattr(self, field)
            if not all(isinstance(name, str) and name for name in names):
                raise ConfigError(f"Int8Plan: {field} must be module names, got {names!r}")
        for name in ("fidelity", "target", "share", "flops_share", "graph_share"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and 0.0 <= value <= 1.0):
                raise ConfigError(f"Int8Plan: {name} must be in [0, 1], got {value!r}")
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1:
            raise ConfigError(f"Int8Plan: rows must be an int >= 1, got {self.rows!r}")

    def to_json(self) -> str:
        """The plan as a JSON object."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Int8Plan:
        """Inverse of ``to_json``.

        Raises:
            ConfigError: not JSON, or not a valid plan.
        """
        try:
            record = json.loads(text)
            return cls(**{**record, "linears": tuple(record["linears"]),
                          "graph_linears": tuple(record.get("graph_linears", ()))})
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"Int8Plan: malformed plan ({exc})") from None
