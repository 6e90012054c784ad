"""The DRAM tier in front of a backend: decoded hot maps, read-ahead (prefetch) and buffered hit counts.

One sub-package for every backend that keeps its maps outside this process's
memory (LMDB on disk, Redis over the network): ``DramTiered`` puts the tier in
front of the backend's own loads and writes, given a few of them as hooks. The
in-memory backend needs none of it.
"""
