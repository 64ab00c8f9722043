"""Where the pod templates are, for every object kind epguard judges.

Objects arrive as raw JSON from the API server (or from a user's YAML in the
CLI), and CRDs in particular may be half-filled or wrong-typed. Every accessor
here tolerates that: a field of the wrong type is treated as absent.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

ContainerKind = Literal["initContainer", "container", "ephemeralContainer"]

APPS = "apps"
BATCH = "batch"
CORE = ""
LWS = "leaderworkerset.x-k8s.io"
DYNAMO = "nvidia.com"

# (group, kind) → how to find the templates. Versions are not part of the key:
# the template paths did not move between the versions in use.
KNOWN_KINDS: frozenset[tuple[str, str]] = frozenset(
    {
        (CORE, "Pod"),
        (CORE, "PodTemplate"),
        (CORE, "ReplicationController"),
        (APPS, "Deployment"),
        (APPS, "StatefulSet"),
        (APPS, "DaemonSet"),
        (APPS, "ReplicaSet"),
        (BATCH, "Job"),
        (BATCH, "CronJob"),
        (LWS, "LeaderWorkerSet"),
        (DYNAMO, "DynamoGraphDeployment"),
    }
)


@dataclass(frozen=True, slots=True)
class ContainerView:
    name: str
    kind: ContainerKind
    raw: Mapping[str, Any]

    @property
    def image(self) -> str | None:
        image = self.raw.get("image")
        return image if isinstance(image, str) else None


@dataclass(frozen=True, slots=True)
class PodTemplateView:
    """One pod (template) inside an object. ``where`` is empty for a bare Pod."""

    where: str
    annotations: Mapping[str, str]
    containers: tuple[ContainerView, ...]


def as_map(value: Any) -> Mapping[str, Any]:
    # JSON and YAML give plain dicts; isinstance(dict) is far cheaper than the Mapping ABC.
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def annotations_of(obj: Any) -> Mapping[str, str]:
    ann = as_map(as_map(as_map(obj).get("metadata")).get("annotations"))
    return {k: v for k, v in ann.items() if isinstance(k, str) and isinstance(v, str)}


def group_of(api_version: Any) -> str:
    if not isinstance(api_version, str) or "/" not in api_version:
        return CORE
    return api_version.split("/", 1)[0]


def _containers(spec: Mapping[str, Any]) -> Iterator[ContainerView]:
    fields: tuple[tuple[str, ContainerKind], ...] = (
        ("initContainers", "initContainer"),
        ("containers", "container"),
        ("ephemeralContainers", "ephemeralContainer"),
    )
    for field, kind in fields:
        for index, c in enumerate(as_list(spec.get(field))):
            if not isinstance(c, dict):
                continue
            name = c.get("name")
            yield ContainerView(
                name=name if isinstance(name, str) and name else f"{field}[{index}]",
                kind=kind,
                raw=c,
            )


def _template(where: str, template: Any) -> PodTemplateView | None:
    t = as_map(template)
    if not t:
        return None
    return PodTemplateView(
        where=where,
        annotations=annotations_of(t),
        containers=tuple(_containers(as_map(t.get("spec")))),
    )


def _dynamo_templates(spec: Mapping[str, Any]) -> Iterator[PodTemplateView]:
    # v1alpha1: spec.services.<name>.extraPodSpec is a PodSpec plus "mainContainer",
    # the engine container, which the operator names "main".
    for svc_name, svc in as_map(spec.get("services")).items():
        extra = as_map(as_map(svc).get("extraPodSpec"))
        if not extra:
            continue
        containers = list(_containers(extra))
        main = extra.get("mainContainer")
        if isinstance(main, dict):
            name = main.get("name")
            containers.append(
                ContainerView(
                    name=name if isinstance(name, str) and name else "main",
                    kind="container",
                    raw=main,
                )
            )
        yield PodTemplateView(
            where=f"spec.services.{svc_name}.extraPodSpec",
            annotations=annotations_of(svc),
            containers=tuple(containers),
        )
    # v1beta1 (storage version from Dynamo 1.5): spec.components[] with podTemplate.
    for index, comp in enumerate(as_list(spec.get("components"))):
        comp_map = as_map(comp)
        label = comp_map.get("name")
        label = label if isinstance(label, str) and label else str(index)
        view = _template(f"spec.components[{label}].podTemplate", comp_map.get("podTemplate"))
        if view is not None:
            yield view


def pod_templates(group: str, kind: str, obj: Any) -> list[PodTemplateView] | None:
    """The pods an object describes, or None when epguard does not judge this kind."""
    if (group, kind) not in KNOWN_KINDS:
        return None
    o = as_map(obj)
    spec = as_map(o.get("spec"))
    views: list[PodTemplateView | None]
    if kind == "Pod":
        views = [
            PodTemplateView(
                where="", annotations=annotations_of(o), containers=tuple(_containers(spec))
            )
        ]
    elif kind == "PodTemplate":
        views = [_template("template", o.get("template"))]
    elif kind == "CronJob":
        job_spec = as_map(as_map(spec.get("jobTemplate")).get("spec"))
        views = [_template("spec.jobTemplate.spec.template", job_spec.get("template"))]
    elif kind == "LeaderWorkerSet":
        lwt = as_map(spec.get("leaderWorkerTemplate"))
        views = [
            _template("spec.leaderWorkerTemplate.leaderTemplate", lwt.get("leaderTemplate")),
            _template("spec.leaderWorkerTemplate.workerTemplate", lwt.get("workerTemplate")),
        ]
    elif kind == "DynamoGraphDeployment":
        views = list(_dynamo_templates(spec))
    else:
        views = [_template("spec.template", spec.get("template"))]
    return [v for v in views if v is not None]
