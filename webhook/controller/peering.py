"""The ClusterKopfPeering object that kopf peering needs.

kopf reads and patches the peering object but never creates it, and the chart cannot
render it: Helm resolves every kind before it installs anything, so a custom resource
whose CRD arrives in the same release fails the first `helm install`. The controller
creates it at start instead (RBAC: `create` on clusterkopfpeerings). Idempotent: an
existing object, or one created by the other replica a moment earlier, is fine.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

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


class LightkubePeeringApi:
    def __init__(self, client: Any = None) -> None:
        from lightkube import Client
        from lightkube.generic_resource import create_global_resource

        self.client = client if client is not None else Client(field_manager="epguard-controller")
        self.resource = create_global_resource(GROUP, VERSION, KIND, PLURAL)

    def exists(self, name: str) -> bool:
        from lightkube import ApiError

        try:
            self.client.get(self.resource, name=name)
        except ApiError as exc:
            if exc.status.code == 404:
                return False
            raise
        return True

    def create(self, name: str) -> None:
        from lightkube import ApiError
        from lightkube.models.meta_v1 import ObjectMeta

        obj = self.resource(
            apiVersion=f"{GROUP}/{VERSION}",
            kind=KIND,
            metadata=ObjectMeta(name=name, labels={"app.kubernetes.io/part-of": "epguard"}),
        )
        try:
            self.client.create(obj)
        except ApiError as exc:
            if exc.status.code == 409:
                raise FileExistsError(name) from exc
            raise
