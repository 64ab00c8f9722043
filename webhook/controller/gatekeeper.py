"""The preflight gate's controller half: one preflight pod per image key, and the gate
on every waiting pod decided from its result (engine/preflight.py has the pure half).

Level-triggered: each pass lists the gated worker pods and the preflight pods and makes
the world agree -- a missing preflight is created (signed, as ``/mutate`` signs an
injected probe), a result decides every pod waiting on it, a preflight nobody waits on
any more is deleted. So a restarted controller, or the other replica after a failover,
picks up every gated pod and running preflight where they are: nothing stays gated
forever (the deadline counts from the preflight's creation), and nothing runs twice
(a preflight's name is its key's hash; a second create is a 409). Passes run on the
replica kopf peering keeps active (``leadership.Leadership``); both may run one at once for
a moment around a failover, and every write is idempotent (a 409 on create, a failed
``test`` on an ungate patch, Events named by their occurrence).

What each result does to the pods waiting on it:

* ``clear`` (the image's files prove no cause): the gate comes off; the injected
  init-container probe still runs on the GPU node;
* ``unusable`` (an image cause): the gate stays; the pod's ``epguard.io/Preflight``
  condition (False) and a Warning Event on the pod and its owner carry the probe's first
  line. The recorder learns the ImageVerdict from the signed preflight pod like from any
  probe, and ``/validate`` refuses new pods on that image;
* ``failed`` (it could not judge: pull error, unschedulable, deadline, no python3):
  ``preflight.onError`` decides: ``open`` removes the gate with a Warning Event, ``hold``
  keeps it with the condition saying why.

A finished preflight answers for its key for ``preflight.retainSeconds`` (new pods on
the image are decided at once; a "cannot judge" only for pods created before it), then
it is deleted, and made again if pods still wait on it (not sooner than a preflight's
deadline after its answer).

Writes to pods: the gate's removal (a JSON patch that ``test``s the gate's place first)
and the condition (``pods/status``); the chart's ValidatingAdmissionPolicy lets this
ServiceAccount change nothing else in a pod, and create and delete only preflight pods.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.probe import shell
from epguard.webhook.cluster.kube import (
    REQUEST_TIMEOUT,
    Json,
    api_message,
    get_object,
    list_items,
    meta,
    raw,
    resource_path,
    status_causes,
)
from epguard.webhook.controller import background
from epguard.webhook.controller.config import ControllerConfig
from epguard.webhook.controller.leadership import STANDALONE, Leadership
from epguard.webhook.controller.owners import KubeObjects, top_owner
from epguard.webhook.engine.argv import analyse_container
from epguard.webhook.engine.imageref import ImageRefError
from epguard.webhook.engine.imageref import parse as parse_ref
from epguard.webhook.engine.injection import InjectionSettings
from epguard.webhook.engine.namespaces import PREFLIGHT_KEY
from epguard.webhook.engine.outcome import PROBED_LABEL
from epguard.webhook.engine.preflight import (
    CONDITION,
    GATE,
    KEY_LABEL,
    MAX_IMAGES,
    MAX_MESSAGE,
    NAME_PREFIX,
    PREFLIGHT_LABEL,
    PreflightKey,
    PreflightResult,
    PreflightSettings,
    condition_patch,
    disruption,
    is_gated,
    key_of,
    mounts_the_probe_image,
    preflight_pod,
    preflight_result,
    preflight_status,
    shaped_as_preflight,
    signed,
    ungate_patch,
)
from epguard.webhook.engine.signing import Keyring, created_at, verify
from epguard.webhook.engine.text import cut, parse_time
from epguard.webhook.engine.workloads import as_list, as_map, as_mapping, describe

log = logging.getLogger("epguard.controller.gatekeeper")

# A key rotated less than this long ago does not sign preflights yet (the webhook's
# watch of the key Secret takes well under a second; a replica whose watch reconnects
# after a dropped connection backs off up to 30 s).
KEY_SETTLE_SECONDS = 120.0
# A pass runs at least this often (a preflight's deadline, a retained one's expiry), and
# at once after a pod event that may change something.
INTERVAL_SECONDS = 5.0
# Threads a pass makes its API calls on (preflight creates, conditions, gates, Events).
PASS_WORKERS = 8
# Bounds on what a pass holds, whatever the tenants' pods are like. A pod is up to
# 1.5 MiB as etcd stores it, and a tenant chooses its worker: 50,000 small env entries
# (or tolerations) in 1.5 MiB parse to ~12 MB of Python objects. So the pass reads
# POD_PAGE pods a page and decodes them one at a time (cluster/kube.py list_items: a
# page of 24 such pods is 36 MB of bytes, as much again to find where each ends, and
# one 12 MB pod, beside the controller's 80-130 MiB measured with 200 gated pods, under
# its 256 Mi limit; each request costs, so pages are not smaller: 200 gated pods on the
# 2-core node under load took 13 s to list at 8 a page); it keeps of each pod only
# what deciding it needs (_slim, _slim_preflight), and holds a whole pod again only to
# make its key's preflight: read afresh then, WHOLE_PODS at a time. At most
# NEW_PER_NAMESPACE preflights are started in one namespace a pass (the others in the
# next passes, seconds later), so one namespace's thousand new images delay no other
# namespace's preflight.
POD_PAGE = 24
WHOLE_PODS = 2
# A preflight copies the worker's placement (tolerations, affinity, node selector, pull
# secrets); real ones are a few KiB. Past this its pods are decided by onError: the
# creates run PASS_WORKERS at a time, each holding its preflight (~8x this, parsed).
MAX_PREFLIGHT_BYTES = 256 * 1024
NEW_PER_NAMESPACE = 16
# Finished preflights that no pod waits on, kept to answer for their keys, at most this
# many a namespace (the newest; the older ones deleted, their keys judged again when a
# pod asks). A tenant that gated one pod after another, each on a pull secret name of
# its own, and deleted each once its preflight ended, left a finished preflight a key
# for the whole retention, 16 more each pass: every pass lists them all, and the
# controller of every namespace ran out of memory (review helper).
RETAINED_PER_NAMESPACE = 64
# An answer run (Preflights.answer) lists its namespaces ANSWER_LISTS at a time, each
# ANSWER_PAGE pods a page: on the loaded node a list took ~0.25 s a request, and 5
# namespaces one after another took 2.4 s. And LISTS lists at most run at once in all, a
# pass's included: with the pods above, a pass's page is 36 MB of bytes, as much again
# split, and a 12 MB parsed pod (84 MB); an answer run's list a third of that in bytes
# (36 MB): two lists at once hold 120 MB at most, beside the controller's 80-130 MiB,
# whatever the number of namespaces whose preflights answered.
ANSWER_LISTS = 2
ANSWER_PAGE = 8
NOTED = 10_000  # preflights an Answers remembers having noted (a uid each, ~100 bytes)
LISTS = 2  # lists at once in all: a pass's and an answer run's, or two of an answer run's
# And a pass starts creates for CREATE_SECONDS at most, taken from the namespaces in
# turn: the creates go through admission, and on the 2-core node under load 78 of them
# made a 13.8 s pass, during which every preflight that ended waited to have its pods
# decided (the gates' "within 10 s of the preflight's end"). The rest are left to the
# next pass, which starts at once. A time, not a count: where creates are quick, one
# pass still takes them all (a count of 24 took 84 passes of 2,000 pods each, 45 s, in
# bench/preflight_bench.py, where one pass takes ~1 s).
CREATE_SECONDS = 2.0
# Namespaces a controller remembers as making their preflights with the copy container
# (Preflights._copied): a short name each. Past it, a new one pays a refused create per
# preflight instead of one in all.
COPYING_NAMESPACES = 10_000
# An opened pod's condition is written up to OPENED_WRITES times (OPENED_BACKOFF s, then
# twice that, between): no pass lists a pod once its gate is gone, so a failed write
# would leave what it said before ("waiting for the preflight") for good.
OPENED_WRITES = 3
OPENED_BACKOFF = 0.5


# What a preflight epguard has just created says: running, bounded by its own deadline.
STARTED = PreflightResult("running", "")


class Conflict(Exception):
    """A write that lost a race (409, or a JSON patch whose ``test`` failed)."""


class Refused(Exception):
    """A create the API server refused (403 RBAC, a policy, 422 an invalid pod): the
    preflight cannot run, and ``preflight.onError`` decides for its pods."""


def failed_write(exc: ApiException) -> type[Refused] | type[Conflict] | None:
    """What a pod write's error means: Refused (RBAC or an admission step said no; a
    policy's refusal is a 422 that says "denied"), Conflict (the pod is gone, replaced,
    or moved on: a failed uid precondition or JSON patch ``test``, an invalid write; the
    same write again cannot succeed), or None (the API server's trouble: try again)."""
    if exc.status in (400, 403) or (exc.status == 422 and "denied" in api_message(exc)):
        return Refused
    if exc.status in (404, 409, 422):
        return Conflict
    return None


class Terminating(Exception):
    """The pod's namespace is being deleted (the API server creates nothing in it): its
    pods go with it, so they are left as they are -- a held pod is not opened on its
    way out."""


class PreflightApi(Protocol):
    """The API calls the preflight needs; the real one is :class:`KubePreflightApi`, the
    tests use an in-memory one (tests/controller/test_gatekeeper.py)."""

    def preflight_pods(self, namespace: str | None = None) -> Iterable[Json]:
        """Every pod labelled as epguard's preflight (and probed), in ``namespace`` or
        (None) every namespace."""

    def unscheduled_probed_pods(self, namespace: str | None = None) -> Iterable[Json]:
        """Every pod with the ``epguard.io/probed`` label and no node yet (a gated pod has
        none), in ``namespace`` or (None) every namespace, read a page at a time."""

    def read_pod(self, namespace: str, name: str) -> Json | None:
        """The pod as it is now; None when it is gone."""

    def create_pod(self, namespace: str, body: Json) -> Json:
        """Create, and return the pod as the API server stored it (after every admission
        step); Conflict when a pod of that name exists, Terminating when the namespace
        is being deleted, Refused when the API server refuses it."""

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """Delete that pod (that uid only); gone already is fine."""

    def patch_pod(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        """Apply a JSON patch; Conflict when a ``test`` fails or the pod changed, Refused
        when an admission policy or webhook refuses it."""

    def set_condition(self, namespace: str, name: str, uid: str, condition: Json) -> None:
        """Set one condition in the status (``pods/status``, merged by type) of the pod
        ``uid`` only: another pod made since under that name makes it fail."""

    def read_object(self, path: str) -> Json:
        """Any object by REST path; Unreadable when the API server refuses it."""

    def post_event(
        self, about: client.V1ObjectReference, reason: str, message: str, *, warning: bool, key: str
    ) -> bool:
        """One Event named by (``about``, ``key``); False when it could not be posted."""


class KubePreflightApi(KubeObjects):
    """:class:`PreflightApi` on the official client."""

    def __init__(self, api: client.ApiClient) -> None:
        super().__init__(api)
        self.core = client.CoreV1Api(api)

    def preflight_pods(self, namespace: str | None = None) -> Iterator[Json]:
        return self._pods(namespace, label_selector=f"{PROBED_LABEL}=true,{PREFLIGHT_LABEL}=true")

    def unscheduled_probed_pods(self, namespace: str | None = None) -> Iterator[Json]:
        # The scheduler's own selector for pods without a node: running workers (most
        # probed pods) are never read.
        return self._pods(
            namespace, label_selector=f"{PROBED_LABEL}=true", field_selector="spec.nodeName="
        )

    def _pods(self, namespace: str | None, **selectors: str) -> Iterator[Json]:
        # One namespace's: an answer run's (ANSWER_LISTS side by side).
        if namespace is None:
            return list_items(
                self.core.list_pod_for_all_namespaces, page_size=POD_PAGE, **selectors
            )
        return list_items(
            self.core.list_namespaced_pod, namespace, page_size=ANSWER_PAGE, **selectors
        )

    def read_pod(self, namespace: str, name: str) -> Json | None:
        try:
            return get_object(self.api, resource_path("v1", "pods", namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_pod(self, namespace: str, body: Json) -> Json:
        try:
            # The client sends a dict body as it is (no model round trip).
            pod = cast(client.V1Pod, body)
            return raw(
                self.core.create_namespaced_pod(
                    namespace, pod, _request_timeout=REQUEST_TIMEOUT, _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(str(exc.reason)) from exc
            if exc.status == 403 and "NamespaceTerminating" in status_causes(exc):
                raise Terminating(api_message(exc)) from exc
            if exc.status in (400, 403, 404, 422):
                raise Refused(api_message(exc)) from exc
            raise

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        try:
            self.core.delete_namespaced_pod(
                name,
                namespace,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def patch_pod(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        try:
            self.core.patch_namespaced_pod(
                name,
                namespace,
                ops,
                _content_type="application/json-patch+json",
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as exc:
            # A failed `test` (the gate moved) is a 422 too; an admission refusal names
            # the policy or webhook that refused.
            failure = failed_write(exc)
            if failure is not None:
                raise failure(api_message(exc)) from exc
            raise

    def set_condition(self, namespace: str, name: str, uid: str, condition: Json) -> None:
        self.core.patch_namespaced_pod_status(
            name,
            namespace,
            condition_patch(uid, condition),
            _content_type="application/strategic-merge-patch+json",
            _request_timeout=REQUEST_TIMEOUT,
        )


class KeySource(Protocol):
    def refresh(self) -> Keyring | None:
        """The keys held (read once if none are)."""

    def reread(self) -> Keyring | None:
        """The keys read again (a preflight names a key not held: the other replica may
        have rotated)."""


@dataclass(frozen=True, slots=True)
class PreflightConfig:
    settings: PreflightSettings
    on_error: str = "open"  # or "hold"
    retain_seconds: int = 3600

    @classmethod
    def of(cls, config: ControllerConfig) -> PreflightConfig:
        return cls(
            PreflightSettings(
                InjectionSettings(config.probe_image),
                timeout_seconds=config.preflight_timeout_seconds,
                gpus="worker" if config.preflight_gpus == "worker" else "0",
                probe_volume="image" if config.preflight_probe_volume == "image" else "copy",
            ),
            on_error=config.preflight_on_error,
            retain_seconds=config.preflight_retain_seconds,
        )


@dataclass
class Pass:
    """What one pass did, for the log and the tests."""

    created: list[str] = field(default_factory=list)
    ungated: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    # Where the pass's time went (seconds): the list, the pods whose preflights had
    # answered, the rest (preflights created, other pods' conditions); and how many pods
    # the list held.
    listed: float = 0.0
    answered: float = 0.0
    rest: float = 0.0
    pods: int = 0
    deferred: int = 0  # preflights left to the next pass (CREATE_SECONDS)

    def add(self, other: Pass) -> None:
        """Another namespace's answer run, beside this one's (its times: the longest)."""
        self.created += other.created
        self.ungated += other.ungated
        self.held += other.held
        self.deleted += other.deleted
        self.listed = max(self.listed, other.listed)
        self.answered = max(self.answered, other.answered)
        self.rest = max(self.rest, other.rest)
        self.pods += other.pods
        self.deferred += other.deferred


@dataclass(frozen=True, slots=True)
class _Written:
    """A condition this process wrote on a pod: what it says, when the list it was
    decided from began, and when the write finished (None: in flight)."""

    said: tuple[str, str, str]  # status, reason, message
    since: float
    finished: float | None


@dataclass
class _Survey:
    """What a pass (or an answer run) listed, kept slim: the preflights by (namespace,
    name) -- ``ours`` those epguard signed --, the gated pods with their keys, and per key
    its oldest waiting pod's creation, its first waiting pod, and whether its create is
    left to a later pass (NEW_PER_NAMESPACE). Keys are per namespace: namespaces' surveys
    add up."""

    preflights: dict[tuple[str, str], Json] = field(default_factory=dict)
    ours: dict[tuple[str, str], Json] = field(default_factory=dict)
    # Preflights to delete and make again, with why: signed with a key not held
    # (_preflight_state: UNHELD), stopped by the cluster (disruption), or a "cannot judge" older
    # than a pod waiting on it.
    remake: dict[tuple[str, str], tuple[Json, str]] = field(default_factory=dict)
    newest: dict[PreflightKey, dt.datetime] = field(default_factory=dict)
    waiting: list[tuple[Json, list[PreflightKey]]] = field(default_factory=list)
    oldest: dict[PreflightKey, dt.datetime] = field(default_factory=dict)
    first: dict[PreflightKey, Json] = field(default_factory=dict)
    deferred: set[PreflightKey] = field(default_factory=set)
    pods: int = 0
    # When each namespace's lists began (time.monotonic(); None: every namespace's).
    listed: dict[str | None, float] = field(default_factory=dict)

    def since(self, namespace: str) -> float:
        return self.listed.get(namespace, self.listed.get(None, 0.0))

    def add(self, other: _Survey) -> None:
        self.listed |= other.listed
        self.preflights |= other.preflights
        self.ours |= other.ours
        self.remake |= other.remake
        self.newest |= other.newest
        self.waiting += other.waiting
        self.oldest |= other.oldest
        self.first |= other.first
        self.deferred |= other.deferred
        self.pods += other.pods


GRACE_SECONDS = 60


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _made_by_epguard(pod: Mapping[str, Any], ring: Keyring | None) -> bool:
    """A preflight pod whose signature verifies: epguard's own (a tenant can label a pod
    of its own as a preflight, never sign it), built as a preflight (a tenant's injected
    worker is signed too, and its labels are the tenant's: the chart's policy
    epguard-preflight-labels refuses them, and this holds without it)."""
    return ring is not None and shaped_as_preflight(pod) and verify(ring, _name(pod)[0], pod).ok


# Why a pod named as its key's preflight is made again rather than read.
UNHELD = "its preflight was signed with a key epguard does not hold now, or by an older epguard"
CHANGED = "its preflight was changed by an admission step after epguard signed it"


def _preflight_state(pod: Mapping[str, Any], ring: Keyring | None) -> str | None:
    """None for epguard's own preflight (_made_by_epguard); for a pod named as its key's
    preflight that is not, why it is made again: UNHELD, signed with a key the controller
    does not hold (made before its keys rotated past it, or by the other replica with a
    newer key than this one has read, or by an older epguard in an older format), or
    CHANGED, signed with a key it holds but changed since (a LimitRange default, a
    mutating webhook: before, such a pod read as a tenant's, and its pods were opened or
    held for good); "" for any other pod labelled as a preflight (a tenant's, left
    alone). Never evidence but the first. One verification a pod."""
    if ring is None:
        return ""
    shaped = shaped_as_preflight(pod)
    checked = verify(ring, _name(pod)[0], pod)
    if shaped and checked.ok:
        return None
    key = as_map(meta(pod).get("labels")).get(KEY_LABEL)
    if checked.ok or not isinstance(key, str) or _name(pod)[1] != NAME_PREFIX + key:
        return ""
    if checked.outdated or (checked.key_id and ring.find(checked.key_id) is None):
        return UNHELD
    return CHANGED if shaped and checked.key_id else ""


def _name(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    m = meta(obj)
    return str(m.get("namespace") or ""), str(m.get("name") or ""), str(m.get("uid") or "")


_IDENTITY = ("namespace", "name", "uid", "creationTimestamp", "deletionTimestamp")


def _identity(m: Mapping[str, Any]) -> Json:
    """The metadata a pass keeps of any pod: names, creation and deletion."""
    return {k: m[k] for k in _IDENTITY if k in m}


UNGATE = "ungate"  # a slim pod's key for its ungate patch (no key of a real pod)


def _slim(pod: Mapping[str, Any]) -> Json:
    """What a pass keeps of a pod it decides: its names, creation and deletion, its
    controller owner, the patch that removes epguard's gate (made now: it tests the gate
    at its place, and a tenant may put 65,000 gates of its own before it -- kept as a
    list of that length, they were half of a 1 MiB pod, for every gated pod of a pass)
    and epguard's condition. Whatever else the pod holds (a tenant's 1 MiB env) is
    dropped."""
    m = meta(pod)
    owner = _controller_owner(m)
    conditions = as_list(as_map(pod.get("status")).get("conditions"))
    return {
        "metadata": _identity(m) | {"ownerReferences": owner},
        "spec": {"schedulingGates": [{"name": GATE}] if is_gated(pod) else []},
        "status": {"conditions": [c for c in conditions if as_map(c).get("type") == CONDITION]},
        UNGATE: ungate_patch(pod),
    }


# An owner's apiVersion, kind, name and uid are each far shorter than this (a name is a
# DNS subdomain, at most 253 characters); the API server checks no length in an
# ownerReference, and a 1.4 MB name was kept whole for every waiting pod of a pass.
_OWNER_FIELD = 320


def _controller_owner(m: Mapping[str, Any]) -> list[Json]:
    """An object's controller ownerReference, as a list of at most one, with only the
    parts a pass uses (whose Event it posts); none when one is longer than any real
    owner's."""
    ref = next((r for r in as_list(m.get("ownerReferences")) if as_map(r).get("controller")), None)
    r = as_map(ref)
    kept = {k: r.get(k) for k in ("apiVersion", "kind", "name", "uid")}
    if not all(isinstance(v, str) and 0 < len(v) <= _OWNER_FIELD for v in kept.values()):
        return []
    return [{**kept, "controller": True}]


def _as_parent(obj: Mapping[str, Any]) -> Json:
    """What a pass keeps of an owner it read (for the whole pass: each is read once):
    its controller ownerReference, the one thing the owner walk reads. A Deployment's
    1.4 MB template was kept whole, for each owner of a pass."""
    return {"metadata": {"ownerReferences": _controller_owner(meta(obj))}}


def _slim_preflight(pod: Mapping[str, Any]) -> Json:
    """What a pass keeps of a preflight epguard made (its signature verified already):
    names, creation, its key and what its status says (the kubelet's: what the
    preflight said; preflight_status). Its spec copies the worker's tolerations and
    affinity, which a tenant writes."""
    m = meta(pod)
    labels = as_map(m.get("labels"))
    return {
        "metadata": _identity(m)
        | {"labels": {k: labels[k] for k in (KEY_LABEL, PREFLIGHT_LABEL) if k in labels}},
        "status": preflight_status(pod),
    }


def _answered_at(pod: Mapping[str, Any]) -> dt.datetime | None:
    """When a preflight's containers last ended (the kubelet's ``finishedAt``), if any."""
    status = as_map(pod.get("status"))
    ends = [
        parse_time(as_map(as_map(as_map(c).get("state")).get("terminated")).get("finishedAt"))
        for part in ("initContainerStatuses", "containerStatuses")
        for c in as_list(status.get(part))
    ]
    return max((t for t in ends if t is not None), default=None)


def _preflight_mark(key: PreflightKey) -> str:
    """How a hold's message names the preflight that found its image cause (whose log,
    ``kubectl logs <it> -c epguard-probe``, has the probe's whole report)."""
    return f"[preflight {key.pod_name}]"


def _held_for_an_image_cause(pod: Mapping[str, Any], keys: Iterable[PreflightKey]) -> bool:
    """Whether the pod's epguard condition, as listed, holds it for an image cause that
    one of its images now (``keys``) was found to have: a pod whose image was changed
    since is judged afresh."""
    marks = [_preflight_mark(k) for k in keys]
    return any(
        as_map(c).get("type") == CONDITION
        and as_map(c).get("status") == "False"
        and as_map(c).get("reason") == "ImageUnusable"
        and any(m in str(as_map(c).get("message")) for m in marks)
        for c in as_list(as_map(pod.get("status")).get("conditions"))
    )


def _ref(obj: Mapping[str, Any]) -> client.V1ObjectReference:
    namespace, name, uid = _name(obj)
    return client.V1ObjectReference(
        api_version="v1", kind="Pod", name=name, namespace=namespace, uid=uid or None
    )


def worker_keys(pod: Mapping[str, Any]) -> list[PreflightKey]:
    """The keys a gated pod waits on: one per image of a container that asks for
    mooncake, read as the webhook reads it (the pod as it is now: an UPDATE that changed
    an image is judged on the new one). A reference that does not parse is left out, as
    the webhook's gate leaves it (preflight.unjudged): its pull fails anyway, and a key
    would keep the pod's string (the API server allows 700 KB) for the whole pass. At
    most MAX_IMAGES, the first ones."""
    namespace, _, _ = _name(pod)
    spec = as_map(pod.get("spec"))
    budget = shell.Budget()
    images: dict[str, None] = {}
    for c in as_list(spec.get("containers")):
        if len(images) >= MAX_IMAGES:
            break
        if (
            isinstance(c, Mapping)
            and isinstance(c.get("image"), str)
            and _parses(c["image"])
            and analyse_container(c, budget).worker
        ):
            images.setdefault(c["image"], None)
    return [key_of(namespace, spec, image) for image in images]


def _parses(image: str) -> bool:
    try:
        parse_ref(image)
    except ImageRefError:
        return False
    return True


class _ReadOnce:
    """``read_object`` for one pass: each path read once, by whichever thread asks first;
    the others wait for its answer (or its error)."""

    def __init__(self, read: Callable[[str], Json]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._answers: dict[str, Future[Json]] = {}

    def __call__(self, path: str) -> Json:
        with self._lock:
            answer = self._answers.get(path)
            mine = answer is None
            if answer is None:
                answer = self._answers[path] = Future()
        if mine:
            try:
                answer.set_result(self._read(path))
            except Exception as exc:
                answer.set_exception(exc)
        return answer.result()


class Preflights:
    """One pass at a time: see the module's docstring."""

    def __init__(
        self,
        api: PreflightApi,
        config: PreflightConfig,
        keys: KeySource,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.config = config
        self.keys = keys
        self.clock = clock
        self.monotonic = monotonic  # CREATE_SECONDS
        self._failed: set[PreflightKey] = set()  # keys whose create started nothing last pass
        # Failures that stand for a deadline without a preflight being made (when, what
        # was said): a preflight an admission step changed, or one stopped or removed
        # before it answered once the key waited past the deadline. A held pod does not
        # make (and lose) one every pass.
        self._standing: dict[PreflightKey, tuple[dt.datetime, str]] = {}
        # Keys a preflight was made for (or found) in an earlier pass: only those can
        # have had theirs removed.
        self._had_preflight: set[PreflightKey] = set()
        self._whole = threading.BoundedSemaphore(WHOLE_PODS)
        self._unreadable: set[tuple[str, str]] = set()  # said once each (bounded)
        # Namespaces whose preflights are made with the copy container although
        # preflight.probeVolume is image: there the API server refused the image volume
        # and took the copy (_copied). Per namespace, never for the whole cluster: one
        # namespace's policy engine or quota must not change how another's are made.
        self._copying: set[str] = set()
        self._copying_lock = threading.Lock()
        # The condition this process last wrote on each gated pod: a pass and an answer
        # run (:meth:`answer`) may decide one pod side by side, each from its own list,
        # and the older list must neither undo the newer one's decision nor repeat it
        # (see _condition). Kept for the pods the last whole pass saw gated.
        self._written: dict[str, _Written] = {}
        self._writing = threading.Condition()
        # Lists of tenants' pods held at once (a pass's, an answer run's namespaces):
        # what they hold is bounded by two, not by how many namespaces answer at once.
        self._lists = threading.BoundedSemaphore(LISTS)
        self._keyless_since: dt.datetime | None = None  # see _keys_known
        # When a whole pass first found each key without an answer (kept while it has
        # none, a preflight made again after a disruption included): a key held up is
        # charged from then, not from its pods' age (pods older than the deadline wait
        # when the controller was down, or were held for good on an image cause).
        self._unanswered_since: dict[PreflightKey, dt.datetime] = {}
        self._last_pass: dt.datetime | None = None  # when the last whole pass ended
        # Stopped preflights (by uid) whose key's deadline passed while they were to be
        # made again, and when: that failure then stands as the preflight's answer, for
        # the pods created before then, until the retention retries it (_clean) -- not a
        # preflight made again every deadline for good under onError=hold.
        self._stands: dict[str, dt.datetime] = {}

    def _skip(self, pod: Json, exc: Exception) -> None:
        """A pod the pass cannot read (no such pod is known: insurance) is left as it
        is, gated; said once per pod, whatever the number of passes."""
        at = _name(pod)[:2]
        if at in self._unreadable:
            return
        if len(self._unreadable) >= 10_000:
            self._unreadable.clear()
        self._unreadable.add(at)
        log.warning("pod %s/%s left as it is: it could not be read (%s: %s)",
                    *at, type(exc).__name__, exc)  # fmt: skip

    def run_once(self) -> Pass:
        """A whole pass over every namespace: see the module's docstring."""
        return self._run(None)

    def answer(self, namespaces: Iterable[str]) -> Pass:
        """The pods of ``namespaces`` whose every preflight has answered, decided now (a
        pass's first step, on those namespaces' pods only): what the end of a preflight
        asks for (:class:`Answers`), so that its pods never wait for the pass under way
        and the next one's list of every gated pod (passes of up to 5.9 s, lists of up to
        3.4 s, with 200 gated pods on the loaded 2-core node). Nothing is created or
        deleted here, and a pod still waiting on a preflight is left to the passes. Each
        namespace is decided as soon as its own list is read (ANSWER_LISTS side by side):
        one namespace with many or large pods delays no other's."""
        done = Pass()
        with ThreadPoolExecutor(ANSWER_LISTS) as pool:
            for part in pool.map(self._run, sorted(set(namespaces))):
                done.add(part)
        return done

    def _survey(self, namespace: str | None, ring: Keyring | None, now: dt.datetime) -> _Survey:
        """What the preflights and the gated pods of ``namespace`` (None: every
        namespace) are, kept slim."""
        with self._lists:
            return self._listed(namespace, ring, now)

    def _listed(self, namespace: str | None, ring: Keyring | None, now: dt.datetime) -> _Survey:
        seen = _Survey(listed={namespace: time.monotonic()})
        # The preflights first (so a key's first pod is kept whole only when its
        # preflight is still to be made); a pod labelled as one that epguard did not sign
        # counts by its name alone.
        reread = False
        for pod in self.api.preflight_pods(namespace):
            at = _name(pod)[:2]
            state = _preflight_state(pod, ring)
            if state == UNHELD and not reread:
                reread = True  # once a list: the other replica may have rotated the keys
                ring = self.keys.reread() or ring
                state = _preflight_state(pod, ring)
            if state is None:
                seen.preflights[at] = seen.ours[at] = _slim_preflight(pod)
            elif state:
                # CHANGED is found here when the create's own answer was not read (lost,
                # a restart in between, a delete that failed); the next create finds it.
                seen.preflights[at] = _slim_preflight(pod)
                seen.remake[at] = (seen.preflights[at], state)
            else:
                seen.preflights[at] = _slim(pod)
        starting: Counter[str] = Counter()
        for pod in self.api.unscheduled_probed_pods(namespace):
            seen.pods += 1
            labels = as_map(meta(pod).get("labels"))
            if (
                labels.get(PREFLIGHT_LABEL) == "true"
                or not is_gated(pod)
                or meta(pod).get("deletionTimestamp")
            ):
                continue
            try:
                keys, slim = worker_keys(pod), _slim(pod)
                created = created_at(pod) or now
            except Exception as exc:  # one tenant's pod must not stop everyone's pass
                self._skip(pod, exc)
                continue
            for key in keys:
                seen.oldest[key] = min(seen.oldest.get(key, created), created)
                seen.newest[key] = max(seen.newest.get(key, created), created)
                if key in seen.first:
                    continue
                seen.first[key] = slim
                if (key.namespace, key.pod_name) in seen.preflights:
                    continue
                if key in self._failed:
                    pass  # refused last pass: tried again last, never ahead of the others
                elif starting[key.namespace] < NEW_PER_NAMESPACE:
                    starting[key.namespace] += 1
                else:
                    seen.deferred.add(key)
            seen.waiting.append((slim, keys))
        self._no_answers(seen, now)
        return seen

    def _no_answers(self, seen: _Survey, now: dt.datetime) -> None:
        """epguard's preflights whose "cannot judge" is no answer for their pods: the
        cluster stopped them (evicted, preempted, the node shut down), or a pod waiting on
        one was created after it said so (under onError=open a retained failure opened
        every new pod on the image at once, for the whole retention). Made again; the
        deadline counts on from when the key was first found without an answer."""
        timeout = self.config.settings.timeout_seconds
        keys = {(k.namespace, k.pod_name): k for k in seen.first}
        for at, pod in list(seen.ours.items()):
            if preflight_result(pod, now, timeout).phase != "failed":
                continue
            key = keys.get(at)
            stands = self._stands.get(_name(pod)[2])
            stopped = "" if stands is not None else disruption(pod)
            created = created_at(pod)
            said = (
                stands
                or _answered_at(pod)
                or (created + dt.timedelta(seconds=timeout) if created else None)
            )
            newer = key is not None and said is not None and seen.newest[key] > said
            if stopped or newer:
                why = (
                    f"its preflight was stopped by the cluster ({stopped})"
                    if stopped
                    else "its preflight could not judge before this pod was created"
                )
                del seen.ours[at]
                seen.remake[at] = (pod, why)

    def _run(self, namespace: str | None) -> Pass:
        """A whole pass (``namespace`` None), or one namespace's answer run."""
        now = self.clock()
        done = Pass()
        started = time.monotonic()
        ring = self.keys.refresh()
        if not self._keys_known(ring, now):
            return done
        if namespace is None and (
            self._last_pass is None
            or (now - self._last_pass).total_seconds() > INTERVAL_SECONDS + GRACE_SECONDS
        ):
            # No pass finished for a while (the API server down, another replica leading):
            # that time held nothing up that a pass could have made.
            self._unanswered_since = {}
        seen = self._survey(namespace, ring, now)
        ours, waiting = seen.ours, seen.waiting
        oldest, first, deferred = seen.oldest, seen.first, seen.deferred
        done.pods = seen.pods
        done.listed = time.monotonic() - started

        # Left to the next pass (CREATE_SECONDS from when the creates start).
        budget_spent = PreflightResult(
            "running", "", "the preflights of other images are being started first"
        )
        create_until = 0.0  # set when the creates start

        # The keys whose preflight epguard made and can read: their own deadline
        # (preflight_result) bounds them, not their pods' age -- a pod held for good on an
        # image cause is older than any deadline when its preflight is made again.
        made_by_us = {k for k in first if (k.namespace, k.pod_name) in ours}

        def create(item: tuple[PreflightKey, Json]) -> tuple[PreflightKey, PreflightResult]:
            key, pod = item
            assert ring is not None  # _known asked for a preflight: it held a key
            standing = self._standing_failure(key, now)
            if standing is not None:
                return key, standing  # before any read
            waited = now - self._unanswered_since.get(key, now)
            if key in self._had_preflight and waited > limit:
                # Waiting past the deadline with no preflight now: the last one was
                # stopped or removed before it answered (deleted, or gone with its node
                # between two passes). Made again each time with a deadline of its own,
                # it once kept its pods gated for good under onError=open.
                said = (
                    f"no preflight answered within {int(limit.total_seconds())} s of epguard "
                    "first waiting on one: the last one was stopped or removed before it "
                    "answered"
                )
                self._standing[key] = (now, said)
                return key, PreflightResult("failed", said)
            # One key's trouble (an API error, a namespace's own admission policy) must
            # not stop the pass for every other namespace.
            try:
                with self._whole:  # only the reading: the creates run side by side
                    if self.monotonic() > create_until:
                        return key, budget_spent
                    made = self._body(key, pod)
                if isinstance(made, PreflightResult):
                    return key, made
                result = self._create(key, made, ring, done, pod)
                if result is STARTED:
                    made_by_us.add(key)
                return key, result
            except Exception as exc:
                # The API server's trouble (a 500, a timeout) is no verdict on the
                # image: tried again next pass, until the pods' deadline (overdue).
                log.exception("preflight %s: could not start it", key.pod_name)
                stalled = f"the preflight could not be started: {_error(exc)}"
                return key, PreflightResult("running", "", stalled)

        not_yet = PreflightResult("running", "")  # a key an answer run does not create

        def decide(item: tuple[Json, list[PreflightKey]]) -> None:
            pod, keys = item
            try:
                since = seen.since(_name(pod)[0])
                said = [results.get(k, not_yet) for k in keys]
                self._decide(pod, keys, said, read, done, since)
            except Exception:
                log.exception("preflight: could not decide %s", describe("Pod", *_name(pod)[:2]))

        # Whatever holds a key up (its pod squatted, relabelled, never created), nothing
        # waits past the deadline counted from its first waiting pod (and a minute).
        limit = dt.timedelta(seconds=self.config.settings.timeout_seconds + GRACE_SECONDS)

        def overdue(key: PreflightKey, result: PreflightResult) -> PreflightResult:
            # Deadlines are the passes' (an answer run decides what has answered).
            if result.phase != "running" or key in made_by_us or namespace is not None:
                return result
            held_up = max(oldest[key], self._unanswered_since.get(key, now))
            if now - held_up > limit:
                return PreflightResult(
                    "failed",
                    f"no preflight answered within {int(limit.total_seconds())} s of the "
                    f"first pod's creation (or of epguard finding the preflight missing)"
                    f"{': ' + result.stalled if result.stalled else ''}",
                )
            return result

        # In three steps, so that an answer never waits behind other keys' work (200
        # pods on the 2-core node: up to 27 s from an answer to its gate decided, behind
        # other pods' writes; then up to 3 s behind other keys' preflight creates):
        # 1. what the listed preflights say (no API call), and the pods whose every key
        #    has answered decided at once;
        # 2. the missing preflights created;
        # 3. every other pod decided (a "waiting" condition, mostly).
        # Each key and each pod is a few API calls of its own: the pass makes them on
        # PASS_WORKERS threads (one after another, 200 waiting pods took ~30 s to decide
        # on the 2-core node), and reads each owner once (a ReplicaSet's replicas share it).
        read = _ReadOnce(lambda path: _as_parent(self.api.read_object(path)))
        results: dict[PreflightKey, PreflightResult] = {}
        missing: list[tuple[PreflightKey, Json]] = []
        for key, pod in first.items():
            if key in deferred:
                later = PreflightResult(
                    "running",
                    "",
                    f"{NEW_PER_NAMESPACE} other images of this namespace are having their "
                    "preflights started first",
                )
                results[key] = later  # epguard's own queue: passes rerun at once for it
                continue
            try:
                known = self._known(key, seen, ring, now)
            except Exception as exc:  # this key only
                log.exception("preflight %s: could not make it", key.pod_name)
                known = PreflightResult("failed", f"the preflight could not be made: {_error(exc)}")
            if known is not None:
                results[key] = overdue(key, known)
            else:
                missing.append((key, pod))
        # Those whose create failed last pass go last, so a few slow failures (onError
        # hold retries them) cannot spend every pass's budget ahead of the others.
        missing = sorted(_across_namespaces(missing), key=lambda item: item[0] in self._failed)
        # Answered: every key has answered, or one has found an image cause (the pod is
        # held whatever its other images' preflights say).
        answered = [
            item
            for item in waiting
            if all(k in results and results[k].phase != "running" for k in item[1])
            or any(k in results and results[k].phase == "unusable" for k in item[1])
        ]
        # An answer run's namespaces decide side by side: PASS_WORKERS threads in all.
        workers = PASS_WORKERS if namespace is None else PASS_WORKERS // ANSWER_LISTS
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(decide, answered))
            done.answered = time.monotonic() - started - done.listed
            if namespace is not None:
                return done
            create_until = self.monotonic() + CREATE_SECONDS
            made = list(pool.map(create, missing))
            done.deferred = sum(r is budget_spent for _, r in made)
            # Every key whose create did not start a preflight (refused, over quota, an
            # API error, a name squatted) goes last next pass and takes none of its
            # namespace's places, so it cannot keep another image waiting.
            self._failed = {k for k, r in made if r is not STARTED and r is not budget_spent}
            # What the create budget left is the next pass's at once, not held up.
            results.update((k, r if r is budget_spent else overdue(k, r)) for k, r in made)
            first_step = {id(pod) for pod, _ in answered}
            list(pool.map(decide, [item for item in waiting if id(item[0]) not in first_step]))
        done.rest = time.monotonic() - started - done.listed - done.answered
        self._unanswered_since = {
            key: self._unanswered_since.get(key, now)
            for key in first
            if results.get(key, not_yet).phase == "running"
        }
        for key in first:  # past its deadline while being made again: the failure stands
            at = (key.namespace, key.pod_name)
            if (
                at in seen.remake
                and results.get(key, not_yet).phase == "failed"
                and key not in self._standing  # that one is deleted below, and stands
            ):
                pod, _ = seen.remake.pop(at)
                self._stands[_name(pod)[2]] = now
        listed = {_name(p)[2] for p in seen.preflights.values()}
        self._stands = {uid: t for uid, t in self._stands.items() if uid in listed}
        self._standing = {k: c for k, c in self._standing.items() if k in first}
        self._had_preflight = {k for k in first if k in made_by_us or k in self._had_preflight}
        self._last_pass = self.clock()  # when it ended: a slow pass is still a pass
        gated = {_name(pod)[2] for pod, _ in waiting}
        with self._writing:
            self._written = {
                uid: w for uid, w in self._written.items() if uid in gated or w.finished is None
            }
        self._clean(ours, {k.hash for _, keys in waiting for k in keys}, now, done)
        for (ns, name), (pod, _) in seen.remake.items():  # made again once gone
            self._delete(ns, name, _name(pod)[2], done)
        return done

    def _standing_failure(self, key: PreflightKey, now: dt.datetime) -> PreflightResult | None:
        """The failure that stands for ``key`` (for a deadline from when it was said)."""
        standing = self._standing.get(key)
        deadline = dt.timedelta(seconds=self.config.settings.timeout_seconds)
        if standing is None or now - standing[0] >= deadline:
            return None
        return PreflightResult("failed", standing[1])

    def _keys_known(self, ring: Keyring | None, now: dt.datetime) -> bool:
        """Whether a run may decide: with no keys held (the Secret unread since start, an
        API error), epguard's preflights cannot be told from a tenant's pods under their
        names, and each would read as "a pod epguard did not make" -- every waiting pod
        opened under onError=open. So nothing is decided for up to the deadline (and a
        minute) without keys; past it, onError decides as for any preflight that cannot
        run."""
        if ring is not None:
            self._keyless_since = None
            return True
        if self._keyless_since is None:
            self._keyless_since = now
        waited = (now - self._keyless_since).total_seconds()
        if waited <= self.config.settings.timeout_seconds + GRACE_SECONDS:
            log.warning("preflight: no probe-signing key held (%.0f s): nothing decided", waited)
            return False
        return True

    def _known(
        self, key: PreflightKey, seen: _Survey, ring: Keyring | None, now: dt.datetime
    ) -> PreflightResult | None:
        """What the listed preflight of ``key`` said when the list began (``now``: a list
        can take seconds, and an answer read then is in time); None when it is to be
        made (no API call)."""
        if ring is None:  # past the keyless grace (_keys_known): nothing can be told apart
            return PreflightResult("failed", "the controller holds no probe-signing key")
        at = (key.namespace, key.pod_name)
        existing = seen.ours.get(at)
        if existing is not None and as_map(meta(existing).get("labels")).get(KEY_LABEL) == key.hash:
            return preflight_result(existing, now, self.config.settings.timeout_seconds)
        if at in seen.remake:
            # Still listed while it is deleted: a failure that stands, not "running".
            again = PreflightResult("running", "", f"{seen.remake[at][1]}: it is made again")
            return self._standing_failure(key, now) or again
        if at in seen.preflights:
            # Labelled as a preflight, but not signed by epguard: a tenant's pod under
            # the preflight's name. Its status is no answer.
            return PreflightResult(
                "failed", f"a pod epguard did not make holds the preflight's name {key.pod_name}"
            )
        return None

    def _settings(self, namespace: str) -> PreflightSettings:
        settings = self.config.settings
        if settings.probe_volume == "image" and namespace in self._copying:
            return replace(settings, probe_volume="copy")
        return settings

    def _body(
        self, key: PreflightKey, pod: Json, settings: PreflightSettings | None = None
    ) -> PreflightResult | dict[str, Any]:
        """Key's preflight made from its first pod's spec, read afresh (the pass keeps
        no whole pod); or what to say instead."""
        namespace, name, _ = _name(pod)
        try:
            whole = self.api.read_pod(namespace, name)
        except ApiException as exc:  # the API server's trouble: tried again next pass
            return PreflightResult("running", "", f"could not read pod {name}: {exc.reason}")
        if whole is None or key not in worker_keys(whole):
            # Gone or changed since listed: the next pass sees what waits now.
            return PreflightResult("running", "")
        settings = settings or self._settings(key.namespace)
        body = preflight_pod(key.namespace, as_map(whole.get("spec")), key, settings)
        del whole
        if body is None:  # no container on that image asks for mooncake any more
            return PreflightResult("clear", "no container on this image asks for mooncake")
        size = len(json.dumps(body, separators=(",", ":")))
        if size > MAX_PREFLIGHT_BYTES:
            return PreflightResult(
                "failed",
                f"the preflight made from this pod would be {size:,} bytes (its tolerations, "
                f"affinity and node selector are copied): more than {MAX_PREFLIGHT_BYTES:,}",
            )
        return body

    def _create(
        self,
        key: PreflightKey,
        body: dict[str, Any],
        ring: Keyring,
        done: Pass,
        pod: Json | None = None,
    ) -> PreflightResult:
        """Create ``body`` (made from ``pod``: with it, an image-shaped preflight the API
        server refuses is made again with the copy container, :meth:`_copied`)."""
        try:
            # Signed now, not at the start of the pass: /validate refuses a stale signature.
            now = self.clock()
            signer = ring.settled(now, KEY_SETTLE_SECONDS)
            stored = self.api.create_pod(key.namespace, signed(body, signer, now))
            done.created.append(describe("Pod", key.namespace, key.pod_name))
            if not _made_by_epguard(stored, ring):
                # An admission step changed what epguard signed (a LimitRange's default
                # ephemeral-storage, another mutating webhook): its answer could never be
                # told from a tenant's pod under the preflight's name, which once opened
                # (or held for good) every pod waiting on it. Said now, and deleted.
                why = verify(ring, key.namespace, stored).reason or "it is not a preflight"
                self._delete(key.namespace, key.pod_name, _name(stored)[2], done)
                said = (
                    "the preflight pod was changed by an admission step after epguard "
                    f"signed it ({why}), such as a LimitRange default in this namespace or "
                    "a mutating webhook on pods, so its answer cannot be trusted: exclude "
                    f"pods labelled {PREFLIGHT_LABEL}=true from that webhook, or turn the "
                    f"preflight off for this namespace (label {PREFLIGHT_KEY}=off)"
                )
                self._standing[key] = (self.clock(), said)
                return PreflightResult("failed", said)
            return STARTED
        except Conflict:
            pass  # another pass (the other replica) created it: its result comes next pass
        except Terminating:
            return PreflightResult("gone", "the namespace is being deleted")
        except Refused as exc:
            log.warning("preflight %s/%s refused: %s", key.namespace, key.pod_name, exc)
            said = f"the preflight pod could not be created: {exc}"
            if "exceeded quota" in str(exc):  # the namespace's own pods may free it
                return PreflightResult("running", "", said)
            if pod is not None and mounts_the_probe_image(body):
                return self._copied(key, pod, ring, done, exc)
            return PreflightResult("failed", said)
        return PreflightResult("running", "")

    def _copied(
        self, key: PreflightKey, pod: Json, ring: Keyring, done: Pass, refused: Refused
    ) -> PreflightResult:
        """A preflight with the epguard image as its probe volume was refused: made again
        with the copy container. Where that one is created, the image volume was what
        the API server refused (the ImageVolume feature gate off: the API server drops
        the volume, and the chart's policy refuses a preflight without it; a policy
        engine that knows no image volumes; the chart's policy of an earlier release
        while an upgrade rolls), and the controller makes that namespace's preflights
        with the copy from then on (until it restarts), said once in its log, rather
        than opening or holding every gated pod as a failed preflight (onError). Where
        the copy is refused too, its refusal is the answer, and the namespace keeps the
        image volume."""
        copy_settings = replace(self.config.settings, probe_volume="copy")
        with self._whole:
            made = self._body(key, pod, copy_settings)
        if isinstance(made, PreflightResult):
            return made
        result = self._create(key, made, ring, done)
        if result is not STARTED:
            return result
        with self._copying_lock:
            new = key.namespace not in self._copying
            if new and len(self._copying) < COPYING_NAMESPACES:
                self._copying.add(key.namespace)
        if new:
            log.warning(
                "preflight.probeVolume is image, but the API server refused preflight %s/%s "
                "with the epguard image as its probe volume (%s) and created it with "
                "epguard's copy container: this controller makes the preflights of "
                "namespace %s with the copy from now on. Refused so in every namespace: "
                "image volumes are off in this cluster (docs/preflight.md); in this one "
                "only: a policy of this namespace's",
                key.namespace,
                key.pod_name,
                refused,
                key.namespace,
            )
        return result

    def _decide(
        self,
        pod: Json,
        keys: list[PreflightKey],
        results: list[PreflightResult],
        read: Callable[[str], Json],
        done: Pass,
        since: float,
    ) -> None:
        uid = _name(pod)[2]
        if any(r.phase == "gone" for r in results):
            return  # its namespace is being deleted: it goes as it is, held or gated
        unusable = [(k, r) for k, r in zip(keys, results, strict=True) if r.phase == "unusable"]
        failed = [r for r in results if r.phase == "failed"]
        if unusable:
            key, result = unusable[0]
            message = f"{cut(result.message, MAX_MESSAGE - 120)} {_preflight_mark(key)}"
            self._hold(pod, "ImageUnusable", message, read, done, since)
        elif _held_for_an_image_cause(pod, keys) and not all(r.phase == "clear" for r in results):
            # Proven unusable before: a preflight made again (its key rotated out, the
            # old one deleted) or one that cannot run now proves nothing new. Only its
            # images all found clear open it.
            return
        elif any(r.phase == "running" for r in results):
            stalled = next((r.stalled for r in results if r.stalled), "")
            self._condition(
                since,
                pod,
                "False",
                "PreflightRunning",
                f"waiting for epguard's preflight of this image{': ' + stalled if stalled else ''}",
            )
        elif failed and self.config.on_error == "hold":
            self._hold(pod, "PreflightFailed", failed[0].message, read, done, since)
        else:
            why = (
                failed[0].message
                if failed
                else results[0].message
                if results
                else "no container of this pod asks for mooncake: nothing to judge"
            )
            if self._ungate(pod, done, since):
                warning = bool(failed)
                if warning:
                    log.warning("preflight: %s opened: %s", describe("Pod", *_name(pod)[:2]), why)
                reason = "PreflightFailedGateOpened" if warning else "PreflightPassed"
                said = (
                    f"epguard's preflight could not judge this pod's image, so it is "
                    f"scheduled unjudged (preflight.onError=open): {why}"
                    if warning
                    else f"epguard's preflight found no image cause: {why}"
                )
                self.api.post_event(_ref(pod), reason, said, warning=warning, key=f"{uid}/open")
                self._opened(pod, reason, said)

    def _opened(self, pod: Json, reason: str, said: str) -> None:
        """The condition of a pod whose gate this process removed: the removal is the
        newest fact about the pod, so it is written whatever an older or concurrent
        decision wrote, and tried again (OPENED_WRITES) if the write fails."""
        for attempt in range(1, OPENED_WRITES + 1):
            try:
                if self._condition(time.monotonic(), pod, "True", reason, said) is not None:
                    return
            except Exception:
                if attempt == OPENED_WRITES:
                    raise
            if attempt < OPENED_WRITES:
                time.sleep(OPENED_BACKOFF * attempt)

    def _hold(
        self,
        pod: Json,
        reason: str,
        message: str,
        read: Callable[[str], Json],
        done: Pass,
        since: float,
    ) -> None:
        namespace, name, uid = _name(pod)
        said = f"epguard keeps this pod unscheduled: {message}"
        if self._condition(since, pod, "False", reason, said) is not False:
            done.held.append(describe("Pod", namespace, name))
            self.api.post_event(_ref(pod), reason, said, warning=True, key=f"{uid}/{reason}")
            owner = top_owner(read, namespace, meta(pod).get("ownerReferences"))
            if owner is not None:
                self.api.post_event(
                    owner,
                    reason,
                    f"pod {name}: {said}",
                    warning=True,
                    key=f"{owner.uid or owner.name}/{reason}/{message[:200]}",
                )

    def _ungate(self, pod: Json, done: Pass, since: float) -> bool:
        """Remove the gate, as decided from a list begun at ``since``: not when this
        process has decided the pod from a newer list (an answer run that held it while
        an older pass found its preflight overdue), and never beside a condition write
        in flight (claimed as _condition claims)."""
        namespace, name, uid = _name(pod)
        ops = pod[UNGATE]  # a slim copy's (_slim): every pod a pass decides is one
        if not ops:
            return False
        with self._writing:
            self._writing.wait_for(lambda: not self._in_flight(uid))
            prior = self._written.get(uid)
            if prior is not None and prior.since > since:
                return False
            claim = self._written[uid] = _Written(("", "ungating", ""), since, None)
        try:
            self.api.patch_pod(namespace, name, ops)
        except Conflict:
            return False  # changed since listed (or ungated by the other replica): next pass
        except Refused as exc:
            # An admission policy of the namespace's refuses the change: say so, once.
            said = f"epguard could not remove its scheduling gate {GATE}: {exc}"
            self.api.post_event(_ref(pod), "PreflightGateStuck", said, warning=True,
                                key=f"{uid}/stuck")  # fmt: skip
            return False
        finally:
            self._give_back(uid, claim, prior)  # the condition written next is the record
        done.ungated.append(describe("Pod", namespace, name))
        return True

    def _condition(
        self, since: float, pod: Json, status: str, reason: str, message: str
    ) -> bool | None:
        """Set the pod's epguard condition, as decided from a list begun at ``since``
        (time.monotonic): True when written; None when the API server refused or failed
        the write (logged; an error that is not the API server's is raised); False when
        there was nothing to write: the pod already says this (as listed), or this
        process wrote its condition from a newer list, or wrote this very condition after
        ``since`` (so the list may not show it), or the pod is gone or replaced."""
        namespace, name, uid = _name(pod)
        message = message[:1024]
        said = (status, reason, message)
        for c in as_list(as_map(pod.get("status")).get("conditions")):
            c = as_map(c)
            if (
                c.get("type") == CONDITION
                and (c.get("status"), c.get("reason"), c.get("message")) == said
            ):
                return False
        with self._writing:  # claimed before the write: of two racing decisions, one writes
            # A write in flight is waited for: its thread holds no lock while it makes
            # its request, which ends or fails (the client's timeouts and retries).
            self._writing.wait_for(lambda: not self._in_flight(uid))
            prior = self._written.get(uid)
            if prior is not None and (
                prior.finished is None
                or prior.since > since
                or (prior.said == said and prior.finished >= since)
            ):
                return False
            claim = self._written[uid] = _Written(said, since, None)
        condition = {
            "type": CONDITION,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": self.clock().strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        try:
            self.api.set_condition(namespace, name, uid, condition)
        except BaseException as exc:
            self._give_back(uid, claim, prior)  # not written: the next decision writes it
            if not isinstance(exc, ApiException):
                raise
            if failed_write(exc) is Conflict:
                # The same write again cannot succeed, so no retry (a tenant deleting pods
                # as their gates came off held a decide worker 1.5 s each: review
                # helper). A refusal is the API server's answer, reported below.
                log.info("%s not set on pod %s/%s: %s", CONDITION, namespace, name, exc.reason)
                return False
            log.warning("could not set %s on pod %s/%s: %s", CONDITION, namespace, name, exc)
            return None
        with self._writing:
            if self._written.get(uid) is claim:
                self._written[uid] = _Written(said, since, time.monotonic())
            self._writing.notify_all()
        return True

    def _give_back(self, uid: str, claim: _Written, prior: _Written | None) -> None:
        """Undo a claim on the pod's record (what was there before it comes back), if no
        other decision has replaced it since, and wake whoever waits on it."""
        with self._writing:
            if self._written.get(uid) is claim:
                if prior is None:
                    del self._written[uid]
                else:
                    self._written[uid] = prior
            self._writing.notify_all()

    def _in_flight(self, uid: str) -> bool:
        written = self._written.get(uid)
        return written is not None and written.finished is None

    def _clean(
        self,
        preflights: Mapping[tuple[str, str], Json],
        wanted: set[str],
        now: dt.datetime,
        done: Pass,
    ) -> None:
        kept: Counter[str] = Counter()
        newest_first = sorted(
            preflights.items(),
            key=lambda item: created_at(item[1]) or dt.datetime.min.replace(tzinfo=dt.UTC),
            reverse=True,
        )
        for (namespace, name), pod in newest_first:
            if meta(pod).get("deletionTimestamp"):
                # Deleted already: a delete each pass would not end it sooner (a
                # finalizer holds it; the preflight-labels policy lets no one but the
                # controller add one) and took the pass's time, one call at a time.
                continue
            key = str(as_map(meta(pod).get("labels")).get(KEY_LABEL) or "")
            result = preflight_result(pod, now, self.config.settings.timeout_seconds)
            created = created_at(pod)
            age = (now - created).total_seconds() if created else float("inf")
            old = age > self.config.retain_seconds
            if key not in wanted and result.phase != "running" and not old:
                kept[namespace] += 1
                old = kept[namespace] > RETAINED_PER_NAMESPACE
            if key in wanted:
                # Waited on: kept, but made again once its answer is older than the
                # retention, and never sooner than a preflight's deadline after it (a
                # retention shorter than a preflight's run would remake it without end):
                # a tag pushed again with the fix is judged again, and a failed one is
                # retried (under onError=hold its pods would wait on it forever). Pods
                # held for an image cause stay held while it runs.
                answered = _answered_at(pod) or created
                since = (now - answered).total_seconds() if answered else float("inf")
                settings = self.config.settings
                if not (
                    result.phase != "running"
                    and since > max(self.config.retain_seconds, settings.timeout_seconds)
                ):
                    continue
            # Nobody waits: a running one is not needed; a finished one is kept to answer
            # for its image until it is older than the retention.
            elif not (result.phase == "running" or old):
                continue
            self._delete(namespace, name, str(meta(pod).get("uid") or ""), done)

    def _delete(self, namespace: str, name: str, uid: str, done: Pass) -> None:
        try:
            self.api.delete_pod(namespace, name, uid)
        except Exception:
            log.exception("preflight: could not delete %s", describe("Pod", namespace, name))
            return
        done.deleted.append(describe("Pod", namespace, name))


# -- kopf wiring -------------------------------------------------------------------------

NAME = "preflight"


def _across_namespaces(
    items: list[tuple[PreflightKey, Json]],
) -> list[tuple[PreflightKey, Json]]:
    """``items`` with each namespace's first before any namespace's second (and so on),
    else in their order: a pass's share of creates is spread over the namespaces."""
    seen: Counter[str] = Counter()
    ranked = []
    for i, (key, _) in enumerate(items):
        ranked.append((seen[key.namespace], i))
        seen[key.namespace] += 1
    return [items[i] for _, i in sorted(ranked)]


class _Keys:
    """The probe-signing keys the probe_key module keeps in the memo."""

    def __init__(self, memo: kopf.Memo) -> None:
        self.memo = memo

    def refresh(self) -> Keyring | None:
        manager = self.memo.get("probe_keys")
        if manager is None:
            return None
        ring: Keyring | None = manager.holder.ring or manager.refresh()
        return ring

    def reread(self) -> Keyring | None:
        manager = self.memo.get("probe_keys")
        return None if manager is None else cast(Keyring | None, manager.refresh())

    def held(self) -> Keyring | None:
        """The keys held now, without reading the Secret (for kopf's event loop)."""
        manager = self.memo.get("probe_keys")
        return None if manager is None else cast(Keyring | None, manager.holder.ring)


class _Wake(asyncio.Event):
    """The pass loop's wake-up: set by a pod event; ``at`` is when the first event since
    the last pass set it (the loop's clock), so the log says how long a change waited."""

    def __init__(self) -> None:
        super().__init__()
        self.at: float | None = None

    def set(self) -> None:
        if self.at is None:
            self.at = asyncio.get_running_loop().time()
        super().set()

    def clear(self) -> None:
        self.at = None
        super().clear()


class Answers:
    """The namespaces whose preflights have answered since the answer loop last looked.

    A pod event's body says at once that a preflight ended; a pass would decide its pods
    only after the pass under way and its own list of every gated pod (the gates' "within
    10 s of the preflight's end": 200 gated pods on the loaded 2-core node took up to
    8.9 s from the API server showing the end to the last gate decided). Only a
    preflight whose signature verifies with the keys the controller holds counts: a
    tenant's pod labelled as one is no answer, and wakes only the passes, as before. The
    set holds namespace names: bounded by the cluster's namespaces.

    Each preflight is noted once, at its first event with an answer: the kubelet's later
    reports (its last container, its phase) and any change a tenant makes to its own
    preflight's labels say nothing new, and must not keep its namespace in every run
    (each run lists it, in one of the two list slots the passes share). The uids noted
    are kept up to NOTED, the oldest forgotten first."""

    def __init__(self, ring: Callable[[], Keyring | None], timeout_seconds: int) -> None:
        self.ring = ring  # the keys held now (no API call: this runs in kopf's event loop)
        self.timeout_seconds = timeout_seconds
        self.namespaces: set[str] = set()
        self.wake = _Wake()
        self._noted: dict[str, None] = {}  # insertion-ordered: the oldest first

    def note(self, body: Mapping[str, Any], now: dt.datetime) -> bool:
        """Whether ``body`` is epguard's preflight with an answer; its namespace is then
        kept and the loop woken."""
        pod = as_mapping(body)
        if as_map(meta(pod).get("labels")).get(PREFLIGHT_LABEL) != "true":
            return False
        namespace, _, uid = _name(pod)
        if uid in self._noted:
            return True  # answered before: its pods were decided then
        if preflight_result(pod, now, self.timeout_seconds).phase == "running":
            return False
        if not _made_by_epguard(pod, self.ring()):
            return False
        if len(self._noted) >= NOTED:
            del self._noted[next(iter(self._noted))]
        self._noted[uid] = None
        self.namespaces.add(namespace)
        self.wake.set()
        return True

    def take(self) -> list[str]:
        taken = sorted(self.namespaces)
        self.namespaces.clear()
        self.wake.clear()
        return taken


def _log_pass(done: Pass, took: float, woken: str, run: str = "a pass") -> None:
    for what, names in (
        ("created", done.created),
        ("ungated", done.ungated),
        ("held", done.held),
        ("deleted", done.deleted),
    ):
        if names:
            log.info(
                "preflight %s (%s of %.2f s: %d pods listed in %.2f s, the "
                "answered decided in %.2f s, the rest %.2f s; after %s%s): %s",
                what,
                run,
                took,
                done.pods,
                done.listed,
                done.answered,
                done.rest,
                woken,
                f"; {done.deferred} preflights left to the next pass" if done.deferred else "",
                ", ".join(names[:20]),
            )


async def _loop(memo: kopf.Memo, preflights: Preflights, stop: asyncio.Event) -> None:
    wake: _Wake = memo[f"{NAME}_wake"]
    # Passes run on the replica kopf keeps active; the other asks again each round.
    leadership: Leadership = memo.get("leadership") or STANDALONE
    loop = asyncio.get_running_loop()
    woken = "start"
    while not stop.is_set():
        started, event_at = loop.time(), wake.at
        wake.clear()
        if event_at is not None:
            woken = f"a pod event {started - event_at:.2f} s before"
        rerun = False
        try:
            if await loop.run_in_executor(None, leadership.leads):
                done = await loop.run_in_executor(None, preflights.run_once)
                _log_pass(done, loop.time() - started, woken)
                # The creates it left, at once, while creates go through (else the timer).
                rerun = bool(done.deferred and done.created)
        except Exception:
            log.exception("preflight pass failed; retrying")
        if rerun:
            woken = "the creates the last pass left"
            continue
        await _until(stop, wake, INTERVAL_SECONDS)
        woken = "the timer"


async def _until(stop: asyncio.Event, wake: asyncio.Event, timeout: float | None) -> None:
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
    await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()


async def _answer_loop(preflights: Preflights, answers: Answers, stop: asyncio.Event) -> None:
    """Each answered namespace's waiting pods decided as soon as the answer is seen, in
    a run of its own: ANSWER_LISTS namespaces at a time, beside the passes, so that a
    namespace whose list is slow (many or large gated pods) delays no other namespace's
    answer, in this run or the next. One run per namespace at a time: a namespace noted
    again meanwhile runs again after it. A run that fails leaves its pods to the next
    pass. No leadership check: the answers come from kopf's watch, which kopf peering
    pauses on every replica but the one it keeps active."""
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(ANSWER_LISTS)
    running: set[str] = set()  # bounded by the cluster's namespaces
    tasks: set[asyncio.Task[None]] = set()

    async def run(namespace: str, noted: float | None) -> None:
        try:
            async with slots:
                if stop.is_set():  # stopping: the next start's first pass decides them
                    return
                started = loop.time()
                done = await loop.run_in_executor(None, preflights.answer, [namespace])
                woken = f"a preflight answered in {namespace}"
                if noted is not None:
                    woken += f" {started - noted:.2f} s before"
                _log_pass(done, loop.time() - started, woken, run="an answer run")
        except Exception:
            log.exception("preflight answer run in %s failed; the passes decide", namespace)
        finally:
            running.discard(namespace)
            if namespace in answers.namespaces:  # noted again while it ran
                answers.wake.set()

    while not stop.is_set():
        await _until(stop, answers.wake, None)
        noted = answers.wake.at
        if stop.is_set():
            break
        for namespace in answers.take():
            if namespace in running:
                answers.namespaces.add(namespace)  # after the run under way
                continue
            running.add(namespace)
            task = asyncio.create_task(run(namespace, noted))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks, return_exceptions=True)


@kopf.on.startup(id="epguard-preflight-start")
async def _start(memo: kopf.Memo, **_: Any) -> None:
    config: ControllerConfig = memo["config"]
    keys = _Keys(memo)
    preflights = Preflights(KubePreflightApi(memo["api"]), PreflightConfig.of(config), keys)
    answers = Answers(keys.held, config.preflight_timeout_seconds)
    memo[f"{NAME}_wake"] = _Wake()
    memo[f"{NAME}_answers"] = answers
    background.start(memo, NAME, lambda stop: _loop(memo, preflights, stop))
    background.start(memo, f"{NAME}_answers", lambda stop: _answer_loop(preflights, answers, stop))


@kopf.on.cleanup(id="epguard-preflight-stop")
async def _stop(memo: kopf.Memo, **_: Any) -> None:
    await background.stop(memo, f"{NAME}_answers")
    await background.stop(memo, NAME)


def worth_a_pass(body: Any, **_: Any) -> bool:
    """kopf filter: a preflight pod or a gated pod changed (else every pass would wait
    for the timer)."""
    pod = as_mapping(body)
    labels = as_map(as_map(pod.get("metadata")).get("labels"))
    return labels.get(PREFLIGHT_LABEL) == "true" or is_gated(pod)


@kopf.on.event(
    "", "v1", "pods", labels={PROBED_LABEL: "true"}, when=worth_a_pass, id="epguard-preflight"
)
async def _pod_event(memo: kopf.Memo, body: kopf.Body, type: str | None, **_: Any) -> None:
    answers: Answers | None = memo.get(f"{NAME}_answers")
    # A change only: kopf's (re)list at start, and on each resume, hands every retained
    # finished preflight over again (type None), whose pods the first pass decides.
    if answers is not None and type in ("ADDED", "MODIFIED"):
        try:
            if answers.note(body, dt.datetime.now(dt.UTC)):
                return  # its pods are decided by the answer loop, not a whole pass
        except Exception:  # a body note cannot read: the pass decides, as before
            log.exception("preflight: could not read the pod event")
    wake: _Wake | None = memo.get(f"{NAME}_wake")
    if wake is not None:
        wake.set()
