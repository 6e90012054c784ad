#!/usr/bin/env bash
# The GPU check (docs/BENCHMARKS.md, "GPU"): one command for a lent, bare GPU machine with no network.
#
#   bash scripts/gpu_check.sh --prepare [--python 3.12]   # here, with the project's venv active: fill .gpu/
#   bash scripts/gpu_check.sh OUT_DIR [bench gpu options]  # there: install what is missing, test, time
#
# --prepare downloads the wheels of what the lent image lacks (CPython 3.12 manylinux, pinned to this venv's
# versions) into .gpu/wheels/cp312, writes MiniLM's and SmolLM2's configurations and tokenizers (their weights
# are drawn from a seed there: real ones do not fit) and a little data, and checks that the working tree and
# .gpu/ together fit the 64 MiB a `run` call carries.
#
# The run installs the carried wheels the machine's python needs (`pip install --no-index --no-deps --target`),
# puts the project on the path under its import names (pyproject's package-dir: client/ as attnstore_client...)
# and runs `attnstore bench gpu --out OUT_DIR`: the GPU tests, the timing tables and one bench encode, within
# GPU_CHECK_BUDGET seconds (default 400: a loan's command stops at 600 s, and a rerun must fit the 15 minutes).
# Everything it prints is also in OUT_DIR/gpu-check.json. Set GPU_CHECK_CARRIED to use another carried folder.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
carried="${GPU_CHECK_CARRIED:-$repo/.gpu}"
python="${PYTHON:-python3}"

if [[ "${1:-}" == "--prepare" ]]; then
    shift
    cd "$repo"
    exec "$python" -m attnstore_tools.cli bench gpu --prepare --carried "$carried" "$@"
fi
if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 --prepare [--python X.Y] | $0 OUT_DIR [attnstore bench gpu options]" >&2
    exit 2
fi
out="$(mkdir -p "$1" && cd "$1" && pwd)"
shift
started=$(date +%s)

# The project under its import names, from pyproject's package-dir, as links (no build, nothing copied), with
# the metadata `attnstore --version` reads.
site="${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/attnstore-gpu-site}"
rm -rf "$site" && mkdir -p "$site"
"$python" - "$repo" "$site" <<'PY'
import sys, tomllib
from pathlib import Path
repo, site = Path(sys.argv[1]), Path(sys.argv[2])
project = tomllib.loads((repo / "pyproject.toml").read_text())
for name, folder in project["tool"]["setuptools"]["package-dir"].items():
    (site / name).symlink_to(repo / folder, target_is_directory=True)
info = site / f"attnstore-{project['project']['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: attnstore\nVersion: {project['project']['version']}\n")
PY
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

tag="cp$("$python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
wheels="$carried/wheels/$tag"
if [[ ! -d "$wheels" ]]; then
    echo "gpu_check: no wheels for $tag in $wheels: run scripts/gpu_check.sh --prepare --python X.Y here first" >&2
    exit 2
fi
mapfile -t needed < <("$python" -m attnstore_tools.bench.gpu_carry "$wheels")
if (( ${#needed[@]} )); then
    "$python" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$site" "${needed[@]}"
fi
echo "installed ${#needed[@]} carried wheels into $site in $(( $(date +%s) - started )) s"

cd "$repo"
# The budget leaves the setup's seconds out; timeout stops a step that hangs, 40 s past the budget.
budget="${GPU_CHECK_BUDGET:-400}"
status=0
timeout --kill-after=10 $(( budget + 40 )) "$python" -m attnstore_tools.cli bench gpu --out "$out" \
    --carried "$carried" --budget "$budget" "$@" || status=$?
echo "gpu_check: exit $status after $(( $(date +%s) - started )) s; results in $out/gpu-check.json"
exit "$status"
