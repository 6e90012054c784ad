"""Engines: what runs the compute tier's forwards besides the model's own torch forward.

The compute tier's rows that need nothing from torch (no maps kept for write-back, no int8 plan) may run on an
exported graph of the model's transformer instead: OpenVINO's or ONNX Runtime's (``graphs`` exports them once per
model fingerprint and library versions, ``runtimes`` runs them). ``choice`` checks each export against the torch
forward and times every engine on forwards of each length band, so the compute tier runs each forward on the
fastest engine for its band (``CacheSettings.engine``). Capture, replay, the prefix and chunk tiers and int8 stay
in torch.
"""

from attnstore_client.tiers.engines.choice import EngineChoice, choose_engines
from attnstore_client.tiers.engines.graphs import GRAPH_ENGINES, EngineName, GraphEngineName, export_graph
from attnstore_client.tiers.engines.runtimes import GraphEngine, open_engine
from attnstore_client.tiers.engines.selection import EngineSelection

__all__ = ["GRAPH_ENGINES", "EngineChoice", "EngineName", "EngineSelection", "GraphEngine", "GraphEngineName",
           "choose_engines", "export_graph", "open_engine"]
