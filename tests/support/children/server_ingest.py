"""A second client process for the daemon tests: ingests synthetic entries over gRPC.

Usage: python -m tests.support.children.server_ingest TARGET TOKEN NAMESPACE FINGERPRINT LENGTH SEED...
Creates the namespace (idempotent) with ``server_fixtures.LAYOUT`` and ingests
``make_entry(LAYOUT, LENGTH, seed)`` for each seed in one stream; prints the
IngestSummary as JSON.
"""

from __future__ import annotations

import json
import sys

from attnstore_client.connection.daemon import DaemonClient
from tests.support.server_fixtures import LAYOUT
from tests.support.stores import make_entry


def main(argv: list[str]) -> int:
    target, token, namespace, fingerprint, length, *seeds = argv
    entries = [make_entry(LAYOUT, int(length), int(seed)) for seed in seeds]
    with DaemonClient(target, token=token) as remote:
        remote.create_namespace(namespace, model="tiny-synthetic", fingerprint=fingerprint, layout=LAYOUT)
        summary = remote.ingest(namespace, fingerprint, entries)
    print(json.dumps({"entry_ids": list(summary.entry_ids), "entries": summary.entries}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
