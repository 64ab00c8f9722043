"""Probe outcomes read back from pod status, as the kubelet recorded them.

The probe (``probe/``) writes a termination message whose first line is the
verdict, one line is ``versions: torch=… sglang=… <mooncake-dist>=…`` and the
last line is ``fix: …``; the kubelet copies it into
``status.initContainerStatuses[].state.terminated.message``. This module turns
that into typed observations and into the ``ImageVerdict`` spec the controller
writes. It is pure (no API calls) so it can be tested on real probe messages.

Only exit codes 0 and 1 are evidence about the image: 2 is a usage error, and
anything else (OOM kill 137, a signal, the node going away) says nothing about
whether mooncake fits the image, so it is not recorded.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from epguard.probe.message import (
    FILES_CLEAR,
    IMAGE,
    NOTHING,
    SCOPE,
    UNUSABLE,
    UNUSABLE_HERE,
    USABLE,
    USABLE_HERE,
)
from epguard.webhook.engine.argv import ExpansionTooLarge, container_argv
from epguard.webhook.engine.imageref import ImageRefError, parse, spelt_as_the_runtime_names
from epguard.webhook.engine.text import first_line, parse_time, stamp
from epguard.webhook.engine.verdicts import (
    SOURCE_PROBE,
    ImageVerdictSpec,
    Versions,
    build_spec,
)
from epguard.webhook.engine.workloads import as_list, as_map

PROBE_CONTAINER = "epguard-probe"
COPY_CONTAINER = "epguard-copy-probe"
# The probe's volume: the emptyDir the copy container fills, or (a preflight's, with
# preflight.probeVolume: image) the epguard image itself.
PROBE_VOLUME = "epguard-probe"
# Set on every pod the probe is injected into: the controller watches only pods with it
# (a server-side label selector), not every pod in the cluster.
PROBED_LABEL = "epguard.io/probed"
MAX_REASON = 1024

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# First lines that say nothing about the image, whatever the exit code: "nothing to
# check", a pass only with one pod's variables, and a --files-only run (a preflight pod)
# whose files prove no cause -- the import, the driver and the GPU are still unjudged,
# so it is no pass.
NOTHING_LEARNED = (NOTHING, USABLE_HERE, FILES_CLEAR)

VerdictName = Literal["Usable", "Unusable"]
# Where a failure lives (probe/diagnosis.py): only "image" causes are facts about the
# image that may refuse other people's pods; "environment" ones belong to one pod/node.
Scope = Literal["image", "environment"]


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    """One terminated probe container of one pod."""

    container: str
    image: str
    digest: str | None
    verdict: VerdictName
    scope: Scope | None  # None for Usable
    reason: str
    report: str
    versions: Versions
    finished_at: str
    exit_code: int
    restart_count: int
    # The probe container's imagePullPolicy, as the pod says (the kubelet's, defaulted by
    # the API server; immutable): "Always" is the only one that resolves a tag.
    pull_policy: str = ""

    @property
    def verdict_image(self) -> str:
        """The reference a verdict of this run answers for.

        A tag names the bytes the probe ran only if the kubelet asked the registry for
        the tag when the probe started (``imagePullPolicy: Always``). With
        ``IfNotPresent`` or ``Never`` the probe ran whatever that node holds under the
        tag, maybe a build the tag has since moved away from; a verdict under the tag
        would then refuse (or clear) every tenant's pods on the tag's new bytes, and each
        pod landing on that node would refresh it. Such a run answers for its digest
        alone (``name@digest``), unless a pull that did resolve the tag found these same
        bytes a moment before (``Recorder.answers_for``): a gated worker after its
        preflight. A pull with Always of a spelling the runtime keeps as a registry of its
        own (``registry-1.docker.io/…``, ``NVCR.IO/…``: imageref.spelt_as_the_runtime_names)
        resolved that host's tag, which may not be the bytes the usual spelling pulls
        through the node's mirror: its digest alone too."""
        if self.digest is None:
            return self.image
        if self.pull_policy == "Always" and spelt_as_the_runtime_names(self.image):
            return self.image
        try:
            ref = parse(self.image)
        except ImageRefError:
            return self.image
        if ref.tag is None or ref.digest is not None:
            return self.image
        return f"{ref.name}@{self.digest}"

    @property
    def about_the_image(self) -> bool:
        """Evidence about the image's bytes: a digest the kubelet ran, and either a pass
        or a cause in the image's files. Only this may become an ImageVerdict."""
        return self.digest is not None and (self.verdict == "Usable" or self.scope == IMAGE)

    @property
    def key(self) -> str:
        """Identifies this termination, so re-delivered pod events are recorded once: its
        container and the time the kubelet says it ended. Not the restart count: during a
        crash loop the kubelet shows one termination under two counts (in ``state`` while
        it ends, in ``lastState`` while it waits with the count unchanged, and with the
        count raised once the next run starts, when it is no longer read: _same_run), so
        a key with it changed and the run was recorded again (found by a review helper
        on 3c638ec)."""
        return f"{self.container}/{self.finished_at}"


