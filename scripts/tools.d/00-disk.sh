#!/usr/bin/env bash
# Fail in the first second, not after an hour, when the disk cannot hold the run.
# What a run writes (measured on the 2-core machine; the README's `make tools` table):
#   a fresh cache, ~60 GiB: torch environments 7 GiB, worker and scan-matrix archives
#   19 GiB, containerd's unpacked snapshots 13 GiB (it discards pulled layers' blobs),
#   buildah 1 GiB, Go build cache 4 GiB, the node registry's images 8 GiB (the
#   workers' blobs, stored once, and the 1 GiB model);
#   every run, ~8 GiB more: the epguard image rebuild and the tests' tmp_path trees.
# EPGUARD_MIN_FREE_GIB overrides the floor (e.g. on a machine whose cache is elsewhere).
set -euo pipefail
cache="${EPGUARD_CACHE:-$HOME/.cache/epguard}"
mkdir -p "$cache"
# What is still to be written: each part of the cache counts until it is there, so a
# machine that ran `make tools` (or half of it) is asked only for the rest.
need=8; what="this run"
missing() { need=$((need + $1)); what="$what + $2"; }
[ -f "$cache/realpkgs/torch-2.13.0/.done" ] || missing 7 "torch environments"
[ -f "$cache/images/worker-bad.oci.key" ] && [ -f "$cache/images/worker-env-only.oci.key" ] \
    || missing 13 "worker images"
[ -f "$cache/images/scan-matrix.oci.key" ] || missing 7 "scan-matrix archive"
[ -d "$cache/containerd/io.containerd.content.v1.content" ] || missing 13 "containerd's snapshots"
[ -x "$cache/bin/kube-apiserver" ] || missing 4 "Go build cache"
[ -d "$cache/registry/docker/registry/v2/repositories/epguard/sglang" ] \
    || missing 8 "the registry's images"
need="${EPGUARD_MIN_FREE_GIB:-$need}"
fail=0
for dir in "$cache" "${TMPDIR:-/tmp}"; do
    free=$(( $(df -Pk "$dir" | awk 'NR==2 {print $4}') / 1024 / 1024 ))
    echo "00-disk: ${free} GiB free under $dir (need ${need} GiB: $what)"
    [ "$free" -ge "$need" ] || fail=1
done
if [ "$fail" -ne 0 ]; then
    echo "00-disk: not enough free disk; the biggest users:" >&2
    du -xsh "$cache"/* "${TMPDIR:-/tmp}"/pytest-of-* 2>/dev/null | sort -h | tail -8 >&2 || true
    echo "00-disk: free space (old pytest-of-* trees can go) or set EPGUARD_MIN_FREE_GIB" >&2
    exit 1
fi
