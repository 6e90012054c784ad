"""What clients and servers share: the wire protocol and the records it carries.

- ``v1``: the generated gRPC stubs of attnstore.v1;
- ``records``, ``keys``: the value objects and keys both sides exchange (layouts, entries,
  token and block hashes, fingerprints); ``messages`` and ``requests``: those records to and
  from wire messages, a Lookup's streamed reply put back together;
- ``wire``, ``write_back``, ``prefix``, ``prefix_wire``, ``chunks``: arrays in checksummed
  frames, written-back rows, prefix blocks and chunk entries on the wire;
- ``status_codes``: AttnStore errors as gRPC status codes and back;
- ``lru`` (the byte-bounded array cache) and ``secret_file`` (the reader of token and key
  files): not the wire, but kept by both sides (``lru`` by the store's DRAM cache and the
  client's local exact tier, ``secret_file`` by the daemon and the node), and a package of
  their own for two small helpers would be one more in the contracts.

The projector, its blob, the fidelity gate and the int8 plan are ``attnstore.projector``: both
sides compute them alike, but they are not the wire. Imports numpy, grpc and crc32c at
most: never torch (but for types), faiss, lmdb or zarr, so the inference-node client builds on it.
"""