# How injection runs the probe: ``PROBE_CALL + [<mount>/probe, …, "--", WORKER_ARGV]``.
# -I: the probe itself (stdlib only) ignores PYTHON* variables copied from the worker's
# env and the user's site-packages; the child that imports torch gets the image's own.
PROBE_CALL = ["python3", "-I"]


def runs_as_injected(container: Mapping[str, Any]) -> bool:
    """Whether ``container``'s command is the probe call exactly as injection writes it
    (PROBE_CALL, then a path ending in /probe), with no shell before it."""
    command = container.get("command")
    n = len(PROBE_CALL)
    return (
        isinstance(command, list)
        and len(command) > n + 1
        and command[:n] == PROBE_CALL
        and isinstance(command[n], str)
        and command[n].endswith("/probe")
    )


def _named_like_probe(name: object) -> bool:
    return isinstance(name, str) and (
        name == PROBE_CONTAINER or name.startswith(PROBE_CONTAINER + "-")
    )


def _runs_the_probe_call(container: Mapping[str, Any]) -> bool:
    try:
        argv = container_argv(container)
    except ExpansionTooLarge:
        return False
    if "--" not in argv:
        return False
    head = argv[: argv.index("--")]
    return any(a.rstrip("/").endswith("/probe") or a == "probe" for a in head)


def is_probe(container: Mapping[str, Any]) -> bool:
    """Is this (init) container the probe epguard injects? The one answer used by
    injection, policy, outcome parsing and the recorder.

    It must carry the probe's name (``epguard-probe`` or ``epguard-probe-<worker>``) and
    run the probe call, ``python3 …/probe [opts] -- WORKER_ARGV``. A name alone is not
    enough (anyone who can create a pod can name a worker ``epguard-probe``), and the
    worker argv after ``--`` is what the probe checks, not what the container runs.
    """
    return _named_like_probe(container.get("name")) and _runs_the_probe_call(container)


def _trusted(spec: Mapping[str, Any], probe_image: str | None) -> bool:
    """Whether a pod's probe came from epguard: when the controller knows the image that
    carries the real probe, the pod's copy container must run that image, or its probe
    volume must be that image (a preflight's, preflight.probeVolume: image), so a pod
    cannot bring its own "probe" that prints a verdict of its choosing."""
    if not probe_image:
        return True
    copied = any(
        isinstance(c, Mapping) and c.get("name") == COPY_CONTAINER and c.get("image") == probe_image
        for c in as_list(spec.get("initContainers"))
    )
    return copied or any(
        isinstance(v, Mapping)
        and v.get("name") == PROBE_VOLUME
        and as_map(v.get("image")).get("reference") == probe_image
        for v in as_list(spec.get("volumes"))
    )


def digest_of(image_id: Any) -> str | None:
    """``imageID`` comes as ``docker.io/x@sha256:…`` or ``docker-pullable://…@sha256:…``."""
    if not isinstance(image_id, str):
        return None
    found = _DIGEST.findall(image_id.lower())
    return found[-1] if found else None


def digest_for(image: Any, image_id: Any) -> str | None:
    """The digest ``image_id`` reports for a container that asked for ``image``; None when
    it names another repository. containerd reports the first of the image's repo
    digests in alphabetical order, every name its config carries on that node merged, so
    a tenant that pulled a re-manifested copy of a public image (the same config) as
    ``aaa.example/p@sha256:…`` made other tenants' probes of that image report its
    digest: their verdicts keyed to bytes nobody else names, and the tag's newest pull
    taken over (found by a review helper). A bare ``sha256:…`` names no repository. A
    pod that pins a digest ran those bytes (the runtime checks them): that digest."""
    digest = digest_of(image_id)
    if digest is None or not isinstance(image_id, str) or "@" not in image_id:
        return digest
    repository = image_id.split("://", 1)[-1].rsplit("@", 1)[0]
    if not repository:
        return digest
    try:
        asked = parse(str(image))
        same = parse(repository).name == asked.name
    except ImageRefError:
        return None
    if asked.digest:
        return asked.digest
    return digest if same else None


