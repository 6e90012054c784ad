"""How a call uses the store: one frozen settings object, each default with why it is what it is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from attnstore.errors import ConfigError
from attnstore_client.resilience import RetryPolicy

# Shortest stored prefix worth fetching, in tokens. Measured with ``attnstore bench prefix``
# (SmolLM2, 2 CPU threads, docs/BENCHMARKS.md "Prefix"): below a few dozen tokens the reads
# and the past's extra attention eat what skipping the prefix saves.
DEFAULT_MIN_PREFIX_TOKENS = 64
# Rows per exact-tier call: the daemon's default --max-queries.
DEFAULT_WINDOW = 512
# Batches of rows a call takes through the tiers at a time: enough for few store round trips and
# length-sorted forwards, few enough that what a window holds stays a few batches' worth.
WINDOW_BATCHES = 16


ChunkMethod = Literal["a3", "cacheblend", "full_reuse"]
CHUNK_METHODS: tuple[ChunkMethod, ...] = ("a3", "cacheblend", "full_reuse")


@dataclass(frozen=True, slots=True)
class ChunkSettings:
    """How the chunk tier fuses stored chunks into a prompt (decoders, prompts in segments).

    A prompt's first segment is its instruction, its last the question, the ones between
    chunks: stored keys and values of each chunk are moved to its place in the prompt
    (``tiers.chunks``) and a share ``ratio`` of the chunk tokens is computed again with
    the attention to what precedes them that a chunk computed on its own missed.
    """

    # Which chunk tokens are computed again: "a3" those the question attends to most at the selection
    # layer (A3); "cacheblend" those whose values deviate most there from the stored ones (CacheBlend);
    # "full_reuse" none (stored keys and values only; the question alone is computed).
    # The defaults are what `attnstore eval icl` measured to keep the most answers per unit of speed (docs/
    # RESULTS.md, "In-context classification with stored chunks"): the last chunk in full, the others as stored.
    method: ChunkMethod = "full_reuse"
    ratio: float = 0.15  # share of the stored chunk tokens computed again (0..1; a3 and cacheblend)
    # Layers before it compute every token (layer 0's keys and values depend on the token alone, so a few
    # early layers cost little and give the selection true hidden states); the choice is made at it.
    select_layer: int = 1
    # The last chunks, next to the question, computed in full even when stored: what the question reads most
    # closely (the most similar exemplar goes last) then sees the true context.
    recent: int = 1
    dtype: Literal["float16", "float32"] = "float16"  # how captured chunks are kept (computed in the model's)

    def __post_init__(self) -> None:
        if self.method not in CHUNK_METHODS:
            raise ConfigError(f"ChunkSettings: method must be one of {list(CHUNK_METHODS)}, got {self.method!r}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ConfigError(f"ChunkSettings: ratio must be within 0..1, got {self.ratio!r}")
        if isinstance(self.select_layer, bool) or not isinstance(self.select_layer, int) or self.select_layer < 0:
            raise ConfigError(f"ChunkSettings: select_layer must be an int >= 0, got {self.select_layer!r}")
        if isinstance(self.recent, bool) or not isinstance(self.recent, int) or self.recent < 0:
            raise ConfigError(f"ChunkSettings: recent must be an int >= 0, got {self.recent!r}")
        if self.dtype not in ("float16", "float32"):
            raise ConfigError(f"ChunkSettings: dtype must be 'float16' or 'float32', got {self.dtype!r}")


@dataclass(frozen=True, slots=True)
class CallSettings:
    """How calls use the store (see ``AttnCache`` for the user-facing defaults)."""

    namespace: str
    max_distance: float  # threshold on the predicted map distance (when not gated)
    exact: bool = True  # use the exact tiers (node-local and the store's)
    stream: bool = True  # start replay while maps still arrive
    timeout: float | None = 30.0  # deadline of one store call (an exact window, a search, a hit batch's maps)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    gate: bool = False  # decide map hits with the namespace's fidelity gate instead of max_distance
    maps: bool = True  # use the map tier (search and replay) at all
    window: int = DEFAULT_WINDOW  # rows per exact-tier call (at most the daemon's --max-queries)
    prefix: bool = True  # start rows from stored prefixes (causal namespaces that store prefix blocks)
    prefix_min_tokens: int = DEFAULT_MIN_PREFIX_TOKENS  # shorter stored prefixes are not fetched
    batch_size: int = 32  # rows per forward (packed: the tokens of that many padded rows, ``tiers.forwards.cut``)
    packed: bool = True  # forwards run their rows end to end, unpadded (``adapters.packed``)
    max_batch_tokens: int | None = None  # tokens per packed forward at most (a longer row goes alone); None: no cap
    # Packed forwards on the CPU run side by side, as many as torch has threads, one thread each
    # (``tiers.forward_pool``): 12% faster than one at a time on 2 cores, where each op waits for both.
    side_by_side: bool = True
    chunks: ChunkSettings | None = None  # fuse stored chunks into prompts in segments (decoders); None: no chunk tier
    int8: bool = False  # compute tier: rows it computes run on the namespace's int8 plan (``int8``)
    audit_rate: float = 0.0  # share of the store's exact hits computed again and compared (``audit``)

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        if isinstance(self.prefix_min_tokens, bool) or self.prefix_min_tokens < 0:
            raise ConfigError(f"prefix_min_tokens must be an int >= 0, got {self.prefix_min_tokens!r}")
        if self.window < 1:
            raise ConfigError(f"window must be >= 1 rows, got {self.window!r}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ConfigError(f"max_batch_tokens must be >= 1 or None, got {self.max_batch_tokens!r}")

    @property
    def window_rows(self) -> int:
        """Rows a call takes through the tiers at a time."""
        return WINDOW_BATCHES * self.batch_size

