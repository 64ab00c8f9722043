#!/usr/bin/env bash
# Create .venv at the repo root if missing and install epguard (editable) with its
# test dependencies. Re-installs when pyproject.toml changed since last time, and
# re-links when a module was added or removed: the install is editable in *strict*
# mode (setuptools links webhook/ and probe/ into build/__editable__.*/epguard/), so the
# one import root `epguard` is a real directory tree that mypy and import-linter read.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
stamp=.venv/.epguard-installed
modules="$(find webhook probe -type f ! -name '*.pyc' | LC_ALL=C sort | sha256sum | cut -c1-64)"
strict=(--config-settings editable_mode=strict)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[test]' "${strict[@]}"
    echo "$modules" >"$stamp"
elif [ "$(cat "$stamp")" != "$modules" ]; then
    .venv/bin/python -m pip install --quiet --no-deps -e . "${strict[@]}"
    echo "$modules" >"$stamp"
fi