def parse_versions(message: str) -> Versions:
    for line in message.splitlines():
        if not line.startswith("versions:"):
            continue
        pairs = dict(
            token.split("=", 1) for token in line[len("versions:") :].split() if "=" in token
        )
        mooncake = " ".join(
            f"{name} {value}"
            for name, value in pairs.items()
            if name.startswith("mooncake") and value != "none"
        )
        return Versions(
            torch=pairs.get("torch", ""),
            sglang=pairs.get("sglang", ""),
            mooncake=mooncake or "none",
        )
    return Versions()


def classify(message: str, exit_code: int) -> tuple[VerdictName, Scope | None] | None:
    """The verdict a termination stands for and, for a failure, where its cause lives;
    None when it is no evidence (:data:`NOTHING_LEARNED`: "nothing to check", "usable in
    this pod", and a --files-only run's "no image cause in this image's files"). A
    failure's scope is its first line ("in this image" / "in this pod"), and a ``scope:``
    line that says otherwise makes it environment: a message that contradicts itself is
    not evidence about the image."""
    lines = message.strip().splitlines()
    first = first_line(message)
    if first.startswith(NOTHING_LEARNED):
        return None
    if exit_code == 0 and first.startswith(USABLE):
        return "Usable", None
    if exit_code != 1:
        return None
    if first.startswith(UNUSABLE_HERE):
        return "Unusable", "environment"
    if not first.startswith(UNUSABLE):
        return None
    said = [ln[len(SCOPE) :].split(" ", 1)[0] for ln in lines[1:] if ln.startswith(SCOPE)]
    return "Unusable", "environment" if said and said[0] != IMAGE else "image"


def _cause(first_line: str) -> str:
    """The probe's first line without its verdict prefix: the webhook and the Events put
    their own words in front ("… which this image cannot serve: <cause>")."""
    return first_line.removeprefix(UNUSABLE).removeprefix(UNUSABLE_HERE)


def _termination(status: Mapping[str, Any]) -> tuple[Mapping[str, Any], int] | None:
    """The newest termination and the run it ended (its restart count), if any.

    The current state is the newest; lastState holds the previous run while the
    container restarts (Init:CrashLoopBackOff shows "waiting" with lastState terminated).
    """
    for section in ("state", "lastState"):
        terminated = as_map(as_map(status.get(section)).get("terminated"))
        if terminated and (section == "state" or _same_run(status, terminated)):
            return terminated, int(status.get("restartCount") or 0) - (section == "lastState")
    return None


def _same_run(status: Mapping[str, Any], last: Mapping[str, Any]) -> bool:
    """Whether a lastState run is the one the status's ``imageID`` describes. While the
    container waits to restart the kubelet shows the run that ended, lastState and
    containerID alike; once the next run starts, containerID and imageID are the new
    run's: a tag moved meanwhile would pair the old run's answer with the new bytes (a
    verdict for an image that never said it)."""
    container = status.get("containerID")
    return isinstance(container, str) and bool(container) and last.get("containerID") == container


def outcomes_of(pod: Mapping[str, Any], probe_image: str | None = None) -> list[ProbeOutcome]:
    """Every probe termination a pod's status holds that is evidence about its image.

    Only containers that run the probe call count, and, given ``probe_image`` (the image
    epguard injects to copy the probe), only in pods whose copy container runs it.
    """
    spec = as_map(pod.get("spec"))
    if not _trusted(spec, probe_image):
        return []
    probes = _probe_containers(spec)
    spec_images = {name: (c.get("image"), c.get("imagePullPolicy")) for name, c in probes.items()}
    found = (
        _outcome(status, spec_images)
        for status in as_list(as_map(pod.get("status")).get("initContainerStatuses"))
        if isinstance(status, Mapping)
    )
    return [o for o in found if o is not None]


