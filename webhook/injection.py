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
* ``env`` and ``envFrom``: CUDA/NCCL/``MC_*``/``MOONCAKE_*`` settings change what loads,
  and the kubelet expands ``$(VAR)`` in the copied argv from the same variables only if
  they exist in this container too. The probe never prints a variable's value;
* ``securityContext`` and ``imagePullPolicy``: the image may only work as its own user.

Nothing else (volume mounts in particular) is copied: the probe needs no model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from probe import shell
from probe.cli import PROBE_LEVELS
from webhook.argv import analyse_container
from webhook.outcome import COPY_CONTAINER, PROBE_CONTAINER, PROBED_LABEL, is_probe
from webhook.workloads import as_list, as_map

COPY_UID = 65532  # the epguard image's user (Dockerfile)
VOLUME = "epguard-probe"
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


@dataclass(frozen=True, slots=True)
class Injection:
    patch: list[dict[str, Any]]
    probes: tuple[str, ...]  # names of the probe containers added

    @property
    def changed(self) -> bool:
        return bool(self.patch)


NO_CHANGE = Injection(patch=[], probes=())


def _extended(resources: Any) -> dict[str, dict[str, Any]]:
    """Only the extended resources (names with a '/'), e.g. nvidia.com/gpu, rdma/hca."""
    out: dict[str, dict[str, Any]] = {}
    for section in ("limits", "requests"):
        values = {k: v for k, v in as_map(as_map(resources).get(section)).items() if "/" in str(k)}
        if values:
            out[section] = values
    return out


def _probe_name(worker: str, many: bool) -> str:
    return PROBE_CONTAINER if not many else f"{PROBE_CONTAINER}-{worker}"[:MAX_NAME].rstrip("-")


def _probe_container(
    worker: Mapping[str, Any], name: str, settings: InjectionSettings
) -> dict[str, Any]:
    argv = [str(a) for a in as_list(worker.get("command")) + as_list(worker.get("args"))]
    resources = _extended(worker.get("resources"))
    resources.setdefault("requests", {}).update({"cpu": "100m", "memory": "512Mi"})
    resources.setdefault("limits", {}).setdefault("memory", "4Gi")
    container: dict[str, Any] = {
        "name": name,
        "image": worker.get("image"),
        "command": [
            "python3",
            f"{settings.mount_path}/probe",
            "--termination-log",
            "/dev/termination-log",
            "--level",
            settings.level,
            "--",
            *argv,
        ],
        "resources": resources,
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": VOLUME, "mountPath": settings.mount_path, "readOnly": True}],
    }
    for key in ("env", "envFrom", "securityContext", "imagePullPolicy"):
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
        "resources": {
            "requests": {"cpu": "10m", "memory": "32Mi"},
            "limits": {"memory": "64Mi"},
        },
        "volumeMounts": [{"name": VOLUME, "mountPath": settings.mount_path}],
        # Its own user, always: a worker pod often runs as root (pod-level runAsUser: 0),
        # which runAsNonRoot alone would refuse to start.
        "securityContext": {
            "runAsUser": COPY_UID,
            "runAsGroup": COPY_UID,
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def plan(pod_spec: Any, settings: InjectionSettings, path: str = "/spec") -> Injection:
    """The patch for one pod spec (``path`` points at it: ``/spec/template/spec`` …).

    Idempotent: a spec that already carries a probe is left alone, so reinvocation
    and UPDATEs change nothing. A spec that does not ask for mooncake is never touched.
    """
    spec = as_map(pod_spec)
    inits = [c for c in as_list(spec.get("initContainers")) if isinstance(c, Mapping)]
    if any(is_probe(c) for c in inits):
        return NO_CHANGE
    budget = shell.Budget()
    workers = [
        c
        for c in as_list(spec.get("containers"))
        if isinstance(c, Mapping)
        and analyse_container(c, budget).requests_mooncake
        and c.get("image")
    ]
    if not workers:
        return NO_CHANGE
    many = len(workers) > 1
    probes = [_probe_container(w, _probe_name(str(w.get("name")), many), settings) for w in workers]
    volumes = [v for v in as_list(spec.get("volumes")) if isinstance(v, Mapping)]
    patch: list[dict[str, Any]] = [
        {
            "op": "add",
            "path": f"{path}/initContainers",
            "value": [_copy_container(settings), *probes, *inits],
        }
    ]
    if not any(v.get("name") == VOLUME for v in volumes):
        patch.append(
            {
                "op": "add",
                "path": f"{path}/volumes",
                "value": [*volumes, {"name": VOLUME, "emptyDir": {"sizeLimit": "16Mi"}}],
            }
        )
    return Injection(patch=patch, probes=tuple(p["name"] for p in probes))


def label_patch(metadata: Any) -> dict[str, Any]:
    """The op that labels the pod ``epguard.io/probed=true``, so the controller can watch
    probed pods alone. JSON patch cannot add to a map that is absent, hence two shapes."""
    labels = as_map(as_map(metadata).get("labels"))
    if not labels:
        return {"op": "add", "path": "/metadata/labels", "value": {PROBED_LABEL: "true"}}
    # RFC 6901: "/" inside a key is written "~1".
    return {
        "op": "add",
        "path": "/metadata/labels/" + PROBED_LABEL.replace("/", "~1"),
        "value": "true",
    }
