"""Chunk entries in the Redis store: the scripts that change them (``scripts``), the walks over them
(``walks``: stats, verify, the byte cap's victims) and the store's hooks for the chunk calls (``calls``)."""
