"""AttnStore: a storage-centric attention-map database service for transformer prefill.

This package holds the service (map store, vector index, namespaces, gRPC server).
Importing it stays light: storage backends (lmdb, zarr, faiss) are imported by the
modules that use them, so the client can share ``attnstore.errors`` and the wire
stubs without pulling them in.
"""

__version__ = "0.1.0"
