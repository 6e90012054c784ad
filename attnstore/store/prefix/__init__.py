"""Prefix blocks in the store, shared by the backends: how a block is kept (``records``) and the
in-memory backend's hooks (``memory``); the LMDB backend's are in ``attnstore.store.lmdb.prefix_blocks``."""
