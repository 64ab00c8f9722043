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

# name=requirement. The names are what tests/probe/realpkgs.py refers to.
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
for entry in "${overlays[@]}"; do
    name="${entry%%=*}"
    req="${entry#*=}"
    dest="$cache/overlays/$name"
    [ -f "$dest/.done" ] && continue
    echo "realpkgs: $req -> overlays/$name"
    rm -rf "$dest"
    # --no-deps: SGLang would otherwise pull its own torch pin and half of PyPI;
    # the probe only reads its metadata and .py sources.
    "$venv/bin/python" -m pip install --quiet --no-cache-dir --progress-bar off \
        --no-deps --target "$dest" "$req"
    touch "$dest/.done"
done

# SGLang's own parser (scripts/sglang_options.py, tests/probe/test_sglang_parser.py): its
# import chain needs numpy, transformers, pydantic … beside torch. One overlay for those
# (exact pins, --no-deps: torch must not be pulled in a second time), and per release the
# transformers version that release pins.
deps="$cache/overlays/sglang-parser-deps"
reqs="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/sglang-parser-requirements.txt"
stamp="$(sha256sum "$reqs" | cut -c1-16)"
if [ "$(cat "$deps/.done" 2>/dev/null)" != "$stamp" ]; then
    echo "realpkgs: SGLang parser dependencies -> overlays/sglang-parser-deps"
    rm -rf "$deps"
    "$venv/bin/python" -m pip install --quiet --no-cache-dir --progress-bar off \
        --no-deps --target "$deps" -r "$reqs"
    echo "$stamp" > "$deps/.done"
fi
for sgl in "$cache"/overlays/sglang-[0-9]*/; do
    pin="$(grep -h '^Requires-Dist: transformers==' "$sgl"/sglang-*.dist-info/METADATA | head -1 | cut -d= -f3)"
    [ -n "$pin" ] || continue
    dest="$cache/overlays/transformers-$pin"
    [ -f "$dest/.done" ] && continue
    echo "realpkgs: transformers==$pin -> overlays/transformers-$pin"
    rm -rf "$dest"
    "$venv/bin/python" -m pip install --quiet --no-cache-dir --progress-bar off \
        --no-deps --target "$dest" "transformers==$pin"
    touch "$dest/.done"
done
echo "realpkgs: ready under $cache"
