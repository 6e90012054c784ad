"""Child process of the crash test: ingests, deletes and hits entries until it is killed.

It reports each step on a pipe, one line per write, before and after the call:
``begin-ingest NS K,K`` / ``ingested NS ID:K,ID:K`` and ``begin-delete NS ID`` /
``deleted NS ID``. A line after the call means the transaction committed. Entry
content derives from K alone (:func:`crash_entry`), so the parent can check it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np

from attnstore.store import LmdbMapStore, NamespaceLayout, NewEntry
from tests.support.stores import make_entry, small_layout

LAYOUTS: dict[str, NamespaceLayout] = {"plain": small_layout("fp16"), "packed": small_layout("q8+zstd")}


def crash_entry(namespace: str, k: int) -> NewEntry:
    """Entry number ``k`` of ``namespace``: lengths 4..48 so some stored objects overflow a page.

    fp16 input keeps the child free of torch ops (a forked child must not start
    thread pools its parent may have started).
    """
    return make_entry(LAYOUTS[namespace], 4 + (7 * k) % 45, seed=k, dtype=np.float16)


def run(path: Path, start_k: int, out_fd: int, seed: int) -> None:
    """Work on the store at ``path`` forever, numbering new entries from ``start_k``."""
    rng = random.Random(seed)

    def say(line: str) -> None:
        os.write(out_fd, (line + "\n").encode())

    with LmdbMapStore.open(path, create=True, hit_flush_count=4) as store:
        for name, layout in LAYOUTS.items():
            store.create_namespace(name, model="crash", fingerprint="fp", layout=layout)
        live = [(name, e.id) for name in LAYOUTS for e in store.entries(name)]
        say("ready")
        k = start_k
        while True:
            roll = rng.random()
            if roll < 0.15 and live:
                name, entry_id = live.pop(rng.randrange(len(live)))
                say(f"begin-delete {name} {entry_id}")
                store.delete(name, [entry_id])
                say(f"deleted {name} {entry_id}")
            elif roll < 0.3 and live:
                name, entry_id = rng.choice(live)
                store.record_hits(name, [entry_id])
            else:
                name = rng.choice(list(LAYOUTS))
                ks = list(range(k, k + rng.randint(1, 3)))
                k += len(ks)
                say(f"begin-ingest {name} {','.join(map(str, ks))}")
                ids = store.ingest(name, [crash_entry(name, kk) for kk in ks]).entry_ids
                say(f"ingested {name} {','.join(f'{i}:{kk}' for i, kk in zip(ids, ks, strict=True))}")
                live += [(name, i) for i in ids]
