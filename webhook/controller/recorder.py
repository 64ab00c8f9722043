"""Turn probe outcomes in pod status into ImageVerdicts, and post Events where people look.

A pod made by a Deployment or a LeaderWorkerSet is not where anyone looks when it
fails, so every outcome is posted as an Event on the pod *and* on its top owner
(following controller ownerReferences: Pod → ReplicaSet → Deployment, Pod →
StatefulSet → LeaderWorkerSet, …).

Pod events are re-delivered (every status change, every operator restart), so each
termination is recorded once without writing to anyone's pod (the controller has no
right to patch pods): the ImageVerdict remembers the runs it counted (``spec.runs``),
so its count is the number of probe runs that saw the image, not of watch events; each
Event's name is derived from the run, so posting it again is a 409, not a duplicate.

Only the active peer handles events (kopf peering pauses the others), so two
replicas do not double-count; the ImageVerdict write still carries the
resourceVersion it read, so a race ends in a 409 and a re-read, not a lost update.

Every API call goes through :class:`RecorderApi` (the real one is
:class:`KubeRecorderApi`, on the official client), so the recording itself can be tested
against an in-memory API with the API server's conflict semantics
(tests/controller/test_recorder.py).
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.webhook.cluster.kube import (
    REQUEST_TIMEOUT,
    Json,
    get_verdict,
    list_pages,
)
from epguard.webhook.controller.architectures import KubeNodes, Nodes, Placement, placement
from epguard.webhook.controller.config import ControllerConfig
from epguard.webhook.controller.owners import COMPONENT, KubeObjects, top_owner
from epguard.webhook.engine.imageref import ImageRefError, parse
from epguard.webhook.engine.outcome import (
    CLOCK_SKEW,
    PROBED_LABEL,
    ProbeOutcome,
    Resolution,
    is_probe,
    outcomes_of,
    recorded_runs,
    resolved_tags,
    run_key,
    verdict_spec,
)
from epguard.webhook.engine.signing import (
    FRESH_SECONDS,
    SIGNATURE_ANNOTATION,
    Keyring,
    KeyringHolder,
    SignatureLedger,
    Verification,
    created_at,
    fresh,
    verify,
)
from epguard.webhook.engine.text import first_line
from epguard.webhook.engine.verdicts import (
    GROUP,
    PLURAL,
    TAUGHT_BY_LABEL,
    VERSION,
    ImageVerdictObject,
    ImageVerdictSpec,
    verdict_name,
    verdict_object,
)
from epguard.webhook.engine.workloads import as_list, as_map, as_mapping

log = logging.getLogger("epguard.controller.recorder")

WRITE_ATTEMPTS = 5
CONFLICT_BACKOFF = 0.05  # seconds: up to 0.1, 0.2, 0.4, 0.8 before attempts 2 to 5
# A namespace's count of the verdicts its probes taught is read again after this long
# (an admin deleted some, or the other replica created some before a failover).
RECOUNT_SECONDS = 300.0
# A tag resolved to a digest by a pull with imagePullPolicy Always (a preflight, mostly)
# lets a run of those same bytes in the same namespace that did not resolve it (the gated
# worker, pulling IfNotPresent once its gate is off) answer for the tag, for this long
# after the kubelet started the resolving container: the time from a preflight to its
# workers' probes (a schedule, a pull), not the tag TTL. Held in memory, the newest per
# (namespace, tag): after a restart, the next gated pod's preflight resolves it again.
# A pod kept from before the tag moved resolves nothing: its container started too long
# ago, however often the controller sees it again.
RESOLVED_FOR = dt.timedelta(hours=1)
MAX_RESOLVED_PER_NAMESPACE = 256  # one namespace's pulls never evict another's
# Per pod (kopf's memo of that object): the runs and resolutions already considered, so
# re-delivered events skip the API entirely. Kept while the pod still shows them, never
# evicted by count: a pod of 300 probe containers would otherwise have old runs come back
# as new at each event a tenant causes, each a verdict write that renews an old verdict.
SEEN_KEY = "epguard_recorder_seen"
# The newest pull per tag in the whole cluster, beside each namespace's: a pull anywhere
# that found other bytes cancels a namespace's older resolution (the tag moved).
MAX_RESOLVED_TAGS = 10_000  # past it, the namespace holding the most gives one up


class KeySource(Protocol):
    """The probe-signing keys held (probe_key.ProbeKeyManager; the recorder needs no more)."""

    holder: KeyringHolder

    def refresh(self) -> Keyring | None: ...


def has_probe(body: Any, **_: Any) -> bool:
    """kopf filter: only pods that carry the probe init container are worth a look."""
    spec = as_map(as_mapping(body).get("spec"))
    return any(isinstance(c, Mapping) and is_probe(c) for c in as_list(spec.get("initContainers")))


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Conflict(Exception):
    """A write lost a race (HTTP 409: the object exists, or changed since it was read):
    re-read and decide again."""


class OverBudget(Exception):
    """The namespace's probes have taught ``controller.verdictsPerNamespace`` verdicts:
    this one, about an image no verdict names yet, is not created."""

    def __init__(self, namespace: str, taught: int) -> None:
        super().__init__(f"namespace {namespace} has taught {taught} ImageVerdicts")
        self.namespace = namespace
        self.taught = taught


class RecorderApi(Nodes, Protocol):
    """The API calls recording needs, the node reads of :func:`placement` among them. The
    real one is :class:`KubeRecorderApi`; the tests use an in-memory one with the same
    conflict semantics."""

    def read_verdict(self, name: str) -> dict[str, Any] | None:
        """The ImageVerdict ``name`` as raw JSON (with its resourceVersion), None when
        there is none."""

    def create_verdict(self, body: ImageVerdictObject) -> None:
        """Create; Conflict when it exists already."""

    def replace_verdict(self, name: str, body: ImageVerdictObject) -> None:
        """Replace at the resourceVersion ``body`` carries; Conflict when it changed."""

    def count_taught(self, namespace: str, up_to: int) -> int:
        """How many ImageVerdicts the probes of ``namespace`` created (their
        ``epguard.io/taught-by`` label); the count may stop anywhere past ``up_to``."""

    def read_object(self, path: str) -> Json:
        """Any object by REST path (an owner of a kind the typed APIs do not know);
        Unreadable when the API server refuses it."""

    def post_event(
        self,
        about: client.V1ObjectReference,
        reason: str,
        message: str,
        *,
        warning: bool,
        key: str,
    ) -> bool:
        """Post one Event named by (``about``, ``key``): the same key again is the same
        Event (a 409, which counts as posted). False when it could not be posted."""


class KubeRecorderApi(KubeObjects):
    """:class:`RecorderApi` on the official client (blocking calls: kopf runs the handler
    in its executor)."""

    def __init__(self, api: client.ApiClient) -> None:
        super().__init__(api)
        self.custom = client.CustomObjectsApi(api)
        self.nodes = KubeNodes(api)

    def architecture_of(self, node: str) -> str | None:
        return self.nodes.architecture_of(node)

    def other_than(self, architecture: str | None) -> tuple[str, str] | None:
        return self.nodes.other_than(architecture)

    def read_verdict(self, name: str) -> dict[str, Any] | None:
        return get_verdict(self.custom, name)

    def create_verdict(self, body: ImageVerdictObject) -> None:
        try:
            self.custom.create_cluster_custom_object(
                GROUP, VERSION, PLURAL, dict(body), _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(str(exc.reason)) from exc
            raise

    def replace_verdict(self, name: str, body: ImageVerdictObject) -> None:
        try:
            self.custom.replace_cluster_custom_object(
                GROUP, VERSION, PLURAL, name, dict(body), _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(str(exc.reason)) from exc
            raise

    def count_taught(self, namespace: str, up_to: int) -> int:
        counted = 0
        for page, _ in list_pages(
            self.custom.list_cluster_custom_object,
            GROUP,
            VERSION,
            PLURAL,
            label_selector=f"{TAUGHT_BY_LABEL}={namespace}",
        ):
            counted += len(page)
            if counted > up_to:
                break
        return counted


class Recorder:
    """The API side of recording: ImageVerdict upserts, Events, owner lookups, through a
    :class:`RecorderApi`; and the runs this process recorded already."""

    def __init__(
        self,
        api: RecorderApi,
        clock: Callable[[], dt.datetime] = _now,
        per_namespace: int = 1000,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.api = api
        self.clock = clock
        self.per_namespace = per_namespace
        self.monotonic = monotonic
        self.sleep = sleep  # between write attempts (kopf runs this handler on a thread)
        # namespace -> (verdicts its probes taught, when that was counted); kopf runs
        # handlers on several threads, so a slot is reserved under the lock.
        self.taught: dict[str, tuple[int, float]] = {}
        self._taught_lock = threading.Lock()
        # One count at a time per namespace, and none under _taught_lock (_reserve).
        self._counting: dict[str, threading.Lock] = {}
        # namespace -> name:tag -> (digest, when the resolving container started).
        self.resolved: dict[str, OrderedDict[str, tuple[str, dt.datetime]]] = {}
        self.newest: OrderedDict[str, tuple[str, dt.datetime]] = OrderedDict()  # any namespace
        # Which namespace's pull each entry of ``newest`` is, and each namespace's entries
        # oldest first: past MAX_RESOLVED_TAGS the namespace holding the most gives one up,
        # so one namespace's flood of tags never evicts another's (which then learned by
        # digest only: its next pods were gated again).
        self._newest_by: dict[str, str] = {}
        self._newest_of: dict[str, OrderedDict[str, None]] = {}
        self._resolved_lock = threading.Lock()

    def note_resolved(self, namespace: str, found: Resolution) -> None:
        """Keep what a pull found, if it is recent and newer than what is held. A start
        time more than CLOCK_SKEW ahead of this clock (a node's fast clock) only cancels,
        dated now: re-read after a restart, it would otherwise be dated now again and
        outrank a real, newer pull."""
        now = self.clock()
        ahead = found.started_at > now + CLOCK_SKEW
        at = min(found.started_at, now)
        if now - at > RESOLVED_FOR:
            return
        with self._resolved_lock:
            held = self.newest.get(found.tag)
            if held is None or held[1] < at:
                self._newest_put(namespace, found.tag, (found.digest, at))
            if ahead:
                return
            tags = self.resolved.setdefault(namespace, OrderedDict())
            while tags and now - next(iter(tags.values()))[1] > RESOLVED_FOR:
                tags.popitem(last=False)  # expired, oldest first
            held = tags.get(found.tag)
            if held is not None and held[1] >= at:
                return
            tags[found.tag] = (found.digest, at)
            tags.move_to_end(found.tag)
            while len(tags) > MAX_RESOLVED_PER_NAMESPACE:
                tags.popitem(last=False)

    def _newest_put(self, namespace: str, tag: str, value: tuple[str, dt.datetime]) -> None:
        """``newest[tag] = value``, as ``namespace``'s pull (under _resolved_lock). A newer
        pull of the same bytes keeps the entry with the namespace that made it: else one
        could take another's entry by pulling its public tag, then evict it with its own."""
        held = self.newest.get(tag)
        if held is not None and held[0] == value[0]:
            self.newest[tag] = value
            return
        self._newest_drop(tag)
        self.newest[tag] = value
        self._newest_by[tag] = namespace
        self._newest_of.setdefault(namespace, OrderedDict())[tag] = None
        while len(self.newest) > MAX_RESOLVED_TAGS:
            heaviest = max(self._newest_of.values(), key=len)
            self._newest_drop(next(iter(heaviest)))

    def _newest_drop(self, tag: str) -> None:
        self.newest.pop(tag, None)
        owner = self._newest_by.pop(tag, None)
        if owner is not None:
            owned = self._newest_of[owner]
            owned.pop(tag, None)
            if not owned:
                del self._newest_of[owner]

    def answers_for(self, outcome: ProbeOutcome, namespace: str) -> str:
        """The reference ``outcome``'s verdict answers for: its tag when its own pull
        resolved the tag, or when the newest pull in ``namespace`` that resolved it found
        these bytes within RESOLVED_FOR; else its digest alone
        (``ProbeOutcome.verdict_image``). Worked out once per run: the verdict and the
        Event say the same."""
        own = outcome.verdict_image
        if own == outcome.image or outcome.digest is None:
            return own
        try:
            tag = parse(outcome.image).name_tag
        except ImageRefError:
            return own
        with self._resolved_lock:
            tags = self.resolved.get(namespace)
            held = tags.get(tag) if tags is not None else None
            anywhere = self.newest.get(tag)
        if held is None or held[0] != outcome.digest:
            return own
        if anywhere is None or anywhere[0] != outcome.digest:
            # A newer pull, in any namespace, found other bytes (the tag moved), or the
            # cluster-wide entry was evicted: unknown, so the digest alone.
            return own
        return outcome.image if self.clock() - held[1] <= RESOLVED_FOR else own

    def _reserve(self, namespace: str) -> None:
        """Count one more verdict taught by ``namespace``; OverBudget when it has taught
        its share already. The count is read from the API server (when none is held, or
        it is older than RECOUNT_SECONDS) under a lock of that namespace's own, never
        under the lock every namespace's first verdict takes (a paged list of up to
        ``per_namespace`` verdicts held them all while it ran), and once: a thread that
        waited for another's count uses it (two counts replacing each other lost a
        reservation made in between). Found by review helpers."""
        with self._taught_lock:
            counting = self._counting.setdefault(namespace, threading.Lock())
        with counting:
            now = self.monotonic()
            with self._taught_lock:
                held = self.taught.get(namespace)
                stale = held is None or now - held[1] > RECOUNT_SECONDS
            if stale:
                counted = self.api.count_taught(namespace, self.per_namespace)
                with self._taught_lock:
                    self.taught[namespace] = (counted, now)
        with self._taught_lock:
            count, at = self.taught[namespace]
            if count >= self.per_namespace:
                raise OverBudget(namespace, count)
            self.taught[namespace] = (count + 1, at)

    def _release(self, namespace: str) -> None:
        """A reserved verdict that was not created after all."""
        with self._taught_lock:
            count, at = self.taught[namespace]
            self.taught[namespace] = (max(0, count - 1), at)

    def upsert_verdict(
        self,
        outcome: ProbeOutcome,
        pod: str,
        run: str,
        architecture: str | None = None,
        image: str | None = None,
        created: dt.datetime | None = None,
    ) -> ImageVerdictSpec | None:
        """Count this run on the image's ImageVerdict; None when it was counted already.
        OverBudget when it would be a new verdict and the pod's namespace has taught its
        share (``per_namespace``) already. ``architecture``: its node's; ``image``: the
        reference it answers for (``answers_for``); ``created``: the pod's creation
        (``verdict_spec``)."""
        namespace = pod.partition("/")[0]
        image = image or self.answers_for(outcome, namespace)
        name = verdict_name(image, outcome.digest)
        for attempt in range(WRITE_ATTEMPTS):
            if attempt:
                # Lost a race: the writers of one verdict (runs of pods in any namespace on
                # one image, handled on kopf's threads side by side) read again at random
                # times, so they do not collide again in step. kopf drops an on.event
                # handler's TemporaryError (no retry): the run waits for its pod's next
                # event, which for a finished preflight may be its deletion.
                self.sleep(random.uniform(0, CONFLICT_BACKOFF * 2**attempt))
            existing = self.api.read_verdict(name)
            previous = existing.get("spec") if existing else None
            if run in recorded_runs(previous):
                return None
            spec = verdict_spec(
                outcome, pod, self.clock(), previous, run, architecture, image, created
            )
            body = verdict_object(name, spec, COMPONENT, existing, taught_by=namespace)
            if existing is None:
                self._reserve(namespace)
                try:
                    self.api.create_verdict(body)
                except BaseException as exc:
                    self._release(namespace)
                    if isinstance(exc, Conflict):  # lost a race: read again
                        continue
                    raise
                return spec
            try:
                self.api.replace_verdict(name, body)
            except Conflict:  # lost a race (stale resourceVersion)
                continue
            return spec
        raise kopf.TemporaryError(f"ImageVerdict {name}: too many write conflicts", delay=5)

    def top_owner(self, namespace: str, refs: Any) -> client.V1ObjectReference | None:
        """Follow controller ownerReferences up; None when the pod has no owner."""
        return top_owner(self.api.read_object, namespace, refs)

    def post_event(
        self, about: client.V1ObjectReference, outcome: ProbeOutcome, message: str, run: str
    ) -> None:
        usable = outcome.verdict == "Usable"
        if usable:
            reason = "MooncakeProbePassed"
        elif outcome.scope == "environment":
            reason = "MooncakeProbeFailedInPod"  # fix the pod spec or the node
        else:
            reason = "MooncakeProbeFailed"
        # One name per (object, run): posting the same outcome again is a 409. An Event
        # is a courtesy: failing to post one must not stop the verdict.
        if not self.api.post_event(about, reason, message, warning=not usable, key=run):
            log.warning("could not post event on %s/%s", about.kind, about.name)

    def post_over_budget(
        self, about: client.V1ObjectReference, spent: OverBudget, outcome: ProbeOutcome, run: str
    ) -> None:
        message = (
            f"epguard learns no new image from namespace {spent.namespace}: its probes have "
            f"taught {spent.taught} ImageVerdicts, its share (controller.verdictsPerNamespace "
            f"{self.per_namespace}), so {outcome.image} is not recorded; the probe still "
            "stopped this pod. An admin can delete verdicts this namespace no longer needs "
            "(kubectl get imageverdicts -l epguard.io/taught-by=<namespace>) or raise the share"
        )
        if not self.api.post_event(
            about, "EpguardVerdictBudgetSpent", message, warning=True, key=f"{run}/budget"
        ):
            log.warning("could not post event on %s/%s", about.kind, about.name)

    def post_not_learned(
        self, about: client.V1ObjectReference, outcome: ProbeOutcome, why: str, run: str
    ) -> None:
        message = (
            f"epguard learns no verdict for {outcome.image} from this probe: {why}. The "
            "probe still stopped this pod; the image stays unjudged for other pods"
        )
        if not self.api.post_event(
            about, "EpguardVerdictNotLearned", message, warning=True, key=f"{run}/placement"
        ):
            log.warning("could not post event on %s/%s", about.kind, about.name)

    def post_untrusted(self, about: client.V1ObjectReference, reason: str, uid: str) -> None:
        """Once per pod: why nothing is learned from it."""
        message = (
            f"epguard learns nothing from this pod's probe: {reason}. Only a probe that "
            "epguard injected and signed, unchanged since, is evidence about an image"
        )
        if not self.api.post_event(
            about, "EpguardProbeNotTrusted", message, warning=True, key=f"{uid}/untrusted"
        ):
            log.warning("could not post event on pod %s", about.name)


def _message(outcome: ProbeOutcome, pod: str, answers_for: str) -> str:
    # The probe's own first line (verdict and cause), where the ImageVerdict keeps only
    # the cause: an Event is read alone, in `kubectl describe`.
    line = first_line(outcome.report) or outcome.reason
    said = (
        f"epguard probe in pod {pod} (container {outcome.container}, image {outcome.image}): {line}"
    )
    if outcome.about_the_image and answers_for != outcome.image:
        said += (
            f" (learned for {outcome.digest} only: with imagePullPolicy "
            f"{outcome.pull_policy or 'unset'} the node's copy of the tag may be an older build)"
        )
    return said


def record_probe_outcomes(body: Mapping[str, Any], memo: kopf.Memo, **_: Any) -> None:
    """Record every new probe termination of one pod.

    A plain function: kopf runs it in its executor, so the blocking client calls never
    stall the operator's event loop. Returns nothing on purpose: kopf stores a handler's
    return value in the object's status, and a pod's status belongs to the kubelet."""
    pod_meta = as_map(body.get("metadata"))
    namespace, name = pod_meta.get("namespace"), pod_meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str):
        return
    uid = pod_meta.get("uid")
    if not isinstance(uid, str) or not uid:
        return
    config: ControllerConfig | None = memo.get("config")
    probe_image = config.probe_image if config is not None else None
    # One of each per process (start_recording): made here, they would be this pod's.
    recorder: Recorder = memo["recorder"]
    ledger: SignatureLedger = memo["signatures"]
    runs = [(o, run_key(uid, o)) for o in outcomes_of(body, probe_image)]
    # Each pod's resolutions are considered once, like its runs: a pod that is no evidence
    # would otherwise be verified again (a Secret read for a key it names) at each event.
    pulls = [
        (found, f"{uid}/resolved/{found.digest}/{found.tag}/{found.started_at.isoformat()}")
        for found in resolved_tags(body, probe_image)
    ]
    seen = remembered(memo, {key for _, key in runs} | {key for _, key in pulls})
    fresh = [(o, run) for o, run in runs if run not in seen]
    resolved = [(found, key) for found, key in pulls if key not in seen]
    if not fresh and not resolved:
        return
    pod_ref = client.V1ObjectReference(
        api_version="v1",
        kind="Pod",
        name=name,
        namespace=namespace,
        uid=uid,
    )
    checked = _verified(body, namespace, memo.get("probe_keys"), ledger)
    for found, key in resolved:
        seen.add(key)
        if checked.ok:
            recorder.note_resolved(namespace, found)
    if not fresh:
        return
    if not checked.ok:
        # Anyone who can create a pod can write a "probe" that prints any verdict: only
        # what epguard injected and signed, unchanged since, is evidence.
        log.warning("not learned from pod %s/%s: %s", namespace, name, checked.reason)
        recorder.post_untrusted(pod_ref, checked.reason, uid)
        for _outcome, run in fresh:
            seen.add(run)
        return
    owner = recorder.top_owner(namespace, pod_meta.get("ownerReferences"))
    pod = f"{namespace}/{name}"
    where: Placement | None = None
    for outcome, run in fresh:
        answer = recorder.answers_for(outcome, namespace)
        message = _message(outcome, pod, answer)
        if not outcome.about_the_image:
            # A cause in this pod or its node (or no digest to pin it to) must not refuse
            # anyone else's pods: it is told where people look, and nothing is learned.
            log.info(
                "not learned (%s) from pod %s: %s",
                "no image digest" if outcome.digest is None else "environment cause",
                pod,
                outcome.reason[:200],
            )
        else:
            if where is None:
                node = as_map(body.get("spec")).get("nodeName")
                declared = config.architectures if config is not None else ()
                where = placement(recorder.api, node if isinstance(node, str) else None, declared)
            if where.refusal is not None:
                # Another architecture's files may differ under the same digest.
                log.warning("not learned from pod %s: %s", pod, where.refusal)
                for about in (pod_ref, owner):
                    if about is not None:
                        recorder.post_not_learned(about, outcome, where.refusal, run)
            else:
                try:
                    written = recorder.upsert_verdict(
                        outcome, pod, run, where.architecture, answer, created_at(body)
                    )
                    if written is not None:
                        log.info(
                            "recorded %s for %s from pod %s (the verdict: %s, of pod %s, "
                            "last seen %s)",
                            outcome.verdict,
                            answer,
                            pod,
                            written["verdict"],
                            written.get("pod", ""),
                            written["lastSeen"],
                        )
                except OverBudget as spent:
                    log.warning("not learned from pod %s: %s", pod, spent)
                    recorder.post_over_budget(pod_ref, spent, outcome, run)
        recorder.post_event(pod_ref, outcome, message, run)
        if owner is not None:
            recorder.post_event(owner, outcome, message, run)
        seen.add(run)


