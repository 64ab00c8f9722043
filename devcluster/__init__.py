"""A local Kubernetes control plane (etcd + kube-apiserver, envtest-style) for epguard.

``ControlPlane`` is what tests use; ``python -m devcluster up|down|status`` runs
the same thing detached, with epguard installed into it.
"""

from devcluster.binaries import MissingBinary
from devcluster.controlplane import ControlPlane, ControlPlaneError

__all__ = ["ControlPlane", "ControlPlaneError", "MissingBinary"]
