"""The owner people look at: a pod made by a Deployment or a LeaderWorkerSet is not
where anyone looks when it fails, so Events go to its top owner too (following
controller ownerReferences: Pod → ReplicaSet → Deployment, Pod → StatefulSet →
LeaderWorkerSet, …). Used by the recorder and the preflight."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.webhook.cluster.kube import Json, get_object, meta, post_event, resource_path
from epguard.webhook.engine.workloads import as_list

log = logging.getLogger("epguard.controller.owners")

MAX_OWNER_DEPTH = 5
# The owner kinds read to go further up: (API group, kind) of those the chart's
# ClusterRole lets the controller get (templates/rbac-controller.yaml, checked by
# tests/chart/test_rbac_table.py). Another kind is named (its Events go to it) but never
# read: an ownerReference is the tenant's to write, and reading what it names, with the
# controller's rights, is reading what the tenant chooses.
FOLLOWED = frozenset({
    ("apps", "ReplicaSet"), ("apps", "Deployment"), ("apps", "StatefulSet"),
    ("apps", "DaemonSet"), ("batch", "Job"), ("batch", "CronJob"),
    ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"), ("nvidia.com", "DynamoGraphDeployment"),
})  # fmt: skip
# What the API server lets an owner reference say is only "not empty"; these are what a
# real one is: a group/version, a kind, an object name (a DNS-1123 subdomain). A
# reference that is none of these ends the walk before it is named or read (before,
# ``../../../pods`` as a name made the controller GET every pod in the cluster).
_API_VERSION_RE = re.compile(
    r"(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?v[0-9]+(?:(?:alpha|beta)[0-9]+)?"
)
_KIND_RE = re.compile(r"[A-Za-z][A-Za-z0-9]{0,62}")
_NAME_RE = re.compile(r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?")
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
        if not (
            isinstance(api_version, str)
            and isinstance(kind, str)
            and isinstance(name, str)
            and _API_VERSION_RE.fullmatch(api_version)
            and _KIND_RE.fullmatch(kind)
            and _NAME_RE.fullmatch(name)
        ):
            return top
        uid = ref.get("uid")
        top = client.V1ObjectReference(
            api_version=api_version,
            kind=kind,
            name=name,
            namespace=namespace,
            uid=uid if isinstance(uid, str) else None,
        )
        if (api_version.rpartition("/")[0], kind) not in FOLLOWED:
            return top
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
