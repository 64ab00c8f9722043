#!/usr/bin/env bash
# Create .venv at the repo root if missing and install epguard (editable) with its
# test dependencies. Re-installs when pyproject.toml changed since last time, and
# re-links when a module was added or removed: the install is editable in *strict*
# mode (setuptools links webhook/ and probe/ into build/__editable__.*/epguard/), so the
# one import root `epguard` is a real directory tree that mypy and import-linter read.
#
# The installer is uv (pinned below, kept in its own venv under the cache): it resolves
# and installs the ~90 packages in 3-5 s where pip took 30-34 s on a fresh clone (pip
# keeps no wheel cache on these machines; uv's, 0.4 GiB, is under the cache). uv trusts the
# system's certificates (UV_NATIVE_TLS), as pip does with this machine's pip.conf. Where
# uv cannot be had or cannot install (an index only pip is configured for, say), pip
# does the same install, and says so.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
UV_VERSION=0.13.9
cache="${EPGUARD_CACHE:-$HOME/.cache/epguard}"
uv_home="$cache/uv-$UV_VERSION"
export UV_NATIVE_TLS=1 UV_CACHE_DIR="${UV_CACHE_DIR:-$cache/uv-cache}"

uv_ready() {
    [ -x "$uv_home/bin/uv" ] && return 0
    rm -rf "$uv_home"
    "$py" -m venv "$uv_home" >/dev/null 2>&1 &&
        "$uv_home/bin/python" -m pip install --quiet "uv==$UV_VERSION" >/dev/null 2>&1 &&
        return 0
    rm -rf "$uv_home"
    return 1
}

# install ARGS...: `pip install ARGS` into .venv, by uv where it can.
install() {
    if uv_ready && "$uv_home/bin/uv" pip install --quiet --python .venv/bin/python "$@"; then
        return 0
    fi
    echo "venv: uv $UV_VERSION could not install $*; pip does" >&2
    if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
        .venv/bin/python -m ensurepip --upgrade >/dev/null
    fi
    .venv/bin/python -m pip install --quiet "$@"
}

if [ ! -x .venv/bin/python ]; then
    # No ensurepip (3 s): pip comes with the first install below.
    "$py" -m venv --without-pip .venv
fi
stamp=.venv/.epguard-installed
modules="$(find webhook probe -type f ! -name '*.pyc' | LC_ALL=C sort | sha256sum | cut -c1-64)"
strict=(--config-settings editable_mode=strict)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # pip itself, current: the tests build wheels and venvs with the venv's pip.
    install --upgrade pip
    install -e '.[test]' "${strict[@]}"
    echo "$modules" >"$stamp"
elif [ "$(cat "$stamp")" != "$modules" ]; then
    install --no-deps -e . "${strict[@]}"
    echo "$modules" >"$stamp"
fi
