#!/usr/bin/env bash
# Build every Kubernetes binary of the local one-node cluster from the Go module proxy
# into $EPGUARD_CACHE/bin: etcd, kube-apiserver, and (module devcluster/go/node) kubelet,
# kube-scheduler, kube-controller-manager and kube-proxy, all from the same pinned
# k8s.io/kubernetes; and (module devcluster/go/containerd) containerd v2, its runc shim and
# ctr. No release binaries can be downloaded here, but the proxy serves the sources.
#
# Each binary is rebuilt only when it is missing or when its pinned module
# (devcluster/go/<name>/go.mod + go.sum) or the link flags changed: a stamp next to the
# binary records the sha256 of go.mod + go.sum, the Go version and the link flags.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cache="${EPGUARD_CACHE:-$HOME/.cache/epguard}"
bin="$cache/bin"
mkdir -p "$bin"

command -v go >/dev/null 2>&1 || { echo "10-kube: 'go' not found on PATH (need Go >= 1.26.6: devcluster/go/containerd/go.mod)" >&2; exit 1; }

# -mod=mod: the modules carry no vendor/ tree; go.sum pins every download.
# GOTOOLCHAIN=local: never try to download a toolchain (only the proxy's modules are reachable).
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-mod=mod"
export GOTOOLCHAIN=local

# name  module-dir (under devcluster/go)  package-to-build
targets=(
    "kube-apiserver kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver"
    "etcd etcd go.etcd.io/etcd/server/v3"
    "kubelet node k8s.io/kubernetes/cmd/kubelet"
    "kube-scheduler node k8s.io/kubernetes/cmd/kube-scheduler"
    "kube-controller-manager node k8s.io/kubernetes/cmd/kube-controller-manager"
    "kube-proxy node k8s.io/kubernetes/cmd/kube-proxy"
    "containerd containerd github.com/containerd/containerd/v2/cmd/containerd"
    "containerd-shim-runc-v2 containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
    "ctr containerd github.com/containerd/containerd/v2/cmd/ctr"
)

for t in "${targets[@]}"; do
    read -r name mod pkg <<<"$t"
    moddir="$root/devcluster/go/$mod"
    stamp="$bin/.$name.stamp"
    # -s -w (no symbol table, no DWARF) keeps the binaries smaller.
    ldflags="-s -w"
    if [ "$mod" = containerd ]; then
        ver="$(cd "$moddir" && go list -m -f '{{.Version}}' github.com/containerd/containerd/v2)"
        ldflags="$ldflags -X github.com/containerd/containerd/v2/version.Version=$ver"
    elif [ "$name" != etcd ]; then
        # A plain `go build` reports v0.0.0-master: Kubernetes stamps its version at
        # link time. Helm's kubeVersion checks, kubectl's skew warning and /version
        # all read it, so stamp it from the pinned module version.
        ver="$(cd "$moddir" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
        minor="$(echo "$ver" | cut -d. -f2)"
        v=k8s.io/component-base/version
        ldflags="$ldflags -X $v.gitVersion=$ver -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=archive"
    fi
    want="$(cat "$moddir/go.mod" "$moddir/go.sum" | sha256sum | cut -d' ' -f1) $(go env GOVERSION) $ldflags"
    if [ -x "$bin/$name" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        echo "10-kube: $name up to date ($bin/$name)"
        continue
    fi
    echo "10-kube: building $name from $pkg (first time per machine: several minutes)"
    start=$(date +%s)
    tmp="$bin/.$name.tmp.$$"
    # -trimpath: no local paths in the binary, so it is the same on every machine.
    (cd "$moddir" && go build -trimpath -ldflags="$ldflags" -o "$tmp" "$pkg")
    mv -f "$tmp" "$bin/$name"
    printf '%s\n' "$want" >"$stamp"
    echo "10-kube: built $name in $(( $(date +%s) - start ))s -> $bin/$name"
done
for name in kube-apiserver kubelet kube-scheduler kube-controller-manager kube-proxy; do
    "$bin/$name" --version
done
"$bin/containerd" --version
"$bin/etcd" --version | sed -n 1p  # sed reads it all: head would SIGPIPE etcd (pipefail)
