#!/usr/bin/env bash
# The differential fuzz harness's long run (tests/fuzz, docs/concepts/guarantees.md, "How it is checked"): rounds of new random
# calls, each round ATTNSTORE_FUZZ_EXAMPLES examples per fuzz test (default 300) under hypothesis' "long"
# profile, until MINUTES have passed (default 30). Stops at the first failure, with hypothesis' minimal example;
# else prints the calls and rows it ran, per test, over every round.
#   bash scripts/fuzz.sh [MINUTES]
set -uo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-30}
export ATTNSTORE_FUZZ_EXAMPLES=${ATTNSTORE_FUZZ_EXAMPLES:-300}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
end=$((SECONDS + minutes * 60))
rounds=0
while ((SECONDS < end)); do
    rounds=$((rounds + 1))
    python -m pytest -q -rA tests/fuzz --hypothesis-profile long -p no:cacheprovider -p no:logging 2>&1 \
        | grep -v "quantization buckets" | tee -a "$log" | grep -E "^fuzz |passed|failed|^E "
    if grep -qE "[0-9]+ (failed|error)" "$log"; then
        echo "fuzz: round $rounds failed (above)" >&2
        exit 1
    fi
done
echo "fuzz: $rounds rounds in $((SECONDS / 60)) minutes, nothing found"
awk '/^fuzz [a-z_]+: / {calls[$2] += $3; rows[$2] += $5} END {for (t in calls) printf "  %s %d calls, %d rows\n", t, calls[t], rows[t]}' "$log"
