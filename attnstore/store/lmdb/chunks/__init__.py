"""Chunk entries in the LMDB store: their keys and what one transaction does with them (``keys``), and the
store's hooks for the chunk calls (``calls``)."""
