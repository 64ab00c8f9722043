"""How the controller authenticates: in a pod, at the address the kubelet puts in the
environment, as client-go's in-cluster config does.

kopf's own service-account login dials ``https://kubernetes.default.svc``, which only
resolves where cluster DNS runs. ``KUBERNETES_SERVICE_HOST``/``_PORT`` name the same
API server (the ``kubernetes`` Service's ClusterIP) in every pod, DNS or not: the
official client's in-cluster config (``webhook/cluster/kube.py``, used by the webhook and the
rest of the controller) reads them, and the chart's pods on the local node (no
cluster DNS) showed the difference: kopf's watches retried ``ClientConnectorDNSError``
forever while the rest worked. Outside a pod (``KUBECONFIG``) kopf's kubeconfig login
applies unchanged.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

import kopf

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def in_cluster_server(env: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """``https://host:port`` from the kubelet-set environment, or None outside a pod."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return None
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"https://{host}:{port}"


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    server = in_cluster_server()
    token = SERVICE_ACCOUNT / "token"
    if server is None or not token.is_file():
        return kopf.login_with_kubeconfig(**kwargs)
    namespace = SERVICE_ACCOUNT / "namespace"
    ca = SERVICE_ACCOUNT / "ca.crt"
    # Read at every (re-)login: the kubelet rotates the projected token, and kopf logs in
    # again when the API server answers 401.
    return kopf.ConnectionInfo(
        server=server,
        ca_path=str(ca) if ca.is_file() else None,
        token=token.read_text().strip(),
        default_namespace=namespace.read_text().strip() if namespace.is_file() else None,
        priority=100,
    )
