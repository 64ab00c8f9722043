"""Where the control plane's binaries live.

``scripts/tools.d/10-kube.sh`` builds etcd and kube-apiserver, and
``scripts/tools.d/20-kubectl-helm.sh`` unpacks kubectl and helm, all into
``$EPGUARD_CACHE/bin`` (default ``~/.cache/epguard/bin``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class MissingBinary(RuntimeError):
    """A tool the control plane needs is not installed; the message says how to get it."""


def cache_dir() -> Path:
    return Path(os.environ.get("EPGUARD_CACHE", str(Path.home() / ".cache" / "epguard")))


def bin_dir() -> Path:
    return cache_dir() / "bin"


def find(name: str) -> Path:
    """The cached binary, else one on PATH (kubectl/helm only), else MissingBinary."""
    cached = bin_dir() / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    # etcd and kube-apiserver must be the pinned builds: a system etcd of another
    # major version would start and then corrupt nothing but confuse everything.
    if name in ("kubectl", "helm"):
        found = shutil.which(name)
        if found:
            return Path(found)
    raise MissingBinary(f"{name} not found in {bin_dir()}: run `make tools` (or scripts/tools.sh)")


def available(name: str) -> bool:
    try:
        find(name)
    except MissingBinary:
        return False
    return True
