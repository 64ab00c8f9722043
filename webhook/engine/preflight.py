"""The preflight gate: a worker on an unjudged image is held unscheduled while one
preflight pod judges the image's files.

The kubelet pulls image volumes and mounts PersistentVolumeClaims before any init
container runs, so the init-container probe comes too late for a model that arrives that
way: only a pod that is not scheduled has pulled nothing. ``/mutate`` therefore adds the
scheduling gate :data:`GATE` to an elastic-EP worker whose image has no verdict yet, and
the controller runs one preflight per :class:`PreflightKey` -- the namespace, the image
reference, the image pull secrets and the service account, the four things that decide
whether and how the image can be pulled -- so 64 replicas of a new image start one.

A preflight pod is built here (:func:`preflight_pod`) from the worker: the probe is
injected exactly as for a worker (``injection.plan``), judging the image's files only
(``--files-only``), with the worker's pull secrets, service account and placement
(node selector, affinity, tolerations: it pulls where the worker could run and warms
that node's cache), none of the worker's volumes, and no GPU unless asked. The probe's
files come as in a worker, through epguard's copy container, or (``preflight.probeVolume:
image``, :data:`ProbeVolume`) from the epguard image mounted as the probe's volume. The
controller signs it like an injected pod, so its outcome is recorded by the same path
as every probe's (``controller/recorder.py``).

Pure: no I/O.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from epguard.probe import shell
from epguard.probe.sandbox import POD_PREFIX
from epguard.webhook.engine.argv import analyse_container
from epguard.webhook.engine.imageref import ImageRefError
from epguard.webhook.engine.imageref import parse as parse_ref
from epguard.webhook.engine.injection import InjectionSettings, plan
from epguard.webhook.engine.outcome import (
    PROBE_CALL,
    PROBE_CONTAINER,
    PROBE_VOLUME,
    PROBED_LABEL,
    classify,
)
from epguard.webhook.engine.signing import SIGNATURE_ANNOTATION, Key, created_at, sign
from epguard.webhook.engine.text import cut, first_line
from epguard.webhook.engine.verdicts import VerdictLookup
from epguard.webhook.engine.workloads import as_list, as_map

GATE = "epguard.io/preflight"
# The pod condition that says why a pod is still gated (``kubectl describe pod``).
CONDITION = "epguard.io/Preflight"
# On a preflight pod: the hash of its key (the gated pods carry it too, so the controller
# finds the pods one preflight decides with a label selector).
KEY_LABEL = "epguard.io/preflight-key"
# On a preflight pod: "true" (what the controller watches and cleans up).
PREFLIGHT_LABEL = "epguard.io/preflight-pod"

# The preflight pod's main container: it only has to exist (a pod needs one) and end.
DONE_CONTAINER = "preflight-done"
NAME_PREFIX = "epguard-preflight-"
# Kubernetes names of pods are DNS subdomains; a label value is at most 63 characters.
KEY_HEX = 20
# The images of one pod that its preflights judge (the first ones, in container order). A
# worker pod runs one SGLang image, or a few; the cap keeps what the controller holds for
# one pod bounded: a pod of 1,500 containers on 1,500 images asking for mooncake was
# 1,500 keys in every pass's tables (a few hundred KB a pod: about a hundred such pods
# took the controller past its memory limit, and each restart listed them again). The
# images past it are judged by the init probe on the node, as for an ungated pod.
MAX_IMAGES = 8


def unjudged(images: Iterable[str], verdicts: VerdictLookup, now: dt.datetime) -> tuple[str, ...]:
    """The images no verdict clears: none Usable by the digest a reference pins, nor by
    its tag seen within the tag TTL. An image with an Unusable verdict is in the list
    too: /validate refuses such a pod, and if it does not -- another webhook replica whose
    watch has not had the verdict yet, seen on the node with 200 pods -- the gate holds
    the pod and the finished preflight's answer keeps it held. A reference that does not
    parse is left out (its pull fails anyway: nothing for a preflight to judge)."""
    out: list[str] = []
    for image in images:
        try:
            ref = parse_ref(image)
        except ImageRefError:
            continue
        hit = verdicts.lookup(ref, now)
        if hit is None or not hit.fresh or hit.trust != "usable":
            out.append(image)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PreflightKey:
    """What decides whether, where and how an image is pulled: one preflight per key.

    The pull secrets are known by ``hash`` alone (it is made from their names): a key
    kept each name, and a tenant's 50,000 names of ``imagePullSecrets`` (the API server
    checks no count) were 4 MB in every pass for every pod waiting on it. The preflight
    takes the names from the pod it is made from (:func:`preflight_pod`)."""

    namespace: str
    image: str
    service_account: str
    hash: str  # names the preflight (pod_name) and tells keys apart

    @property
    def pod_name(self) -> str:
        return NAME_PREFIX + self.hash


def pull_secrets(spec: Mapping[str, Any]) -> tuple[str, ...]:
    names = {
        str(s.get("name"))
        for s in as_list(spec.get("imagePullSecrets"))
        if isinstance(s, Mapping) and isinstance(s.get("name"), str) and s.get("name")
    }
    return tuple(sorted(names))


def key_of(namespace: str, spec: Mapping[str, Any], image: str) -> PreflightKey:
    account = spec.get("serviceAccountName")
    account = account if isinstance(account, str) and account else "default"
    # A JSON list, not a joined string: ("a", "b,c") and ("a,b", "c") differ.
    text = json.dumps([namespace, image, list(pull_secrets(spec)), account])
    digest = hashlib.sha256(text.encode()).hexdigest()[:KEY_HEX]
    return PreflightKey(namespace=namespace, image=image, service_account=account, hash=digest)


def is_gated(pod: Mapping[str, Any]) -> bool:
    gates = as_list(as_map(pod.get("spec")).get("schedulingGates"))
    return any(isinstance(g, Mapping) and g.get("name") == GATE for g in gates)


def gate_patch(spec: Mapping[str, Any], path: str = "/spec") -> list[dict[str, Any]]:
    """The JSON patch that adds :data:`GATE` to a pod spec (nothing if it is there)."""
    gates = [g for g in as_list(spec.get("schedulingGates")) if isinstance(g, Mapping)]
    if any(g.get("name") == GATE for g in gates):
        return []
    return [{"op": "add", "path": f"{path}/schedulingGates", "value": [*gates, {"name": GATE}]}]


def ungate_patch(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The JSON patch that removes :data:`GATE` and nothing else from a pod, guarded by a
    ``test`` of the pod's uid (a pod deleted and made again under the same name since it
    was listed -- a StatefulSet's -- is another pod, maybe on another image) and of the
    gate's place (a concurrent change of the list fails the patch rather than removing
    another gate). Empty when the pod is not gated by epguard."""
    uid = as_map(pod.get("metadata")).get("uid")
    guard = [{"op": "test", "path": "/metadata/uid", "value": uid}] if uid else []
    gates = as_list(as_map(pod.get("spec")).get("schedulingGates"))
    for i, g in enumerate(gates):
        if isinstance(g, Mapping) and g.get("name") == GATE:
            where = f"/spec/schedulingGates/{i}"
            return [
                *guard,
                {"op": "test", "path": where, "value": dict(g)},
                {"op": "remove", "path": where},
            ]
    return []