def remembered(memo: kopf.Memo, shown: set[str]) -> set[str]:
    """This pod's runs and resolutions considered already, of those it still ``shown``.
    In kopf's memo of this one object (a copy of the operator's, made when the object is
    first seen, dropped when it is deleted): no pod's churn evicts another's, and what a
    pod no longer shows cannot come back."""
    seen: set[str] | None = memo.get(SEEN_KEY)
    if seen is None:
        seen = memo[SEEN_KEY] = set()
    seen &= shown
    return seen


def _verified(
    body: Mapping[str, Any],
    namespace: str,
    keys: KeySource | None,
    ledger: SignatureLedger,
) -> Verification:
    """The pod's signature checked against the keys held (and once more after re-reading
    the Secret when it names a key not held: another replica may have rotated), made for
    this pod (signed within FRESH_SECONDS of its creation, which the API server stamps)
    and not used by another pod before."""
    checked = _signature_holds(body, namespace, keys)
    if not checked.ok or checked.signed_at is None:
        return checked
    created = created_at(body)
    if created is None or not fresh(checked.signed_at, created):
        return Verification(
            False,
            f"its {SIGNATURE_ANNOTATION} was made for another pod: signed at "
            f"{checked.signed_at} (unix), more than {FRESH_SECONDS} s from this pod's "
            "creation; a signature is used once",
            checked.key_id,
        )
    meta = as_map(body.get("metadata"))
    owner = ledger.claim(
        str(as_map(meta.get("annotations")).get(SIGNATURE_ANNOTATION)), str(meta.get("uid"))
    )
    if owner is not None:
        return Verification(
            False,
            f"its {SIGNATURE_ANNOTATION} was used by pod uid {owner[:40]} first; a signature "
            "is used once",
            checked.key_id,
        )
    return checked


