"""The LMDB backend of the map store: generations of one LMDB environment each,
struct-packed records, the zero-copy read path, two-phase ingest, compaction,
verify, backup, and a zarr ``Store`` view of the same bytes."""