def condition_patch(uid: str, condition: Mapping[str, Any]) -> dict[str, Any]:
    """The strategic merge patch of ``pods/status`` that sets epguard's condition (merged
    by type) on the pod ``uid`` only: an object's uid cannot change, so the API server
    refuses the patch of another pod made since under the same name (422)."""
    return {**({"metadata": {"uid": uid}} if uid else {}), "status": {"conditions": [condition]}}


# How the probe's files reach the preflight's probe container (preflight.probeVolume):
# "copy", epguard's copy container writes them into an emptyDir first, as in an injected
# worker (any runtime); "image", the epguard image itself is the probe's volume, mounted
# read-only by the kubelet (an image volume: Kubernetes 1.35, or 1.33-1.34 with the
# ImageVolume feature gate, and a runtime that mounts them, containerd 2.1 or CRI-O
# 1.31), one container less (~1 s of the kubelet's work on the local node; end to end
# within the benchmark's run-to-run spread: docs/preflight.md).
ProbeVolume = Literal["copy", "image"]


@dataclass(frozen=True, slots=True)
class PreflightSettings:
    injection: InjectionSettings
    timeout_seconds: int = 600
    gpus: Literal["0", "worker"] = "0"
    probe_volume: ProbeVolume = "copy"


def mounts_the_probe_image(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod``'s probe volume is an image (preflight.probeVolume: image)."""
    return any(
        as_map(v).get("name") == PROBE_VOLUME and "image" in as_map(v)
        for v in as_list(as_map(pod.get("spec")).get("volumes"))
    )


def _mounted_from_image(
    probe: Mapping[str, Any], settings: InjectionSettings
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The probe container that runs the probe from the epguard image mounted whole at
    its probe volume's mount, and that volume."""
    command = list(as_list(probe.get("command")))
    # The probe's own path, right after PROBE_CALL (injection._probe_container): the
    # image's own directory under the volume's mount; never a word of the worker's argv,
    # which may name the same path.
    command[len(PROBE_CALL)] = f"{settings.mount_path}{settings.probe_source}"
    volume = {
        "name": PROBE_VOLUME,
        "image": {"reference": settings.epguard_image, "pullPolicy": settings.image_pull_policy},
    }
    return {**probe, "command": command}, volume


_RUN_AS = ("runAsUser", "runAsGroup", "runAsNonRoot")
_POD_SECURITY = ("fsGroup", "supplementalGroups")
_CONFINED = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
_PLACEMENT = ("nodeSelector", "affinity", "tolerations", "priorityClassName", "runtimeClassName")


def _with_cpu(container: Mapping[str, Any], request: str, limit: str) -> dict[str, Any]:
    """``container`` with its cpu request and limit set (a namespace's cpu quota refuses a
    pod whose containers set no limit; the worker's own, copied into its probe, is for
    serving, and a request above the limit is invalid)."""
    resources = as_map(container.get("resources"))
    requests = {**as_map(resources.get("requests")), "cpu": request}
    limits = {**as_map(resources.get("limits")), "cpu": limit}
    return {**container, "resources": {**resources, "requests": requests, "limits": limits}}


def _without_extended(container: Mapping[str, Any]) -> dict[str, Any]:
    """The probe container without the worker's extended resources (GPUs, RDMA): a
    preflight judges files, which any node can."""
    out = dict(container)
    resources = {
        part: {k: v for k, v in as_map(values).items() if k in ("cpu", "memory")}
        for part, values in as_map(container.get("resources")).items()
    }
    out["resources"] = {part: values for part, values in resources.items() if values}
    return out


def _pull_policy(image: str, worker: Any) -> Any | None:
    """The tag as the registry has it now, not as a node holds it: a verdict is learned
    under a tag only from a pull that resolved it (outcome.verdict_image). A reference
    pinned by digest has nothing to resolve, and Never stays Never (such a worker only
    ever runs what its node holds): both keep the worker's policy, so a node that cannot
    reach the registry still judges what it holds."""
    try:
        pinned = parse_ref(image).digest is not None
    except ImageRefError:
        pinned = False
    return worker if pinned or worker == "Never" else "Always"


def preflight_pod(
    namespace: str,
    worker_spec: Mapping[str, Any],
    key: PreflightKey,
    settings: PreflightSettings,
) -> dict[str, Any] | None:
    """The preflight pod for ``key``, from the spec of one pod gated on it; None when no
    container of that spec on ``key.image`` asks for mooncake (nothing to judge).

    Unsigned: the controller signs it (``signing.sign``) before it creates it."""
    budget = shell.Budget()
    workers = [
        c
        for c in as_list(worker_spec.get("containers"))
        if isinstance(c, Mapping)
        and c.get("image") == key.image
        and analyse_container(c, budget).worker  # what the key was made for
    ]
    # One worker container judges the image (the files are the same for every container
    # on it): planned alone, its probe is named epguard-probe, as the chart's policy and
    # shaped_as_preflight expect (two workers on one image made it epguard-probe-<name>,
    # a preflight the policy refused).
    injection = plan(
        {"containers": workers[:1]},
        replace(settings.injection, files_only=True),
    )
    if not injection.probes or injection.volume is None:
        return None
    copy, *probes = injection.containers
    (probe,) = probes
    volume: dict[str, Any] = injection.volume
    if settings.probe_volume == "image":
        probe, volume = _mounted_from_image(probe, settings.injection)
    if settings.gpus == "0":
        probe = _without_extended(probe)
    # Who it runs as, and nothing that widens what it can do: the worker's own privileges
    # are for serving on the GPU node, not for reading files (the chart's policy refuses a
    # privileged preflight). What restricted PodSecurity asks for, so a namespace that
    # enforces it admits the preflight when it admits the worker. Of the env only the
    # literal values, which admission read too (no Secret, ConfigMap or field): without
    # them a flag value admission read from one (`--elastic-ep-backend $(EP)`, `$EP` in a
    # script) was unreadable to the preflight's probe, which said "not requested", and
    # the pods were released as judged.
    own = as_map(probe.get("securityContext"))
    literal = _literal_env(probe)
    probe = {
        **{k: v for k, v in probe.items() if k not in ("env", "envFrom")},
        **({"env": literal} if literal else {}),
        "securityContext": {**{k: own[k] for k in _RUN_AS if k in own}, **_CONFINED},
    }
    policy = _pull_policy(key.image, probe.get("imagePullPolicy"))
    if policy is None:
        probe.pop("imagePullPolicy", None)
    else:
        probe["imagePullPolicy"] = policy
    probe, copy = _with_cpu(probe, "100m", "1"), _with_cpu(copy, "10m", "100m")
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": settings.timeout_seconds,
        "serviceAccountName": key.service_account,
        # The probe needs no API access; the account is there for its pull secrets.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "initContainers": [copy, probe] if settings.probe_volume == "copy" else [probe],
        "containers": [_done_container(settings.injection)],
        "volumes": [volume],
    }
    secrets = pull_secrets(worker_spec)  # the key's: key_of made its hash from them
    if secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in secrets]
    for field in _PLACEMENT:
        if worker_spec.get(field):
            spec[field] = worker_spec[field]
    if worker_spec.get("hostUsers") is False:
        # In a user namespace, as the worker: its runAsUser 0 (copied below) is root in
        # there only, not on the node (review helper), and a policy that asks for one
        # (PodSecurity's user-namespace relaxation) admits the preflight as the worker.
        spec["hostUsers"] = False
    security = as_map(worker_spec.get("securityContext"))
    # The image may only work as the user the worker runs it as (a user that cannot list
    # the image's packages proves nothing: probe/static.py); never the pod's own seccomp
    # profile, which could make reads fail.
    spec["securityContext"] = {
        **{k: security[k] for k in (*_RUN_AS, *_POD_SECURITY) if k in security},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": key.pod_name,
            "namespace": namespace,
            "labels": {PROBED_LABEL: "true", PREFLIGHT_LABEL: "true", KEY_LABEL: key.hash},
            "annotations": {
                "epguard.io/preflight-image": key.image,
                # A mesh's injector would add a container the chart's policy refuses.
                "sidecar.istio.io/inject": "false",
                "linkerd.io/inject": "disabled",
            },
        },
        "spec": spec,
    }


