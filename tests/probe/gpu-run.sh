#!/usr/bin/env bash
# Run the GPU tests (marker `gpu`) on a GPU machine that cannot reach a package
# registry and brings its own python3 with torch. From the repo's root:
#
#   tests/probe/gpu-run.sh PAYLOAD     # PAYLOAD from scripts/gpu-payload.sh
#
# Unpacks the overlays, and the Debian packages of only those OS libraries the machine
# lacks (never shadowing one it has), then runs tests/probe/test_probe_gpu.py with
# that python3 in place of the real-package env's. tests/conftest.py is not loaded: it
# needs the webhook's packages, which such a machine has no reason to carry.
set -uo pipefail
payload="$(cd "${1:?usage: $0 PAYLOAD}" && pwd)"
work="${EPGUARD_GPU_WORK:-/tmp/epguard-gpu}"
rm -rf "$work" && mkdir -p "$work/realpkgs" "$work/os"
tar -C "$work/realpkgs" -xJf "$payload/overlays.tar.xz" || exit 2

for deb in "$payload"/debs/*.deb; do
    for so in $(dpkg -c "$deb" | awk '{print $6}' | grep -E '\.so(\.[0-9]+)*$' | xargs -r -n1 basename); do
        if ! ldconfig -p | grep -qF "	$so ("; then
            echo "gpu-run: this machine lacks $so: unpacking $(basename "$deb")"
            dpkg -x "$deb" "$work/os"
            break
        fi
    done
done
export LD_LIBRARY_PATH="$work/os/usr/lib/x86_64-linux-gnu:$work/os/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export EPGUARD_CACHE="$work" EPGUARD_TORCH_PYTHON="$(command -v python3)"

nvidia-smi -L
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())'
echo "nvcc: $(command -v nvcc || echo none)  ninja: $(command -v ninja || echo none)  cores: $(nproc)"
ls /sys/class/infiniband 2>/dev/null | sed 's/^/rdma device: /' || true
ldd "$work/realpkgs/overlays/mte-cuda13-0.3.13.post1/mooncake/libmooncake_pg.so" | grep 'not found'

PYTHONPATH=. python3 -m pytest --noconftest -p no:cacheprovider -o addopts= -v -rA -s \
    --durations=0 tests/probe/test_probe_gpu.py
