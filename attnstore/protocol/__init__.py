"""What clients and servers share: the wire stubs (``v1``), the records both sides
exchange, array chunks, status-code translation, the projector blob format with
its fidelity gate, and a small synchronous client of the daemon (``remote``).

Imports numpy, grpc, crc32c and safetensors at most: never faiss, lmdb or zarr,
so the inference-node client builds on it.
"""
