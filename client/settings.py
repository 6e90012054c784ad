"""``CacheSettings``: every option of an ``AttnCache`` in one frozen object, each default with why it is what it is.

    settings = CacheSettings(timeout=5.0, write_back=True)
    cache = AttnCache("minilm", "grpc://store-host:50051", "minilm", settings, token=...)
    cache = AttnCache("minilm", "grpc://store-host:50051", "minilm", timeout=5.0)   # the same, as keywords

Keywords given to ``AttnCache`` replace single values of the settings given (of the
defaults when none are): ``CacheOptions`` types them, so a type checker catches a
misspelt one, and ``CacheSettings.with_options`` refuses it at run time, naming it.
What a cache holds open or keeps secret is not a setting: the store, its token and
TLS files, and a chunk source are arguments of ``AttnCache`` of their own.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from attnstore.errors import ConfigError
from attnstore_client.call.settings import DEFAULT_MIN_PREFIX_TOKENS, ChunkSettings
from attnstore_client.resilience import BreakerPolicy, RetryPolicy
from attnstore_client.tiers.cost_model import CostSettings
from attnstore_client.tiers.engines.graphs import ENGINE_NAMES, EngineName
from attnstore_client.tiers.write_back import WriteBackSettings

if TYPE_CHECKING:
    import torch

# This process's exact tier: about 11,000 rows of 30 tokens of a 384-wide model, a small share of a node's RAM.
DEFAULT_EXACT_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """How an ``AttnCache`` uses its store and its model (see ``AttnCache`` for what each option does).

    The switches settable on a cache (``cache.exact = False``, ``cache.max_distance = 0.1``...) replace
    a value here; the next call reads it.

    Raises:
        ConfigError: a bad value (named, with what it must be).
    """

    # Threshold on the predicted map distance for a map hit. None: the namespace decides, as it was built to:
    # its fidelity gate when it has one, else its calibrated threshold (0, exact hits only, when calibration
    # found none precise enough), else DEFAULT_MAX_DISTANCE for an uncalibrated namespace.
    max_distance: float | None = None
    # Deadline of one store call (an exact window, a search, a batch of hits' maps), seconds. Rows still waiting
    # past it are computed, so it only bounds a store that hangs (the breaker handles one that fails fast):
    # generous enough for a large batch's maps over a slow link.
    timeout: float | None = 30.0
    exact: bool = True  # exact tiers on: a hash lookup is the cheapest hit there is, and its result is exact
    maps: bool = True  # map hits on, where the cost model expects them to pay (off: a plain output cache)
    prefix: bool = True  # stored prefixes on; the tier asks only in causal namespaces that store them
    stream: bool = True  # replay starts with the first layers' maps: the fetch overlaps the forward
    # Inputs truncated to this many tokens; None: the model's own limit (its sentence-transformers
    # max_seq_length, else its context), as SentenceTransformer.encode truncates them.
    max_length: int | None = None
    device: str | torch.device | None = None  # None: the CPU, which every machine has ("cuda" runs the model there)
    exact_cache_bytes: int = DEFAULT_EXACT_CACHE_BYTES  # this process's exact tier (0 turns it off)
    # Shortest stored prefix fetched, in tokens: below it the reads cost what the prefix saves (measured, see
    # call.settings).
    prefix_min_tokens: int = DEFAULT_MIN_PREFIX_TOKENS
    cost: CostSettings = CostSettings()  # when a map lookup is worth it: learnt per length band (defaults there)
    retry: RetryPolicy = RetryPolicy()  # only outages, only within timeout: the computed fallback is always there
    breaker: BreakerPolicy = BreakerPolicy()  # when to stop asking a failing store, and when to try it again
    # Off: writing back needs a daemon and a write token, and a node reading a namespace needs neither.
    write_back: bool | WriteBackSettings = False
    # Forwards run their rows end to end, nothing padded (adapters.packed): no compute spent on padding. False
    # pads length-sorted batches, cut where the cost model's fit predicts the least time.
    packed: bool = True
    # Packed CPU forwards run side by side, as many as torch has threads, a thread each (tiers.forward_pool):
    # 12% faster than one at a time on 2 cores, where each op waits for both.
    side_by_side: bool = True
    # Off: a prompt fused from stored chunks approximates the full forward's result, so it is asked for.
    chunks: ChunkSettings | None = None
    # Rows no tier served are computed with the linear layers the namespace's int8 plan names quantised
    # (``int8``; the plan kept its calibration rows at cosine >= 0.99). Off: fp32 rows are exact.
    int8: bool = False
    # Where computed rows run (``engines``): the model's own torch forward; "auto", each forward's length band on
    # the fastest of torch and the OpenVINO and ONNX Runtime graphs of the model (exported once per fingerprint,
    # checked against torch, timed on the first computing call); or one of those graphs for every band. Rows
    # that keep maps or run int8 stay on torch. torch by default: on the development machine's 2 cores a call
    # of 8,000 log lines ran 8% slower on OpenVINO (padded batches) than on torch (docs/BENCHMARKS.md, "Engines").
    engine: EngineName = "torch"
    # Bytes this cache may keep beyond its model and a call's result: the store's indexes (embedded mode), the
    # forwards in flight and this process's exact tier, split by ``attnstore_client.memory.plan_memory``. None:
    # no bound but each part's own (exact_cache_bytes; forwards of batch_size padded rows' tokens).
    memory_budget: int | None = None
    # Share of the store's exact hits computed again and compared with the stored outputs (``audit``): a wrong
    # row is quarantined at the store (a write or admin token), its writer named and counted. Each audited row
    # costs its forward, so the library leaves it off (0.0: a store you build and write yourself); a node reading a
    # store others write to audits 1% by default (``attnstore node --audit-rate``).
    audit_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.max_distance is not None and not (_number(self.max_distance) and self.max_distance >= 0):
            raise ConfigError(f"CacheSettings: max_distance must be a number >= 0 or None, got {self.max_distance!r}")
        if self.timeout is not None and not (_number(self.timeout) and self.timeout > 0):
            raise ConfigError(f"CacheSettings: timeout must be > 0 seconds or None, got {self.timeout!r}")
        if self.max_length is not None and not (_integer(self.max_length) and self.max_length >= 1):
            raise ConfigError(f"CacheSettings: max_length must be an int >= 1 or None, got {self.max_length!r}")
        if not (_integer(self.exact_cache_bytes) and self.exact_cache_bytes >= 0):
            raise ConfigError(f"CacheSettings: exact_cache_bytes must be an int >= 0, got {self.exact_cache_bytes!r}")
        if self.memory_budget is not None and not (_integer(self.memory_budget) and self.memory_budget >= 1):
            raise ConfigError(f"CacheSettings: memory_budget must be an int >= 1 (bytes) or None,"
                              f" got {self.memory_budget!r}")
        if not (_number(self.audit_rate) and 0.0 <= self.audit_rate <= 1.0):
            raise ConfigError(f"CacheSettings: audit_rate must be a number from 0 to 1, got {self.audit_rate!r}")
        if not (_integer(self.prefix_min_tokens) and self.prefix_min_tokens >= 0):
            raise ConfigError(f"CacheSettings: prefix_min_tokens must be an int >= 0, got {self.prefix_min_tokens!r}")
        for name in ("exact", "maps", "prefix", "stream", "packed", "side_by_side", "int8"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"CacheSettings: {name} must be True or False, got {getattr(self, name)!r}")
        for name, kind in (("cost", CostSettings), ("retry", RetryPolicy), ("breaker", BreakerPolicy)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"CacheSettings: {name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if not isinstance(self.write_back, bool | WriteBackSettings):
            raise ConfigError(
                f"CacheSettings: write_back must be True, False or a WriteBackSettings, got {self.write_back!r}"
            )
        if self.engine not in ENGINE_NAMES:
            raise ConfigError(f"CacheSettings: engine must be one of {list(ENGINE_NAMES)}, got {self.engine!r}")
        if self.chunks is not None and not isinstance(self.chunks, ChunkSettings):
            raise ConfigError(f"CacheSettings: chunks must be a ChunkSettings or None, got {self.chunks!r}")

    def with_options(self, options: Mapping[str, Any]) -> CacheSettings:
        """These settings with ``options`` replacing their values (each checked as in the constructor).

        Raises:
            ConfigError: an option that is no setting (the settings are listed), or a bad value.
        """
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise ConfigError(f"AttnCache() got unexpected keyword arguments {unknown}; its settings are"
                              f" {list(OPTION_NAMES)} (and token, tls_ca, client_cert, client_key, chunk_source)")
        return dataclasses.replace(self, **options) if options else self


class CacheOptions(TypedDict, total=False):
    """``CacheSettings``' fields as keywords of ``AttnCache`` (``**overrides: Unpack[CacheOptions]``)."""

    max_distance: float | None
    timeout: float | None
    exact: bool
    maps: bool
    prefix: bool
    stream: bool
    max_length: int | None
    device: str | torch.device | None
    exact_cache_bytes: int
    prefix_min_tokens: int
    cost: CostSettings
    retry: RetryPolicy
    breaker: BreakerPolicy
    write_back: bool | WriteBackSettings
    packed: bool
    side_by_side: bool
    chunks: ChunkSettings | None
    int8: bool
    engine: EngineName
    memory_budget: int | None
    audit_rate: float


OPTION_NAMES: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(CacheSettings))


def _number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's scalars too


def _integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
