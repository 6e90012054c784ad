"""Prefix blocks in the store: the interface's calls for them (``interface``) and how a block is kept
(``records``), shared by the backends that store them (``lmdb.prefix_blocks``, ``memory.prefix_blocks``)."""
