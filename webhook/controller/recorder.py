"""Turn probe outcomes in pod status into ImageVerdicts, and post Events where people look.

A pod made by a Deployment or a LeaderWorkerSet is not where anyone looks when it
fails, so every outcome is posted as an Event on the pod *and* on its top owner
(following controller ownerReferences: Pod → ReplicaSet → Deployment, Pod →
StatefulSet → LeaderWorkerSet, …).

Pod events are re-delivered (every status change, every operator restart), so each
recorded termination is remembered in a pod annotation and recorded once: the count
on the ImageVerdict is the number of probe runs that saw the image, not the number
of watch events.

Only the active peer handles events (kopf peering pauses the others), so two
replicas do not double-count; the ImageVerdict write still carries the
resourceVersion it read, so a race ends in a 409 and a re-read, not a lost update.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import (
    GenericGlobalResource,
    GenericNamespacedResource,
    create_namespaced_resource,
)
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Pod

from webhook.controller.config import ControllerConfig
from webhook.outcome import (
    PROBED_LABEL,
    ProbeOutcome,
    is_probe,
    outcomes_of,
    verdict_name,
    verdict_spec,
)
from webhook.verdicts import image_verdict_resource
from webhook.workloads import as_list, as_map

log = logging.getLogger("epguard.controller.recorder")

ImageVerdict = image_verdict_resource()
RECORDED_ANNOTATION = "epguard.io/probe-recorded"
MAX_REMEMBERED = 20
MAX_OWNER_DEPTH = 5
MAX_EVENT_MESSAGE = 1000
WRITE_ATTEMPTS = 5
COMPONENT = "epguard-controller"


def has_probe(body: Any, **_: Any) -> bool:
    """kopf filter: only pods that carry the probe init container are worth a look.

    Reads ``body`` (whose items are the raw dicts), not kopf's ``spec`` kwarg: that is a
    ``kopf.Spec`` view, not a dict, so ``as_map`` would see nothing in it."""
    spec = body.get("spec") if isinstance(body, Mapping) else None
    return any(
        isinstance(c, Mapping) and is_probe(c) for c in as_list(as_map(spec).get("initContainers"))
    )


def remembered(annotations: Mapping[str, Any]) -> list[str]:
    raw = annotations.get(RECORDED_ANNOTATION)
    try:
        keys = json.loads(raw) if isinstance(raw, str) else []
    except ValueError:
        return []
    return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Recorder:
    """The API side of recording: ImageVerdict upserts, Events, owner lookups."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self._owner_kinds: dict[tuple[str, str], type[GenericNamespacedResource]] = {}

    async def upsert_verdict(self, outcome: ProbeOutcome, pod: str) -> Mapping[str, Any]:
        name = verdict_name(outcome.image, outcome.digest)
        for _ in range(WRITE_ATTEMPTS):
            existing: GenericGlobalResource | None
            try:
                existing = await self.client.get(ImageVerdict, name)
            except ApiError as exc:
                if exc.status.code != 404:
                    raise
                existing = None
            spec = verdict_spec(outcome, pod, _now(), existing.get("spec") if existing else None)
            meta = ObjectMeta(
                name=name,
                labels={"app.kubernetes.io/managed-by": COMPONENT},
                resourceVersion=(
                    existing.metadata.resourceVersion if existing and existing.metadata else None
                ),
            )
            obj = ImageVerdict(metadata=meta, spec=spec)
            try:
                if existing is None:
                    await self.client.create(obj)
                else:
                    await self.client.replace(obj)
            except ApiError as exc:
                if exc.status.code == 409:  # lost a race (create or stale resourceVersion)
                    continue
                raise
            return spec
        raise kopf.TemporaryError(f"ImageVerdict {name}: too many write conflicts", delay=5)

    async def top_owner(self, namespace: str, refs: Any) -> ObjectReference | None:
        """Follow controller ownerReferences up; None when the pod has no owner."""
        top: ObjectReference | None = None
        for _ in range(MAX_OWNER_DEPTH):
            ref = next(
                (r for r in as_list(refs) if isinstance(r, Mapping) and r.get("controller")),
                None,
            )
            if ref is None:
                return top
            api_version, kind, name = ref.get("apiVersion"), ref.get("kind"), ref.get("name")
            if not all(isinstance(v, str) for v in (api_version, kind, name)):
                return top
            assert isinstance(api_version, str) and isinstance(kind, str)
            top = ObjectReference(
                apiVersion=api_version,
                kind=kind,
                name=name,
                namespace=namespace,
                uid=ref.get("uid"),
            )
            resource = self._kind(api_version, kind)
            try:
                parent = await self.client.get(resource, str(name), namespace=namespace)
            except ApiError as exc:
                # 403: the chart's RBAC does not cover this owner kind; 404: gone. Either
                # way the owner we have is the best we can name.
                log.debug("stopping owner walk at %s/%s: %s", kind, name, exc.status.message)
                return top
            refs = parent.metadata.ownerReferences if parent.metadata else None
            refs = [r.to_dict() for r in refs] if refs else []
        return top

    def _kind(self, api_version: str, kind: str) -> type[GenericNamespacedResource]:
        key = (api_version, kind)
        if key not in self._owner_kinds:
            group, _, version = api_version.rpartition("/")
            # Every owner kind that makes pods pluralizes as kind + "s".
            self._owner_kinds[key] = create_namespaced_resource(
                group, version, kind, kind.lower() + "s"
            )
        return self._owner_kinds[key]

    async def post_event(self, about: ObjectReference, outcome: ProbeOutcome, message: str) -> None:
        now = _now()
        usable = outcome.verdict == "Usable"
        event = Event(
            metadata=ObjectMeta(generateName=f"{about.name}.epguard.", namespace=about.namespace),
            involvedObject=about,
            reason="MooncakeProbePassed" if usable else "MooncakeProbeFailed",
            message=message[:MAX_EVENT_MESSAGE],
            type="Normal" if usable else "Warning",
            source=EventSource(component=COMPONENT),
            firstTimestamp=now,
            lastTimestamp=now,
            count=1,
        )
        try:
            await self.client.create(event)
        except ApiError as exc:
            # An Event is a courtesy: failing to post one must not stop the verdict.
            log.warning("could not post event on %s/%s: %s", about.kind, about.name, exc)

    async def remember(self, namespace: str, name: str, keys: list[str]) -> None:
        patch = {"metadata": {"annotations": {RECORDED_ANNOTATION: json.dumps(keys)}}}
        await self.client.patch(Pod, name, patch, namespace=namespace)


