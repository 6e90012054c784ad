"""What clients and servers share: the wire protocol and the records it carries.

- ``v1``: the generated gRPC stubs of attnstore.v1;
- ``records``, ``keys``: the value objects and keys both sides exchange (layouts, entries,
  token and block hashes, fingerprints); ``messages`` and ``requests``: those records to and
  from wire messages, a Lookup's streamed reply put back together;
- ``wire``, ``write_back``, ``prefix``, ``prefix_wire``, ``chunks``: arrays in checksummed
  frames, written-back rows, prefix blocks and chunk entries on the wire;
- ``status_codes``: AttnStore errors as gRPC status codes and back;
- ``projector_blob``: the projector blob's format, with the fidelity gate (``gate``) and the
  int8 plan (``int8_plan``) in its metadata; ``features``: the projector network and the
  embedding layer;
- ``lru`` (the byte-bounded array cache) and ``secret_file`` (the reader of token and key
  files): kept by both sides.

Imports numpy, grpc, crc32c and safetensors at most (``features`` torch, imported only where
a feature is computed): never faiss, lmdb or zarr, so the inference-node client builds on it.
"""