def _signature_holds(
    body: Mapping[str, Any], namespace: str, keys: KeySource | None
) -> Verification:
    if keys is None:
        return Verification(False, "the controller holds no probe-signing key")
    ring = keys.holder.ring or keys.refresh()
    if ring is None:
        return Verification(False, "the controller holds no probe-signing key")
    checked = verify(ring, namespace, body)
    if not checked.ok and checked.key_id and ring.find(checked.key_id) is None:
        fresh = keys.refresh()
        if fresh is not None and fresh is not ring:
            checked = verify(fresh, namespace, body)
    return checked


# kopf lists every watched resource whole before it watches, and again after each
# "410 Gone": in pages of this many objects (kopf's default is one request for all),
# each page parsed whole. A probed pod is a tenant's worker, up to 1.5 MiB and ~12 MB
# once parsed: 4 of them are ~50 MB beside the controller's ~170 MiB, under its 256 Mi
# limit; 5,000 probed pods are 1,250 requests at start.
LIST_CHUNK = 4


def watch_probed_pods_only(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Server-side label selector on the pod watch: in a cluster of thousands of pods the
    controller lists and watches only those the probe was injected into; and the lists
    kopf makes are paged (LIST_CHUNK)."""
    settings.watching.label_selectors["v1", "pods"] = f"{PROBED_LABEL}=true"
    settings.watching.chunk_size = LIST_CHUNK


kopf.on.startup(id="epguard-probed-pods-selector")(watch_probed_pods_only)


def start_recording(memo: kopf.Memo, **_: Any) -> None:
    """One Recorder and one SignatureLedger for the whole process, in the operator's
    memo. kopf gives each object's handlers a shallow copy of that memo, made when the
    object is first seen: what a handler stores in its own copy is that pod's alone. Made
    lazily there (before), each pod had a ledger of its own, so a signature copied into
    a second pod within FRESH_SECONDS verified again ("each signature counts once" held
    in the unit tests only, which share one memo), and every pod recounted its
    namespace's share from the API."""
    config: ControllerConfig = memo["config"]
    memo["recorder"] = Recorder(
        KubeRecorderApi(memo["api"]), per_namespace=config.verdicts_per_namespace
    )
    memo["signatures"] = SignatureLedger()


kopf.on.startup(id="epguard-recorder-start")(start_recording)

# Event handlers put no finalizer on pods (unlike create/update handlers), so a
# missing controller never blocks a pod's deletion.
kopf.on.event(
    "",
    "v1",
    "pods",
    labels={PROBED_LABEL: "true"},
    when=has_probe,
    id="epguard-probe-outcomes",
)(record_probe_outcomes)
