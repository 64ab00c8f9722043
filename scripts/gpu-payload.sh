#!/usr/bin/env bash
# Pack what the GPU tests (tests/probe/test_probe_gpu.py, marker `gpu`) need on a GPU
# machine that cannot reach a package registry, and that brings its own python3 with
# torch: the real mooncake and SGLang wheels as overlays, and the OS libraries a
# mooncake wheel NEEDs (rdma-core, libnuma, libcurl) as Debian packages.
#
#   scripts/gpu-payload.sh DEST [PYTHON_VERSION]     # here, with network; default 3.12
#   tests/probe/gpu-run.sh DEST                      # there, in the repo's root
#
# Each overlay is `pip install --no-deps --target` of the real wheel, trimmed so the
# payload fits a 64 MiB transfer (~45 MB), never in what the probe loads or reads:
#   - every shared object `objcopy --strip-debug`ed: code and symbols stay what PyPI
#     ships, only DWARF goes (mooncake's libmooncake_pg.so: 162 MB with it, 8 MB without);
#   - mooncake's stand-alone programs (transfer_engine_bench, mooncake_client,
#     mooncake_master) dropped: nothing imports them;
#   - SGLang cut to its dist-info and the sources the probe reads (probe/requirement.py
#     SOURCES): the probe never imports SGLang.
# Overlay names are the ones tests/probe/probe_harness.py uses.
set -euo pipefail
dest="${1:?usage: $0 DEST [PYTHON_VERSION]}"
pyver="${2:-3.12}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$here/.venv/bin/python"
[ -x "$py" ] || py=python3
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$dest"
sources="$(cd "$here" && "$py" -c 'from probe.requirement import SOURCES; print(*SOURCES)')"

overlays=(
    "mte-cuda13-0.3.13.post1=mooncake-transfer-engine-cuda13==0.3.13.post1"
    "mte-cuda13-0.3.14=mooncake-transfer-engine-cuda13==0.3.14"
    "sglang-0.5.17=sglang==0.5.17"
    "sglang-0.5.18=sglang==0.5.18"
)
platforms=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_28_x86_64 \
    manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
    platforms+=(--platform "$p")
done
for entry in "${overlays[@]}"; do
    name="${entry%%=*}"
    echo "gpu-payload: ${entry#*=} -> overlays/$name (python $pyver)"
    "$py" -m pip install --quiet --no-cache-dir --progress-bar off --no-deps \
        --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}" \
        --target "$work/overlays/$name" "${entry#*=}"
    o="$work/overlays/$name"
    rm -rf "$o/bin" "$o"/mooncake/{transfer_engine_bench,mooncake_client,mooncake_master}
    if [ -d "$o/sglang" ]; then
        mkdir "$o.keep"
        (cd "$o" && cp --parents -t "$o.keep" -r sglang-*.dist-info sglang/__init__.py \
            sglang/version.py $(for s in $sources; do [ -f "sglang/$s" ] && echo "sglang/$s"; done))
        rm -rf "$o" && mv "$o.keep" "$o"
    fi
    find "$work/overlays/$name" -type f \( -name '*.so' -o -name '*.so.*' \) -print0 |
        xargs -0 -r -n1 objcopy --strip-debug
    touch "$work/overlays/$name/.done"
done
# One dictionary over the whole tar: the wheels repeat libraries (libetcd_wrapper twice).
tar -C "$work" -cf - overlays | xz -T2 --lzma2=preset=9,dict=192MiB > "$dest/overlays.tar.xz"

# The OS packages, with everything they depend on; gpu-run.sh unpacks only those that
# carry a library the machine lacks, so none of its own is ever shadowed.
roots=(libibverbs1 ibverbs-providers libnuma1 libcurl4)
rm -rf "$dest/debs" && mkdir -p "$dest/debs" && chmod 777 "$dest/debs"
mapfile -t pkgs < <(apt-cache depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances "${roots[@]}" |
    grep -E '^[a-z0-9]' | grep -vE '^(libc6|libgcc-s1|libstdc\+\+6|debconf.*|perl.*|dpkg|tar)$' |
    sort -u)
(cd "$dest/debs" && apt-get download "${pkgs[@]}" >/dev/null)
du -sh "$dest"
