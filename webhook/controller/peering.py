"""The ClusterKopfPeering object that kopf peering needs.

kopf reads and patches the peering object but never creates it, and the chart cannot
render it: Helm resolves every kind before it installs anything, so a custom resource
whose CRD arrives in the same release fails the first `helm install`. The controller
creates it at start instead (RBAC: `create` on clusterkopfpeerings). Idempotent: an
existing object, or one created by the other replica a moment earlier, is fine.

It also answers which replica leads (:class:`Leadership`), by kopf's own rule, for the
loops kopf does not pause on the other replica.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.webhook.cluster.kube import REQUEST_TIMEOUT, api_message

log = logging.getLogger("epguard.controller.peering")

GROUP, VERSION, KIND, PLURAL = "kopf.dev", "v1", "ClusterKopfPeering", "clusterkopfpeerings"


class PeeringApi(Protocol):
    def exists(self, name: str) -> bool: ...

    def create(self, name: str) -> None:
        """Create the object; raise FileExistsError when it already exists."""

    def peers(self, name: str) -> Mapping[str, Any]:
        """The object's ``status``: kopf's entry per replica (an empty map when none)."""


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


# -- which replica leads ------------------------------------------------------------------

# kopf's own default for a peer that wrote no lifetime (kopf/_core/engines/peering.py).
DEFAULT_LIFETIME = 60
# How long an answer is reused: a pass loop asks before every pass, and passes come in
# bursts of pod events; kopf itself pauses or resumes only when the peering object changes.
REFRESH_SECONDS = 1.0


def leads(peers: Mapping[str, Any], identity: str, priority: int, now: dt.datetime) -> bool:
    """kopf's rule for which replica runs, read from the peering object's ``status`` (one
    entry per replica: priority, lifetime, lastseen): this replica is paused while another
    live replica has a priority higher than or equal to its own (kopf pauses both on a
    tie). An entry that does not parse is no replica."""
    for who, info in peers.items():
        if who == identity or not isinstance(info, Mapping):
            continue
        try:
            their = int(info.get("priority", 0))
            lifetime = dt.timedelta(seconds=int(info.get("lifetime", DEFAULT_LIFETIME)))
            seen = info.get("lastseen")
            # kopf counts a replica that wrote no time as seen now.
            lastseen = now if seen is None else dt.datetime.fromisoformat(seen)
        except (TypeError, ValueError, OverflowError):
            continue
        if lastseen.tzinfo is None:
            lastseen = lastseen.replace(tzinfo=dt.UTC)
        if lastseen + lifetime > now and their >= priority:
            return False
    return True


class Leadership:
    """Whether this replica is the one kopf peering keeps active, for the loops kopf does
    not pause itself (the preflight passes, the backstop's writer): kopf pauses only its
    watches and daemons, so without this both replicas ran every pass and every sync --
    harmless (each write is idempotent) but twice the work for the API server and the
    node. Standalone (no peering): always. ``leads`` makes an API call: call it from a
    thread. When the peering object cannot be read, the answer is yes: a loop that runs
    twice is wasteful, one that never runs would keep pods gated."""

    def __init__(
        self,
        api: PeeringApi | None,
        name: str,
        identity: str = "",
        priority: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api, self.name, self.identity, self.priority = api, name, identity, priority
        self.clock = clock
        self._answer: bool | None = None
        self._asked = 0.0
        self._failing = False
        self._lock = threading.Lock()

    def leads(self) -> bool:
        if not self.name or self.api is None:
            return True
        with self._lock:
            if self._answer is not None and self.clock() - self._asked < REFRESH_SECONDS:
                return self._answer
            try:
                peers = self.api.peers(self.name)
            except Exception as exc:
                answer = True
                if not self._failing:  # once per outage, not once a second
                    said = api_message(exc) if isinstance(exc, ApiException) else repr(exc)
                    log.warning("peering %s unreadable (%s): running as if leading",
                                self.name, said)  # fmt: skip
                self._failing = True
            else:
                self._failing = False
                answer = leads(peers, self.identity, self.priority, dt.datetime.now(dt.UTC))
            if answer != self._answer:
                log.info(
                    "%s (peering %s, priority %d)",
                    "this replica leads: preflight passes and backstop syncs run here"
                    if answer
                    else "another replica leads: preflight passes and backstop syncs pause",
                    self.name,
                    self.priority,
                )
            self._answer, self._asked = answer, self.clock()
            return answer
