#!/usr/bin/env bash
# Real-package environments for the probe's matrix tests (tests/probe, marker
# `realpkg`). Everything lives under $EPGUARD_CACHE/realpkgs, never in the repo:
#
#   torch-2.13.0/         ONE venv (python3.11) with torch==2.13.0 from PyPI, its
#                         default CUDA 13 build plus the nvidia-* wheels that
#                         `import torch` needs. No GPU is needed to import it.
#   overlays/<name>/      each mooncake wheel and each SGLang release installed with
#                         `pip install --no-deps --target`, put on PYTHONPATH when
#                         the probe runs with the venv's python. One torch, many
#                         images, without one 4 GB venv per combination.
#
# Idempotent: a finished step leaves a `.done` stamp and is skipped next time.
set -euo pipefail
cache="${EPGUARD_CACHE:-$HOME/.cache/epguard}/realpkgs"
mkdir -p "$cache/overlays"
py="${REALPKG_PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

venv="$cache/torch-2.13.0"
if [ ! -f "$venv/.done" ]; then
    echo "realpkgs: building $venv (torch 2.13.0, ~4 GB with its nvidia-* wheels)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --no-cache-dir --progress-bar off \
        "torch==2.13.0"
    "$venv/bin/python" -c "import torch; print('realpkgs: torch', torch.__version__, 'cuda', torch.version.cuda)"
    touch "$venv/.done"
fi

# name=requirement. The names are what tests/probe/probe_harness.py refers to.
overlays=(
    "mte-0.3.13.post1=mooncake-transfer-engine==0.3.13.post1"
    "mte-cuda13-0.3.13.post1=mooncake-transfer-engine-cuda13==0.3.13.post1"
    "mte-cuda13-0.3.10=mooncake-transfer-engine-cuda13==0.3.10"
    "mte-non-cuda-0.3.13.post1=mooncake-transfer-engine-non-cuda==0.3.13.post1"
    "mte-cuda13-0.3.14=mooncake-transfer-engine-cuda13==0.3.14"
    "sglang-0.5.10.post1=sglang==0.5.10.post1"
    "sglang-0.5.16=sglang==0.5.16"
    "sglang-0.5.18=sglang==0.5.18"
    "sglang-0.5.23=sglang==0.5.23"
    "sglang-0.5.13=sglang==0.5.13"
    "sglang-0.5.20=sglang==0.5.20"
)
# overlay NAME STAMP PIP_ARGS...: `pip install --no-deps --target overlays/NAME`, unless
# the overlay's .done already holds STAMP (a changed STAMP rebuilds it).
# --no-deps: SGLang would otherwise pull its own torch pin and half of PyPI, and torch
# must never be installed a second time; the probe only reads metadata and sources.
overlay() {
    local name="$1" stamp="$2" dest="$cache/overlays/$1"
    shift 2
    [ -f "$dest/.done" ] && [ "$(cat "$dest/.done")" = "$stamp" ] && return 0
    echo "realpkgs: $* -> overlays/$name"
    rm -rf "$dest"
    "$venv/bin/python" -m pip install --quiet --no-cache-dir --progress-bar off \
        --no-deps --target "$dest" "$@"
    echo "$stamp" > "$dest/.done"
}

for entry in "${overlays[@]}"; do
    overlay "${entry%%=*}" "" "${entry#*=}"
done

# SGLang's own parser (scripts/sglang_options.py, tests/probe/test_sglang_parser.py): its
# import chain needs numpy, transformers, pydantic … beside torch. One overlay for those
# (exact pins), and per release the transformers version that release pins.
reqs="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/sglang-parser-requirements.txt"
overlay sglang-parser-deps "$(sha256sum "$reqs" | cut -c1-16)" -r "$reqs"
for sgl in "$cache"/overlays/sglang-[0-9]*/; do
    pin="$(grep -h '^Requires-Dist: transformers==' "$sgl"/sglang-*.dist-info/METADATA | head -1 | cut -d= -f3)"
    if [ -n "$pin" ]; then overlay "transformers-$pin" "" "transformers==$pin"; fi
done
echo "realpkgs: ready under $cache"
