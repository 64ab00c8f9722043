#!/usr/bin/env bash
# The images the local node runs, built here (no registry is reachable) and cached by
# content under $EPGUARD_CACHE/images: see devcluster/images.py.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
export GOTOOLCHAIN=local
.venv/bin/python -m devcluster.images