def _probe_containers(spec: Mapping[str, Any]) -> dict[Any, Mapping[str, Any]]:
    """The init containers that run the probe call, by name."""
    return {
        c.get("name"): c
        for c in as_list(spec.get("initContainers"))
        if isinstance(c, Mapping) and is_probe(c)
    }


@dataclass(frozen=True, slots=True)
class Resolution:
    """A pull with ``imagePullPolicy: Always`` of an image named by tag: when the kubelet
    started that container (``startedAt``, which it writes, not the pod's owner), the
    registry's ``tag`` named ``digest``."""

    tag: str  # normalized name:tag
    digest: str
    started_at: dt.datetime


def _started(status: Mapping[str, Any]) -> dt.datetime | None:
    """When the run the status's ``imageID`` describes started (:func:`_same_run`)."""
    for section in ("state", "lastState"):
        for phase in ("running", "terminated"):
            run = as_map(as_map(status.get(section)).get(phase))
            if section == "lastState" and not _same_run(status, run):
                continue
            at = parse_time(run.get("startedAt"))
            if at is not None:
                return at
    return None


def resolved_tags(pod: Mapping[str, Any], probe_image: str | None = None) -> list[Resolution]:
    """What each probe container of ``pod`` that pulled its by-tag image with Always
    found: the digest the kubelet ran, and when. A preflight's files-only pass teaches no
    verdict, but tells this much (``Recorder.answers_for``)."""
    spec = as_map(pod.get("spec"))
    if not _trusted(spec, probe_image):
        return []
    always = {
        name: c.get("image")
        for name, c in _probe_containers(spec).items()
        if c.get("imagePullPolicy") == "Always"
    }
    found: list[Resolution] = []
    for status in as_list(as_map(pod.get("status")).get("initContainerStatuses")):
        if not isinstance(status, Mapping) or status.get("name") not in always:
            continue
        image = always[status.get("name")]
        digest = digest_for(image, status.get("imageID"))
        started = _started(status)
        try:
            ref = parse(image) if isinstance(image, str) else None
        except ImageRefError:
            ref = None
        if (
            digest
            and started
            and ref is not None
            and ref.tag is not None
            and not ref.digest
            and spelt_as_the_runtime_names(str(image))
        ):
            found.append(Resolution(ref.name_tag, digest, started))
    return found


def _outcome(status: Mapping[str, Any], spec_images: Mapping[Any, Any]) -> ProbeOutcome | None:
    """One init container's status → its probe outcome, if it is a trusted probe whose
    last termination is evidence."""
    name = status.get("name")
    if not isinstance(name, str) or name not in spec_images:
        return None
    termination = _termination(status)
    if termination is None:
        return None
    terminated, restarts = termination
    message = terminated.get("message")
    message = message if isinstance(message, str) else ""
    code = terminated.get("exitCode")
    if not isinstance(code, int):
        return None
    classified = classify(message, code)
    # The image the pod asked for (its spec), which is what the next pods name: the
    # runtime reports in status.image any of the names the same bytes carry on that node
    # (seen on the node: a verdict named after another tag of the image). The bytes are
    # the digest the kubelet reports (imageID). Patching the probe's image after the run
    # does not steer this: the image is in the signed parts, and the recorder learns only
    # from a pod whose signature verifies as it is now.
    asked, policy = spec_images[name]
    ran = status.get("image")
    image = asked if isinstance(asked, str) and asked else ran
    if classified is None or not isinstance(image, str) or not image:
        return None
    verdict, scope = classified
    return ProbeOutcome(
        container=name,
        image=image,
        digest=digest_for(image, status.get("imageID")),
        verdict=verdict,
        scope=scope,
        reason=_cause(first_line(message))[:MAX_REASON],
        report=message.strip()[:4096],
        versions=parse_versions(message),
        finished_at=str(terminated.get("finishedAt") or ""),
        exit_code=code,
        restart_count=max(restarts, 0),
        pull_policy=policy if isinstance(policy, str) else "",
    )


# The runs an ImageVerdict remembers (``spec.runs``), so a re-delivered pod event is
# counted once without the controller writing to anyone's pod.
MAX_RUNS = 20
# A kubelet's clock ahead of the controller's by more than this: its times are not
# trusted to order anything (a node's fast clock).
CLOCK_SKEW = dt.timedelta(minutes=5)


