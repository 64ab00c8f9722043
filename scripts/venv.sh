#!/usr/bin/env bash
# Create .venv at the repo root if missing and install epguard (editable) with its
# test dependencies. Re-installs when pyproject.toml changed since last time, and
# re-links when a module was added or removed: the install is editable in *strict*
# mode (setuptools links webhook/ and probe/ into build/__editable__.*/epguard/), so the
# one import root `epguard` is a real directory tree that mypy and import-linter read.
#
# The installer is uv (pinned below, in a directory of its own under the cache, with its
# package cache, 0.4 GiB): it resolves and installs the ~90 packages in ~5 s where pip
# took 34 s on a fresh clone (pip keeps no cache from this machine's index). uv trusts
# the system's certificates (UV_NATIVE_TLS), as pip does here, and is given pip's index,
# extra index and find-links settings (uv reads no pip.conf; without them it would
# install from PyPI where an admin configured a mirror). Where uv cannot be had or
# cannot install, pip does the same install and the script says why.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
UV_VERSION=0.13.9
cache="${EPGUARD_CACHE:-$HOME/.cache/epguard}"
uv_home="$cache/uv-$UV_VERSION"
uv_log="$cache/uv-$UV_VERSION.log"
export UV_NATIVE_TLS=1 UV_CACHE_DIR="${UV_CACHE_DIR:-$cache/uv-cache}"

# Where pip is told packages come from (its environment and config files, as `pip config
# list` prints them), told to uv in uv's terms: the environment's value, else [install]'s,
# else [global]'s, as pip itself reads them; several values (one a line in pip.conf) split.
# What the user set for uv itself wins. Without pip's settings (a Python with no pip) uv
# is not used: it might install from PyPI where an admin configured a mirror. Read only
# when something is to be installed (most runs of this script install nothing).
uv_args=()
uv_settings() {
    local out key value
    out="$("$py" - <<'PY'
import ast, subprocess, sys
r = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                   capture_output=True, text=True)
if r.returncode != 0:
    sys.exit(1)
found = {}
rank = {":env:": 0, "install": 1, "global": 2}
for line in r.stdout.splitlines():
    key, sep, raw = line.partition("=")
    section, _, name = key.partition(".")
    if not sep or section not in rank:
        continue
    try:
        value = str(ast.literal_eval(raw))
    except (ValueError, SyntaxError):
        continue
    if name not in found or rank[section] < found[name][0]:
        found[name] = (rank[section], value)
get = lambda name: found.get(name, (0, ""))[1].split()
for env, name, sep in (("UV_INDEX_URL", "index-url", " "),
                       ("UV_EXTRA_INDEX_URL", "extra-index-url", " "),
                       ("UV_FIND_LINKS", "find-links", ",")):
    if get(name):
        print(f"{env}={sep.join(get(name))}")
if found.get("no-index", (0, ""))[1].lower() in ("1", "true", "yes", "on"):
    print("NO_INDEX=1")
PY
)" || return 1
    while IFS='=' read -r key value; do
        case "$key" in
            NO_INDEX) uv_args+=(--no-index) ;;
            UV_*) [ -n "${!key:-}" ] || export "$key=$value" ;;
        esac
    done <<<"$out"
}

uv_state=""  # "", "ready" or "missing": fetched at most once a run
tmp=""
trap '[ -z "$tmp" ] || rm -rf "$tmp"' EXIT

# uv into $uv_home, made aside and renamed into place (a second checkout's make may be
# doing the same): by the Python's own pip, else by a throwaway venv's (a Python with no
# pip of its own, or PIP_REQUIRE_VIRTUALENV).
fetch_uv() {
    mkdir -p "$cache"
    tmp="$(mktemp -d "$cache/.uv.XXXXXX")" || return 1
    local want=("uv==$UV_VERSION" --quiet --disable-pip-version-check --target "$tmp")
    if ! "$py" -m pip install "${want[@]}" >"$uv_log" 2>&1; then
        "$py" -m venv "$tmp/.boot" >>"$uv_log" 2>&1 &&
            "$tmp/.boot/bin/python" -m pip install "${want[@]}" >>"$uv_log" 2>&1 || return 1
        rm -rf "$tmp/.boot"
    fi
    [ -x "$tmp/bin/uv" ] || return 1
    if [ -e "$uv_home" ] && [ ! -x "$uv_home/bin/uv" ]; then
        # What a killed run left: moved out of the way first (rename is atomic).
        local stale
        stale="$(mktemp -d "$cache/.uv-stale.XXXXXX")" && mv -T "$uv_home" "$stale/old" &&
            rm -rf "$stale"
    fi
    mv -T "$tmp" "$uv_home" 2>/dev/null || true  # another run's uv got there first
    [ -x "$uv_home/bin/uv" ]
}

uv_ready() {
    if [ -z "$uv_state" ]; then
        if ! uv_settings; then
            uv_state=missing
            echo "venv: $py -m pip cannot say where pip installs from; pip installs" >&2
        elif [ -x "$uv_home/bin/uv" ] || fetch_uv; then
            uv_state=ready
        else
            uv_state=missing
            echo "venv: uv $UV_VERSION could not be fetched ($uv_log); pip installs" >&2
        fi
    fi
    [ "$uv_state" = ready ]
}

# install ARGS...: `pip install ARGS` into .venv, by uv where it can.
install() {
    if uv_ready; then
        "$uv_home/bin/uv" pip install --quiet --python .venv/bin/python "${uv_args[@]}" "$@" &&
            return 0
        echo "venv: uv $UV_VERSION could not install $*; pip does" >&2
    fi
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
