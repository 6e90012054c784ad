"""In front of a backend, in this process's memory: the DRAM cache of decoded hot maps, and buffered hit counts.

``DramCache`` (``cache``) is a wrapper store that serves maps from DRAM (``hot_maps``:
the byte-bounded entries, ``entries``, and read-ahead, ``prefetch``) in front of any
store; ``open_store`` adds one to the backends that keep their maps outside this
process (LMDB on disk, Redis over the network). ``HitBuffer`` (``hit_buffer``) is what
those backends count hits in between writes.
"""
