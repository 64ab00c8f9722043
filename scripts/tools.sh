#!/usr/bin/env bash
# Build or fetch, once per machine, everything the test suite needs. Each step
# is idempotent and cached under $EPGUARD_CACHE (default ~/.cache/epguard).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export EPGUARD_CACHE="${EPGUARD_CACHE:-$HOME/.cache/epguard}"
mkdir -p "$EPGUARD_CACHE/bin"
total_start=$SECONDS
for step in scripts/tools.d/*.sh; do
    [ -e "$step" ] || continue
    echo "== tools: $(basename "$step")"
    start=$SECONDS
    bash "$step"
    echo "== tools: $(basename "$step") took $((SECONDS - start)) s"
done
echo "== tools: all steps took $((SECONDS - total_start)) s"
