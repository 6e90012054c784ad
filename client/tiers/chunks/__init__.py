"""The chunk tier of causal models: stored keys and values of text chunks reused at any position.

- ``source``: where chunks come from (``ChunkSource``, ``MemoryChunkSource``), keyed by
  ``chunk_key`` (the chunk's tokens and the instruction it was computed after);
- ``fusion``: the fused forward (stored parts rotated to their positions, the question
  and a chosen share of chunk tokens computed);
- ``selection``: which chunk tokens are computed again (A3, CacheBlend);
- ``capture``: chunks computed on their own after their instruction (what a source stores);
- ``store_source``: ``StoreChunkSource``, the namespace's stored chunks (a daemon or an embedded store)
  behind a ``MemoryChunkSource``; ``writer``: the chunks a node computed, written back;
- ``tier``: ``ChunkTier``, the tier a call asks for prompts in segments.
"""