# A script's variable: $NAME or ${NAME...}.
_SHELL_NAMED = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


def _kubelet_refs(text: str) -> Iterator[str]:
    """The names of the kubelet's ``$(NAME)`` references in ``text`` (any characters up
    to the ``)``, as the kubelet and argv.expand read them; ``$$`` is an escaped ``$``).
    Linear: each search starts past the last."""
    i = 0
    while (j := text.find("$", i)) >= 0 and j + 1 < len(text):
        if text[j + 1] == "$":
            i = j + 2
        elif text[j + 1] == "(":
            close = text.find(")", j + 2)
            if close < 0:
                return
            yield text[j + 2 : close]
            i = close + 1
        else:
            i = j + 1


def _literal_env(probe: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The probe's env entries without ``valueFrom`` that its argv names, and those that a
    kept entry's value names in turn, to the end of the chain: what admission read the
    flag from (an entry with no value is the empty string, as the kubelet sets it). Every
    entry of a name is kept (Kubernetes allows a name twice; the last wins, as in the
    worker), in the worker's order. Injection renamed each ``X`` to ``EPGUARD_POD_X`` and
    each ``$(X)`` to ``$(EPGUARD_POD_X)``; a script's ``$X`` is read under the old name
    (probe/sandbox.py). Not every entry: a worker's other values (a 1 MB config in one)
    would make the preflight larger than MAX_PREFLIGHT_BYTES for nothing. Each text is
    scanned once."""
    command = as_list(probe.get("command"))
    after = command.index("--") + 1 if "--" in command else len(command)
    entries = [
        e
        for e in as_list(probe.get("env"))
        if isinstance(e, Mapping)
        and "valueFrom" not in e
        and isinstance(e.get("name"), str)
        and (e.get("value") is None or isinstance(e.get("value"), str))
    ]
    renamed: dict[str, list[Mapping[str, Any]]] = {}  # by the name $(…) now names
    scripts: dict[str, list[Mapping[str, Any]]] = {}  # by the worker's own name
    for e in entries:
        name = str(e["name"])
        renamed.setdefault(name, []).append(e)
        if name.startswith(POD_PREFIX):
            scripts.setdefault(name[len(POD_PREFIX) :], []).append(e)
    wanted: set[int] = set()
    todo = [str(w) for w in command[after:]]
    while todo:
        text = todo.pop()
        named = [renamed.get(n, []) for n in _kubelet_refs(text)]
        named += [scripts.get(n, []) for n in _SHELL_NAMED.findall(text)]
        for group in named:
            for entry in group:
                if id(entry) not in wanted:
                    wanted.add(id(entry))
                    todo.append(str(entry.get("value") or ""))
    return [e for e in entries if id(e) in wanted]


def signed(pod: Mapping[str, Any], key: Key, now: dt.datetime) -> dict[str, Any]:
    """The preflight pod with its signature, as ``/mutate`` signs an injected pod: the
    recorder learns from it only while the signature verifies, once."""
    meta = dict(as_map(pod.get("metadata")))
    namespace = str(meta.get("namespace", ""))
    annotations = dict(as_map(meta.get("annotations")))
    annotations[SIGNATURE_ANNOTATION] = sign(key, namespace, pod, now)
    return {**pod, "metadata": {**meta, "annotations": annotations}}


def _done_container(settings: InjectionSettings) -> dict[str, Any]:
    return {
        "name": DONE_CONTAINER,
        "image": settings.epguard_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["python3", "-c", "pass"],
        "resources": {
            "requests": {"cpu": "10m", "memory": "16Mi"},
            "limits": {"cpu": "100m", "memory": "32Mi"},
        },
        "securityContext": {
            **_CONFINED,
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "readOnlyRootFilesystem": True,
        },
    }


# What a preflight came to: still running; nothing proven in the files (the gate comes
# off); an image cause (the gate stays, the recorder records the verdict); or it could
# not judge (pull error, unschedulable, deadline, no python3: preflight.onError decides).
# "gone": the preflight cannot be created because its namespace is being deleted.
Phase = Literal["running", "clear", "unusable", "failed", "gone"]
MAX_MESSAGE = 1024  # a pod condition's message is read in `kubectl describe pod`


@dataclass(frozen=True, slots=True)
class PreflightResult:
    phase: Phase
    message: str  # the probe's first line, or why the preflight could not judge
    stalled: str = ""  # while running: what it waits on (an image pull error, a scheduler)


def _waiting(statuses: Iterable[Any]) -> str:
    for status in statuses:
        waiting = as_map(as_map(as_map(status).get("state")).get("waiting"))
        reason = waiting.get("reason")
        if isinstance(reason, str) and reason not in ("PodInitializing", "ContainerCreating"):
            said = waiting.get("message")
            detail = f": {said}" if isinstance(said, str) and said else ""
            return f"container {as_map(status).get('name')} is waiting: {reason}{detail}"
    return ""


def _unschedulable(status: Mapping[str, Any]) -> str:
    for c in as_list(status.get("conditions")):
        c = as_map(c)
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return f"not scheduled: {c.get('reason') or ''} {c.get('message') or ''}".strip()
    return ""


# Why the cluster, not the image, stopped a preflight: the kubelet evicted it (node
# pressure: its own pull of a large image can cause disk pressure) or rejected it, the
# scheduler preempted it, its node shut down. No answer about the image: made again.
_DISRUPTED = ("Evicted", "Preempting", "Terminated", "Shutdown", "NodeShutdown",
              "NodeAffinity", "UnexpectedAdmissionError")  # fmt: skip


def disruption(pod: Mapping[str, Any]) -> str:
    """Why the cluster stopped this pod before it could answer ("" when it did not):
    a ``DisruptionTarget`` condition, or a Failed phase for one of those reasons."""
    status = as_map(pod.get("status"))
    for c in map(as_map, as_list(status.get("conditions"))):
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            return cut(f"{c.get('reason') or 'DisruptionTarget'}: {c.get('message') or ''}", 200)
    reason = status.get("reason")
    failed = status.get("phase") == "Failed" and isinstance(reason, str)
    if failed and (reason in _DISRUPTED or str(reason).startswith("OutOf")):
        return cut(f"{reason}: {status.get('message') or ''}", 200)
    return ""


def shaped_as_preflight(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod`` is built as :func:`preflight_pod` builds one: named after its key
    label, with a probe that judges files only (``--files-only`` among the probe's own
    options, which the signature binds). An injected worker carries a signed probe too,
    with ``--level``: a tenant that labelled its running workers as preflights made the
    controller take them for its own (read in every pass, an answer run at each end)."""
    m = as_map(pod.get("metadata"))
    key = as_map(m.get("labels")).get(KEY_LABEL)
    if not isinstance(key, str) or m.get("name") != NAME_PREFIX + key:
        return False
    for c in as_list(as_map(pod.get("spec")).get("initContainers")):
        if isinstance(c, Mapping) and c.get("name") == PROBE_CONTAINER:
            words = [str(w) for w in as_list(c.get("command"))]
            own = words[: words.index("--")] if "--" in words else words
            return "--files-only" in own
    return False


# The kubelet keeps at most this much of a container's termination message.
_TERMINATION_MESSAGE = 4096
# A preflight has three containers; a status that lists more is none of the kubelet's.
_STATUSES = 8
_STATE_FIELDS = {"terminated": ("exitCode", "reason", "finishedAt"), "waiting": ("reason",)}


def _container_status(status: Mapping[str, Any]) -> dict[str, Any]:
    state = as_map(status.get("state"))
    kept: dict[str, Any] = {}
    for name, fields in _STATE_FIELDS.items():
        if name not in state:
            continue
        part = as_map(state[name])
        kept[name] = {f: part[f] for f in fields if f in part}
        said = part.get("message")
        if isinstance(said, str):
            probe = name == "terminated" and status.get("name") == PROBE_CONTAINER
            kept[name]["message"] = cut(said, _TERMINATION_MESSAGE if probe else MAX_MESSAGE)
    return {"name": status.get("name"), "state": kept}


def preflight_status(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`preflight_result`, :func:`disruption` and the end of a preflight
    (``finishedAt``) read of its status, each text cut: what a controller keeps of every
    preflight it lists. The whole status, kept for each retained preflight, was ~38 KB
    with a long image reference (a review helper's measure), and the API server serves
    every one of them to each pass."""
    status = as_map(pod.get("status"))
    kept: dict[str, Any] = {}
    for field in ("phase", "reason", "message"):
        if isinstance(status.get(field), str):
            kept[field] = cut(status[field], MAX_MESSAGE)
    conditions = [
        {k: cut(c[k], MAX_MESSAGE) if isinstance(c.get(k), str) else None
         for k in ("type", "status", "reason", "message")}
        for c in map(as_map, as_list(status.get("conditions")))
        if (c.get("type"), c.get("status")) in (("PodScheduled", "False"),
                                                ("DisruptionTarget", "True"))
    ]  # fmt: skip
    if conditions:
        kept["conditions"] = conditions[:_STATUSES]
    for part in ("initContainerStatuses", "containerStatuses"):
        statuses = as_list(status.get(part))[:_STATUSES]
        if statuses:
            kept[part] = [_container_status(as_map(s)) for s in statuses]
    return kept


def preflight_result(
    pod: Mapping[str, Any], now: dt.datetime, timeout_seconds: int
) -> PreflightResult:
    """What a preflight pod's status says, at ``now``. The deadline is counted from the
    pod's creation, since the kubelet's ``activeDeadlineSeconds`` never starts for a pod
    that is not scheduled or whose image is never pulled."""
    status = as_map(pod.get("status"))
    inits = [as_map(s) for s in as_list(status.get("initContainerStatuses"))]
    probe = next((s for s in inits if s.get("name") == PROBE_CONTAINER), None)
    terminated = as_map(as_map(probe.get("state")).get("terminated")) if probe else {}
    code = terminated.get("exitCode")
    if isinstance(code, int):
        said = terminated.get("message")
        message = said if isinstance(said, str) else ""
        line = cut(first_line(message), MAX_MESSAGE)
        if code == 0:
            return PreflightResult("clear", line or "the preflight's probe passed")
        if classify(message, code) == ("Unusable", "image"):
            return PreflightResult("unusable", line)
        why = line or str(terminated.get("reason") or "no message")
        return PreflightResult(
            "failed", cut(f"the preflight's probe ended with exit code {code}: {why}", MAX_MESSAGE)
        )
    if status.get("phase") == "Failed":
        why = f"{status.get('reason') or 'Failed'}: {status.get('message') or ''}".strip(": ")
        return PreflightResult("failed", cut(f"the preflight pod failed ({why})", MAX_MESSAGE))
    stalled = cut(_waiting(inits) or _unschedulable(status), MAX_MESSAGE)
    created = created_at(pod)
    if created is not None and (now - created).total_seconds() > timeout_seconds:
        why = f" ({stalled})" if stalled else ""
        return PreflightResult(
            "failed",
            cut(f"the preflight did not finish within {timeout_seconds} s{why}", MAX_MESSAGE),
        )
    return PreflightResult("running", "", stalled)
