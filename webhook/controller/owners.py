"""The owner people look at: a pod made by a Deployment or a LeaderWorkerSet is not
where anyone looks when it fails, so Events go to its top owner too (following
controller ownerReferences: Pod → ReplicaSet → Deployment, Pod → StatefulSet →
LeaderWorkerSet, …). Used by the recorder and the preflight."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.webhook.cluster.kube import Json, get_object, meta, post_event, resource_path
from epguard.webhook.engine.workloads import as_list

log = logging.getLogger("epguard.controller.owners")

MAX_OWNER_DEPTH = 5
# Who the Events and the objects the controller writes say they come from.
COMPONENT = "epguard-controller"


class Unreadable(Exception):
    """An object that cannot be read (403: the chart's RBAC does not cover its kind;
    404: gone). ``reason`` is the API server's."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def top_owner(
    read_object: Callable[[str], Json], namespace: str, refs: Any
) -> client.V1ObjectReference | None:
    """Follow controller ownerReferences up (``read_object`` GETs one by REST path, or
    raises :class:`Unreadable`); None when the object has no owner."""
    top: client.V1ObjectReference | None = None
    for _ in range(MAX_OWNER_DEPTH):
        ref = next(
            (r for r in as_list(refs) if isinstance(r, Mapping) and r.get("controller")),
            None,
        )
        if ref is None:
            return top
        api_version, kind, name = ref.get("apiVersion"), ref.get("kind"), ref.get("name")
        if not (isinstance(api_version, str) and isinstance(kind, str) and isinstance(name, str)):
            return top
        uid = ref.get("uid")
        top = client.V1ObjectReference(
            api_version=api_version,
            kind=kind,
            name=name,
            namespace=namespace,
            uid=uid if isinstance(uid, str) else None,
        )
        # Every owner kind that makes pods pluralizes as kind + "s".
        path = resource_path(api_version, kind.lower() + "s", namespace, name)
        try:
            parent = read_object(path)
        except Unreadable as exc:
            # 403: the chart's RBAC does not cover this owner kind; 404: gone. Either
            # way the owner we have is the best we can name.
            log.debug("stopping owner walk at %s/%s: %s", kind, name, exc.reason)
            return top
        refs = meta(parent).get("ownerReferences")
    return top


class KubeObjects:
    """The calls the recorder and the preflight both make on the official client (blocking:
    kopf runs handlers in its executor): any object by path, for the owner walk, and
    Events."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def read_object(self, path: str) -> Json:
        try:
            return get_object(self.api, path)
        except ApiException as exc:
            raise Unreadable(str(exc.reason)) from exc

    def post_event(
        self,
        about: client.V1ObjectReference,
        reason: str,
        message: str,
        *,
        warning: bool,
        key: str,
    ) -> bool:
        return post_event(
            self.api, about, reason, message, warning=warning, component=COMPONENT, key=key
        )
