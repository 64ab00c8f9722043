#!/usr/bin/env bash
# The Debian packages the local one-node cluster needs (scripts/tools.d and devcluster/node.py):
# runc (containerd itself is built from Go by 10-kube.sh: Debian's 1.6 cannot mount image
# volumes), docker-registry (CNCF distribution: the node's OCI registry, which serves the
# model image), the CNI plugins (pod network: bridge,
# host-local), iptables (kube-proxy), buildah (builds the Dockerfile, no daemon),
# mmdebstrap (base image rootfs from the Debian mirror), gcc (the pause image),
# busybox-static (a small image for the node's own tests), iproute2 (devcluster/node.py
# reads the node's address and routes with `ip -j`).
# Installed with apt-get from the configured Debian mirror, nothing else; a no-op when
# all are present. Needs root (or sudo).
set -euo pipefail
pkgs=(runc docker-registry containernetworking-plugins iptables iproute2 buildah mmdebstrap gcc libc6-dev busybox-static)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "05-system: ${pkgs[*]} installed"
    exit 0
fi
sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(sudo)
echo "05-system: apt-get install ${missing[*]}"
start=$(date +%s)
"${sudo[@]}" apt-get update -q
# --no-install-recommends: containerd would otherwise pull in more than the node uses.
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "05-system: installed in $(( $(date +%s) - start ))s"