def recorded_runs(previous: Mapping[str, Any] | None) -> list[str]:
    runs = as_map(previous).get("runs")
    return [r for r in as_list(runs) if isinstance(r, str)][-MAX_RUNS:]


def verdict_spec(
    outcome: ProbeOutcome,
    pod: str,
    now: dt.datetime,
    previous: Mapping[str, Any] | None,
    run: str = "",
    architecture: str | None = None,
    image: str | None = None,
    created: dt.datetime | None = None,
) -> ImageVerdictSpec:
    """The spec to write: the newest outcome replaces the old one; count and firstSeen
    carry; ``run`` (the termination, see ``run_key``) joins the remembered runs;
    ``architecture``: the ``kubernetes.io/arch`` of the node the probe ran on; ``image``:
    the reference it answers for (default ``outcome.verdict_image``); ``created``: the
    pod's creationTimestamp (the API server's clock).

    The run is dated when it ended (the kubelet's ``finishedAt``), not when it is read:
    a run read again (the controller restarted, and the verdict remembers only its last
    MAX_RUNS runs) is as old as it is, so it neither renews a tag's TTL nor, being older
    than the answer the verdict holds, replaces it: it is counted, and the newer answer
    stays. The node's clock is bounded by the others: never later than ``now``, never
    earlier than the pod's creation; a time more than CLOCK_SKEW ahead of ``now`` is
    dated now and ordered by the pod's creation (a fast clock would otherwise make an
    old run the newest again at every restart)."""
    runs = recorded_runs(previous)
    if run and run not in runs:
        runs = [*runs, run][-MAX_RUNS:]
    finished = parse_time(outcome.finished_at)
    if finished is not None and finished > now + CLOCK_SKEW:
        # The node's clock is not trusted: dated now, ordered by the pod's creation
        # (the API server's), or by nothing (kept behind any held answer).
        seen = now
        order = min(created, now) if created is not None else None
    else:
        seen = min(now, finished) if finished is not None else now
        if created is not None and seen < created:
            seen = min(created, now)
        order = seen
    spec = build_spec(
        image=image or outcome.verdict_image,
        digest=outcome.digest or "",
        verdict=outcome.verdict,
        reason=outcome.reason,
        report=outcome.report,
        versions=outcome.versions,
        source=SOURCE_PROBE,
        now=seen,
        previous=previous,
        pod=pod,
        runs=runs,
        architecture=architecture,
    )
    held = as_map(previous)
    held_seen, held_first = parse_time(held.get("lastSeen")), parse_time(held.get("firstSeen"))
    if held_first is not None and seen < held_first:
        spec["firstSeen"] = spec["lastSeen"]
    # A held time further ahead of this clock than CLOCK_SKEW (a replica's or an earlier
    # clock's) is not trusted to keep its answer: a newer run replaces it.
    if (
        held_seen is None
        or held_seen > now + CLOCK_SKEW
        or (order is not None and order >= held_seen)
        or held.get("verdict") not in ("Usable", "Unusable")
    ):
        return spec
    # An older run than the one the verdict holds: its answer and its time stay.
    versions = as_map(held.get("versions"))
    spec["verdict"] = str(held["verdict"])
    spec["reason"] = str(held.get("reason") or "")
    spec["report"] = str(held.get("report") or "")
    spec["versions"] = {
        "sglang": _held_version(versions.get("sglang")),
        "torch": _held_version(versions.get("torch")),
        "mooncake": _held_version(versions.get("mooncake")),
    }
    spec["lastSeen"] = stamp(held_seen)
    if isinstance(held.get("image"), str) and held["image"]:
        spec["image"] = held["image"]  # the reference the held run's pod named
    held_pod, held_arch = held.get("pod"), held.get("architecture")
    spec.pop("pod", None)
    spec.pop("architecture", None)
    if isinstance(held_pod, str):
        spec["pod"] = held_pod
    if isinstance(held_arch, str):
        spec["architecture"] = held_arch
    return spec


def _held_version(value: Any) -> str:
    return value if isinstance(value, str) else ""


def run_key(pod_uid: str, outcome: ProbeOutcome) -> str:
    """One probe termination, cluster-wide: the pod's uid (names are reused) and the
    container's run (``ProbeOutcome.key``)."""
    return f"{pod_uid}/{outcome.key}"
