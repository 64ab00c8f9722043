"""Probe injection: the JSON patch that puts the epguard probe first in a worker pod.

For every container that asks for ``--elastic-ep-backend mooncake`` the pod gets:

1. ``epguard-copy-probe`` (once): the epguard image copies the probe's files into a
   shared ``emptyDir``, so no namespace needs a ConfigMap or any other set-up;
2. ``epguard-probe[-<worker>]``: the *worker's own image* runs
   ``python3 /epguard/probe … -- <the worker's command and args>``.

Both go before every existing init container, so a failing probe stops the pod before
any model-download init container starts pulling weights.

What the probe container inherits from its worker, and why:

* extended resources (``nvidia.com/gpu``, ``rdma/…``): an init container only gets the
  NVIDIA driver libraries (``libcuda.so.1``) mounted when it requests GPUs; init
  containers' requests are max'ed with the app containers', so this costs no extra
  GPUs — the device plugin hands the same ones to the worker afterwards;
* ``env`` and ``envFrom``, **renamed** under ``EPGUARD_POD_`` (``probe.sandbox.POD_PREFIX``;
  ``envFrom`` gets the prefix, ``$(VAR)`` references to renamed variables in the argv and
  in other values are rewritten so the kubelet still expands them). The probe itself,
  its interpreter (``python3`` found through the image's own ``PATH``) and its verdict
  about the image therefore depend only on the image: a pod cannot steer the image's
  verdict with ``PATH``, ``HOME``, ``CUDA_HOME``, ``MOONCAKE_PG_JIT_DIR`` … The probe
  then checks again with the worker's variables restored, and a failure only they cause
  is an environment cause of this pod (probe/sandbox.py). The probe never prints a
  variable's value;
* ``securityContext`` and ``imagePullPolicy``: the image may only work as its own user.

Nothing else (volume mounts in particular) is copied: the probe needs no model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epguard.probe import shell
from epguard.probe.cli import PROBE_LEVELS
from epguard.probe.sandbox import POD_PREFIX
from epguard.webhook.engine.argv import analyse_container
from epguard.webhook.engine.namespaces import PreflightMode
from epguard.webhook.engine.outcome import (
    COPY_CONTAINER,
    PROBE_CALL,
    PROBE_CONTAINER,
    PROBE_VOLUME,
    PROBED_LABEL,
)
from epguard.webhook.engine.signing import SIGNATURE_ANNOTATION, is_epguard_name
from epguard.webhook.engine.workloads import as_list, as_map

COPY_UID = 65532  # the epguard image's user (Dockerfile)
VOLUME = PROBE_VOLUME  # the emptyDir the probe is copied into
MAX_NAME = 63

# Copies the probe directory with the interpreter the epguard image surely has; a
# shell or coreutils may not be there in a distroless build.
_COPY_SCRIPT = "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True)"


@dataclass(frozen=True, slots=True)
class InjectionSettings:
    epguard_image: str
    probe_source: str = "/opt/epguard/probe"
    mount_path: str = "/epguard"
    level: str = PROBE_LEVELS[0]
    image_pull_policy: str = "IfNotPresent"
    # The preflight's probe (engine/preflight.py) judges the image's files only.
    files_only: bool = False
    # Gate a worker on an unjudged image until a preflight judged it (engine/preflight.py);
    # a namespace's epguard.io/preflight label overrides it.
    preflight: PreflightMode = "off"
    # Image pull secrets added to the pod (injection.imagePullSecrets): the registry
    # credentials of epguard_image where the nodes have none. A preflight copies the
    # worker's, so it gets them too.
    pull_secrets: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Injection:
    patch: list[dict[str, Any]]
    probes: tuple[str, ...]  # names of the probe containers added
    # What is signed (webhook/engine/signing.py): the injected init containers and the volume.
    containers: tuple[dict[str, Any], ...] = ()
    volume: dict[str, Any] | None = None
    removed: bool = False  # parts under epguard's names that the spec brought were removed
    spec: dict[str, Any] | None = None  # the pod spec as the patch leaves it (what is signed)
    # The images of the workers that ask for mooncake on their command line, as admission
    # reads it: what a preflight can judge (a worker whose flag's value admission cannot
    # see is probed in the pod, never gated: its image may not be asked for mooncake).
    settled: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.patch)


def _extended(resources: Any) -> dict[str, dict[str, Any]]:
    """Only the extended resources (names with a '/'), e.g. nvidia.com/gpu, rdma/hca."""
    out: dict[str, dict[str, Any]] = {}
    for section in ("limits", "requests"):
        values = {k: v for k, v in as_map(as_map(resources).get(section)).items() if "/" in str(k)}
        if values:
            out[section] = values
    return out


def _probe_name(worker: str, many: bool) -> str:
    """``epguard-probe``, or with several workers ``epguard-probe-<worker>``; a name past
    MAX_NAME ends in 8 hex of the worker's name instead of being cut, so two workers
    whose names share their first 49 characters get two probes (cut, they got one name
    twice, and the API server refused the whole pod as a duplicate)."""
    if not many:
        return PROBE_CONTAINER
    name = f"{PROBE_CONTAINER}-{worker}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(worker.encode()).hexdigest()[:8]
    return f"{name[: MAX_NAME - len(digest) - 1].rstrip('-')}-{digest}"


def _renamed_refs(text: str, names: frozenset[str]) -> str:
    """``text`` with each kubelet reference ``$(NAME)`` to a renamed variable rewritten to
    ``$(EPGUARD_POD_NAME)``; ``$$`` (the kubelet's escape) and other references kept.
    One pass, linear in the text."""
    if "$(" not in text:
        return text
    out: list[str] = []
    i, n = 0, len(text)
    end = -1  # the first ")" at or after the last search (reused: linear, not quadratic)
    longest = max(map(len, names), default=0)
    while i < n:
        if text.startswith("$$", i):
            out.append("$$")
            i += 2
            continue
        if text.startswith("$(", i):
            if end < i + 2:
                end = text.find(")", i + 2)
                if end == -1:
                    out.append(text[i:])
                    break
            if end - i - 2 <= longest and text[i + 2 : end] in names:
                out.append(f"$({POD_PREFIX}{text[i + 2 : end]})")
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def _renamed_env(worker: Mapping[str, Any]) -> tuple[list[Any], list[Any], frozenset[str]]:
    """The worker's ``env`` and ``envFrom`` under POD_PREFIX, and the names renamed."""
    env = [e for e in as_list(worker.get("env")) if isinstance(e, Mapping)]
    names = frozenset(str(e.get("name")) for e in env if isinstance(e.get("name"), str))
    renamed: list[Any] = []
    for e in env:
        item = dict(e)
        item["name"] = f"{POD_PREFIX}{e.get('name')}"
        if isinstance(item.get("value"), str):
            item["value"] = _renamed_refs(item["value"], names)
        renamed.append(item)
    sources: list[Any] = []
    for source in as_list(worker.get("envFrom")):
        if isinstance(source, Mapping):
            item = dict(source)
            item["prefix"] = f"{POD_PREFIX}{source.get('prefix') or ''}"
            sources.append(item)
    return renamed, sources, names


def _probe_container(
    worker: Mapping[str, Any], name: str, settings: InjectionSettings
) -> dict[str, Any]:
    env, env_from, names = _renamed_env(worker)
    argv = [
        _renamed_refs(str(a), names)
        for a in as_list(worker.get("command")) + as_list(worker.get("args"))
    ]
    resources = _extended(worker.get("resources"))
    resources.setdefault("requests", {}).update({"cpu": "100m", "memory": "512Mi"})
    resources.setdefault("limits", {}).setdefault("memory", "4Gi")
    # A namespace's quota on limits.cpu refuses a pod any of whose containers sets none,
    # init containers included, and LimitRange defaults are filled in before webhooks
    # run: the worker's own cpu (its request, else its limit, which is then its request)
    # leaves the pod's effective cpu as it was (an init container counts as the most of
    # them, beside the sum of the others).
    worker_resources = as_map(worker.get("resources"))
    cpu_limit = as_map(worker_resources.get("limits")).get("cpu")
    if cpu_limit is not None:
        resources["limits"]["cpu"] = cpu_limit
        resources["requests"]["cpu"] = as_map(worker_resources.get("requests")).get(
            "cpu", cpu_limit
        )
    container: dict[str, Any] = {
        "name": name,
        "image": worker.get("image"),
        "command": [
            *PROBE_CALL,  # outcome.py; probe/sandbox.py gives the child the image's own env
            f"{settings.mount_path}/probe",
            "--termination-log",
            "/dev/termination-log",
            *(["--files-only"] if settings.files_only else ["--level", settings.level]),
            "--",
            *argv,
        ],
        "resources": resources,
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": VOLUME, "mountPath": settings.mount_path, "readOnly": True}],
    }
    if env:
        container["env"] = env
    if env_from:
        container["envFrom"] = env_from
    for key in ("securityContext", "imagePullPolicy"):
        if worker.get(key):
            container[key] = worker[key]
    return container


def _copy_container(settings: InjectionSettings) -> dict[str, Any]:
    return {
        "name": COPY_CONTAINER,
        "image": settings.epguard_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": [
            "python3",
            "-c",
            _COPY_SCRIPT,
            settings.probe_source,
            f"{settings.mount_path}/probe",
        ],
        # A cpu limit too: a namespace's quota on limits.cpu refuses a pod any of whose
        # containers sets none.
        "resources": {
            "requests": {"cpu": "10m", "memory": "32Mi"},
            "limits": {"cpu": "100m", "memory": "64Mi"},
        },
        "volumeMounts": [{"name": VOLUME, "mountPath": settings.mount_path}],
        # Its own user, always: a worker pod often runs as root (pod-level runAsUser: 0),
        # which runAsNonRoot alone would refuse to start. The runtime's default seccomp
        # profile of its own: restricted PodSecurity refuses a container without one
        # where the pod sets it per container, not for the pod.
        "securityContext": {
            "runAsUser": COPY_UID,
            "runAsGroup": COPY_UID,
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def _set_list(path: str, items: list[Any]) -> dict[str, Any]:
    """Replace a list member (JSON patch ``add`` replaces an existing member), or remove
    it when nothing is left, since an empty list is not what the tenant wrote."""
    if items:
        return {"op": "add", "path": path, "value": items}
    return {"op": "remove", "path": path}


@dataclass(frozen=True, slots=True)
class _Kept:
    """A spec's init containers and volumes without what carries epguard's names."""

    inits: list[Mapping[str, Any]]
    volumes: list[Mapping[str, Any]]
    removed_inits: bool
    removed_volume: bool


def _kept(spec: Mapping[str, Any]) -> _Kept:
    present = [c for c in as_list(spec.get("initContainers")) if isinstance(c, Mapping)]
    inits = [c for c in present if not is_epguard_name(c.get("name"))]
    volumes = [v for v in as_list(spec.get("volumes")) if isinstance(v, Mapping)]
    kept_volumes = [v for v in volumes if v.get("name") != VOLUME]
    return _Kept(inits, kept_volumes, len(inits) != len(present), len(kept_volumes) != len(volumes))


def _removal(kept: _Kept, path: str) -> list[dict[str, Any]]:
    patch: list[dict[str, Any]] = []
    if kept.removed_inits:
        patch.append(_set_list(f"{path}/initContainers", kept.inits))
    if kept.removed_volume:
        patch.append(_set_list(f"{path}/volumes", kept.volumes))
    return patch


def plan_without_probe(pod_spec: Any, path: str = "/spec") -> list[dict[str, Any]]:
    """The ops that remove what a spec carries under epguard's names, if anything (for a
    pod the probe is not injected into)."""
    return _removal(_kept(as_map(pod_spec)), path)


def plan(pod_spec: Any, settings: InjectionSettings, path: str = "/spec") -> Injection:
    """The patch for one pod spec (``path`` points at it: ``/spec/template/spec`` …).

    Everything under epguard's names that the spec already carries (``epguard-*`` init
    containers, an ``epguard-probe`` volume) is removed first and the probe is injected
    afresh: a tenant cannot bring a "probe" of its own, and a reinvocation (after a later
    webhook changed the worker) derives the probe from the worker as it is now. Applying
    the patch twice gives the same spec. A spec that does not ask for mooncake gets only
    the removal, if it needs one; a worker that may ask for it where admission cannot see
    (``ArgvReport.may_request_mooncake``) gets the probe too.
    """
    spec = as_map(pod_spec)
    kept = _kept(spec)
    budget = shell.Budget()
    # The tenant's own init containers too: a worker may run as a native sidecar
    # (restartPolicy: Always), and the probe, first of all, runs before it.
    containers = [c for c in as_list(spec.get("containers")) if isinstance(c, Mapping)]
    reports = [
        (c, analyse_container(c, budget), main)
        for main, group in ((True, containers), (False, kept.inits))
        for c in group
        if c.get("image")
    ]
    workers = [c for c, report, _ in reports if report.may_request_mooncake]
    # The gate and the preflight (gatekeeper.worker_keys, preflight_pod) judge the
    # containers' images only: a worker in an init container is probed, not gated.
    settled = tuple(
        dict.fromkeys(str(c.get("image")) for c, report, main in reports if main and report.worker)
    )
    if not workers:
        patch = _removal(kept, path)
        return Injection(patch=patch, probes=(), removed=bool(patch))
    many = len(workers) > 1
    probes = [_probe_container(w, _probe_name(str(w.get("name")), many), settings) for w in workers]
    injected = (_copy_container(settings), *probes)
    volume = {"name": VOLUME, "emptyDir": {"sizeLimit": "16Mi"}}
    patch = [
        {"op": "add", "path": f"{path}/initContainers", "value": [*injected, *kept.inits]},
        {"op": "add", "path": f"{path}/volumes", "value": [*kept.volumes, volume]},
    ]
    out = {**spec, "initContainers": patch[0]["value"], "volumes": patch[1]["value"]}
    secrets = _with_pull_secrets(spec.get("imagePullSecrets"), settings.pull_secrets)
    if secrets is not None:
        patch.append({"op": "add", "path": f"{path}/imagePullSecrets", "value": secrets})
        out["imagePullSecrets"] = secrets
    return Injection(
        patch=patch,
        probes=tuple(p["name"] for p in probes),
        containers=injected,
        volume=volume,
        removed=kept.removed_inits or kept.removed_volume,
        spec=out,
        settled=settled,
    )


def _with_pull_secrets(current: Any, names: tuple[str, ...]) -> list[Any] | None:
    """The pod's ``imagePullSecrets`` with each of ``names`` it lacks appended (what it
    lists kept as it is, first), or None when it lacks none. Without them, in a namespace
    whose pods pull from the injected image's private registry with a secret, the
    worker's first init container could not be pulled: stuck on its GPU node (and the
    preflight, which copies the worker's secrets, could not judge)."""
    listed = list(as_list(current))
    have = {str(as_map(s).get("name")) for s in listed}
    missing = [{"name": n} for n in names if n not in have]
    return [*listed, *missing] if missing else None


def _map_op(
    metadata: Mapping[str, Any], section: str, key: str, value: str | None
) -> list[dict[str, Any]]:
    """Set (``value``) or remove (None) one key of ``metadata[section]``. JSON patch
    cannot add to a map that is absent, hence the shapes; "/" in a key is "~1"."""
    current = as_map(metadata.get(section))
    path = f"/metadata/{section}/" + key.replace("~", "~0").replace("/", "~1")
    if value is None:
        return [{"op": "remove", "path": path}] if key in current else []
    if current.get(key) == value:
        return []
    if not current:
        return [{"op": "add", "path": f"/metadata/{section}", "value": {key: value}}]
    return [{"op": "add", "path": path, "value": value}]


def metadata_patch(metadata: Any, probed: bool, signature: str | None) -> list[dict[str, Any]]:
    """The pod's ``epguard.io/probed`` label (the controller watches only pods with it)
    and signature annotation: set for a pod the probe was injected into, removed from
    any other pod that carries them."""
    meta = as_map(metadata)
    return [
        *_map_op(meta, "labels", PROBED_LABEL, "true" if probed else None),
        *_map_op(meta, "annotations", SIGNATURE_ANNOTATION, signature if probed else None),
    ]
