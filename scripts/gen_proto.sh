#!/usr/bin/env bash
# Regenerate the Python stubs of the wire contract into attnstore/protocol/v1/.
# Reproducible: the same grpcio-tools version (pinned in pyproject's dev extra)
# gives the same bytes; tests/protocol/test_wire_stubs.py fails when the stubs drift.
# protoc names the Python modules after the proto's path (attnstore/v1/...); the
# stubs live in the protocol package, so their own module references are rewritten.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python -m grpc_tools.protoc -Iproto \
    --python_out="$tmp" --grpc_python_out="$tmp" --pyi_out="$tmp" \
    proto/attnstore/v1/attnstore.proto
mkdir -p "$out/attnstore/protocol/v1"
for name in attnstore_pb2.py attnstore_pb2.pyi attnstore_pb2_grpc.py; do
    sed -e 's/\battnstore\.v1\.attnstore_pb2\b/attnstore.protocol.v1.attnstore_pb2/g' \
        -e 's/^from attnstore\.v1 import/from attnstore.protocol.v1 import/' \
        "$tmp/attnstore/v1/$name" > "$out/attnstore/protocol/v1/$name"
done
