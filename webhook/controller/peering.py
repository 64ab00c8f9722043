"""The ClusterKopfPeering object that kopf peering needs.

kopf reads and patches the peering object but never creates it, and the chart cannot
render it: Helm resolves every kind before it installs anything, so a custom resource
whose CRD arrives in the same release fails the first `helm install`. The controller
creates it at start instead (RBAC: `create` on clusterkopfpeerings). Idempotent: an
existing object, or one created by the other replica a moment earlier, is fine.

``KubePeeringApi.peers`` reads its status for ``leadership.Leadership``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.webhook.cluster.kube import REQUEST_TIMEOUT

log = logging.getLogger("epguard.controller.peering")

GROUP, VERSION, KIND, PLURAL = "kopf.dev", "v1", "ClusterKopfPeering", "clusterkopfpeerings"


class PeeringApi(Protocol):
    def exists(self, name: str) -> bool: ...

    def create(self, name: str) -> None:
        """Create the object; raise FileExistsError when it already exists."""


def ensure_peering(api: PeeringApi, name: str) -> bool:
    """Make sure the peering object exists; True when this call created it."""
    if api.exists(name):
        return False
    try:
        api.create(name)
    except FileExistsError:
        return False
    log.info("created ClusterKopfPeering %s", name)
    return True


class KubePeeringApi:
    """The peering object through the official client's CustomObjectsApi."""

    def __init__(self, api: client.ApiClient) -> None:
        self.custom = client.CustomObjectsApi(api)

    def exists(self, name: str) -> bool:
        try:
            self.custom.get_cluster_custom_object(
                GROUP, VERSION, PLURAL, name, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def create(self, name: str) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "epguard"}},
        }
        try:
            self.custom.create_cluster_custom_object(
                GROUP, VERSION, PLURAL, body, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 409:
                raise FileExistsError(name) from exc
            raise

    def peers(self, name: str) -> Mapping[str, Any]:
        obj = self.custom.get_cluster_custom_object(
            GROUP, VERSION, PLURAL, name, _request_timeout=REQUEST_TIMEOUT
        )
        status = obj.get("status") if isinstance(obj, Mapping) else None
        return status if isinstance(status, Mapping) else {}