def _message(outcome: ProbeOutcome, pod: str) -> str:
    # The probe's own first line (verdict and cause), where the ImageVerdict keeps only
    # the cause: an Event is read alone, in `kubectl describe`.
    first_line = outcome.report.splitlines()[0] if outcome.report else outcome.reason
    return (
        f"epguard probe in pod {pod} (container {outcome.container}, image {outcome.image}): "
        f"{first_line}"
    )


async def record_probe_outcomes(body: Mapping[str, Any], memo: kopf.Memo, **_: Any) -> None:
    """Record every new probe termination of one pod.

    Returns nothing on purpose: kopf stores a handler's return value in the object's
    status, and a pod's status belongs to the kubelet."""
    meta = as_map(body.get("metadata"))
    namespace, name = meta.get("namespace"), meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str):
        return
    seen = remembered(as_map(meta.get("annotations")))
    config: ControllerConfig | None = memo.get("config")
    probe_image = config.probe_image if config is not None else None
    fresh = [o for o in outcomes_of(body, probe_image) if o.key not in seen]
    if not fresh:
        return
    recorder: Recorder | None = memo.get("recorder")
    if recorder is None:
        recorder = Recorder(AsyncClient(field_manager=COMPONENT))
        memo["recorder"] = recorder
    pod_ref = ObjectReference(
        apiVersion="v1", kind="Pod", name=name, namespace=namespace, uid=meta.get("uid")
    )
    owner = await recorder.top_owner(namespace, meta.get("ownerReferences"))
    pod = f"{namespace}/{name}"
    for outcome in fresh:
        await recorder.upsert_verdict(outcome, pod)
        message = _message(outcome, pod)
        await recorder.post_event(pod_ref, outcome, message)
        if owner is not None:
            await recorder.post_event(owner, outcome, message)
        log.info("recorded %s for %s from pod %s", outcome.verdict, outcome.image, pod)
    keys = (seen + [o.key for o in fresh])[-MAX_REMEMBERED:]
    await recorder.remember(namespace, name, keys)


def watch_probed_pods_only(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Server-side label selector on the pod watch: in a cluster of thousands of pods the
    controller lists and watches only those the probe was injected into."""
    settings.watching.label_selectors["v1", "pods"] = f"{PROBED_LABEL}=true"


kopf.on.startup(id="epguard-probed-pods-selector")(watch_probed_pods_only)

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
