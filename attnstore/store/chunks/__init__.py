"""Chunk entries in the store: the interface's calls for them (``interface``) and how a chunk is kept
(``records``), shared by the backends that store them (``memory.chunks``, ``lmdb.chunks``, ``redis.chunks``)."""
