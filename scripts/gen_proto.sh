#!/usr/bin/env bash
# Regenerate the Python stubs of the wire contract into attnstore/v1/.
# Reproducible: the same grpcio-tools version (pinned in pyproject's dev extra)
# gives the same bytes; tests/test_wire_stubs.py fails when the stubs drift.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
python -m grpc_tools.protoc -Iproto \
    --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
    proto/attnstore/v1/attnstore.proto
