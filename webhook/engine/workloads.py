"""Where the pod templates are, for every object kind epguard judges.

Objects arrive as raw JSON from the API server (or from a user's YAML in the
CLI), and CRDs in particular may be half-filled or wrong-typed. Every accessor
here tolerates that: a field of the wrong type is treated as absent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml

ContainerKind = Literal["initContainer", "container", "ephemeralContainer"]

APPS = "apps"
BATCH = "batch"
CORE = ""
LWS = "leaderworkerset.x-k8s.io"
DYNAMO = "nvidia.com"
RBG = "workloads.x-k8s.io"
DISAGG = "disaggregatedset.x-k8s.io"
OME = "ome.io"

Shape = Literal["template", "podSpec", "container"]
SHAPES: tuple[Shape, ...] = ("template", "podSpec", "container")
_SEGMENT = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*(?:\[\])?|\*)$")
# A path is read with a budget: a hostile CRD object with a million list items cannot
# make the walk itself expensive.
MAX_VISITS = 10_000


class TooManyPlaces(ValueError):
    """An object whose paths reach more than MAX_VISITS values: not read, and never taken
    for one without pods (policy.decide answers it by mode)."""


class KindError(ValueError):
    """An admin-defined kind that cannot be used (named field and reason)."""


@dataclass(frozen=True, slots=True)
class TemplatePath:
    """Where pods hide in an object: ``spec.roles[].template`` (a pod template),
    ``spec.services.*.extraPodSpec`` (a pod spec), ``….runner`` (one container).

    ``name[]`` is every item of a list, ``*`` every value of a map."""

    path: str
    shape: Shape

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise KindError(f"shape must be one of {', '.join(SHAPES)}, not {self.shape!r}")
        segments = self.path.split(".")
        if not self.path or not all(_SEGMENT.match(s) for s in segments):
            raise KindError(
                f"path {self.path!r}: expected dotted field names, 'name[]' for every "
                "item of a list and '*' for every value of a map"
            )

    def walk(self, obj: Any) -> Iterator[tuple[str, Any]]:
        """(where, value) for every value the path reaches in ``obj``."""
        found: list[tuple[str, Any]] = [("", obj)]
        visits = 0
        for seg in self.path.split("."):
            nxt: list[tuple[str, Any]] = []
            for where, value in found:
                visits += 1
                if visits > MAX_VISITS:
                    raise TooManyPlaces(
                        f"its path {self.path} reaches more than {MAX_VISITS} values"
                    )
                m = as_map(value)
                if seg == "*":
                    nxt.extend((f"{where}.{k}", v) for k, v in m.items() if isinstance(k, str))
                elif seg.endswith("[]"):
                    name = seg[:-2]
                    for i, item in enumerate(as_list(m.get(name))):
                        label = as_map(item).get("name")
                        tag = label if isinstance(label, str) and label else str(i)
                        nxt.append((f"{where}.{name}[{tag}]", item))
                elif seg in m:
                    nxt.append((f"{where}.{seg}", m[seg]))
            found = nxt
        yield from ((w.lstrip("."), v) for w, v in found)


@dataclass(frozen=True, slots=True)
class KindSpec:
    group: str
    kind: str
    versions: tuple[str, ...]
    resource: str
    paths: tuple[TemplatePath, ...]

    @classmethod
    def from_value(cls, raw: Any, where: str = "extraKinds") -> KindSpec:
        """One admin-defined kind, as the chart value ``webhook.extraKinds`` holds it."""
        m = as_map(raw)
        if not m:
            raise KindError(f"{where}: expected a mapping")

        def text(key: str) -> str:
            v = m.get(key)
            if not isinstance(v, str) or not v:
                raise KindError(f"{where}.{key}: expected a non-empty string")
            return v

        group = m.get("group")
        if not isinstance(group, str):
            raise KindError(f'{where}.group: expected a string ("" for the core group)')
        versions = m.get("versions")
        if (
            not isinstance(versions, list)
            or not versions
            or not all(isinstance(v, str) and v for v in versions)
        ):
            raise KindError(f"{where}.versions: expected a non-empty list of strings")
        paths: list[TemplatePath] = []
        for shape in SHAPES:
            entries = m.get(shape + "s", [])
            if not isinstance(entries, list) or not all(isinstance(p, str) for p in entries):
                raise KindError(f"{where}.{shape}s: expected a list of paths")
            try:
                paths.extend(TemplatePath(p, shape) for p in entries)
            except KindError as exc:
                raise KindError(f"{where}.{shape}s: {exc}") from None
        if not paths:
            raise KindError(f"{where}: give at least one of templates, podSpecs, containers")
        scope = m.get("scope", "Namespaced")
        if scope not in ("Namespaced", "Cluster"):
            raise KindError(f"{where}.scope: expected Namespaced or Cluster, not {scope!r}")
        return cls(group, text("kind"), tuple(versions), text("resource"), tuple(paths))


def parse_kinds(text: str, where: str) -> tuple[KindSpec, ...]:
    """Admin-defined kinds from JSON or YAML text (a list of KindSpec values)."""
    try:
        raw = yaml.safe_load(text)  # JSON is YAML too
    except yaml.YAMLError as exc:
        raise KindError(f"{where}: not valid JSON or YAML: {exc}") from None
    if not isinstance(raw, list):
        raise KindError(f"{where}: expected a list of kinds")
    kinds = tuple(KindSpec.from_value(k, f"{where}[{i}]") for i, k in enumerate(raw))
    builtin = [k for k in kinds if (k.group, k.kind) in KNOWN_KINDS]
    if builtin:
        raise KindError(f"{where}: {builtin[0].kind} ({builtin[0].group}) is built in already")
    # One entry a resource: the chart names its webhook after the resource (two entries,
    # say one a version, made two webhooks of one name, which the API server refuses).
    seen: set[tuple[str, str]] = set()
    for i, k in enumerate(kinds):
        if (k.group, k.resource) in seen:
            raise KindError(
                f"{where}[{i}]: {k.resource} ({k.group or 'core'}) is listed twice: give one "
                "entry with every version in its versions"
            )
        seen.add((k.group, k.resource))
    return kinds


def _kind(
    group: str, kind: str, resource: str, versions: tuple[str, ...], **paths: tuple[str, ...]
) -> KindSpec:
    out = [TemplatePath(p, shape) for shape in SHAPES for p in paths.get(shape + "s", ())]
    return KindSpec(group, kind, versions, resource, tuple(out))


# Workload kinds epguard knows out of the box. Pod, CronJob, LeaderWorkerSet, Dynamo and
# RoleBasedGroup have their own readers below; the rest is described by paths, the same
# way an admin describes a kind of their own. The chart's webhook rules list the same
# kinds (tests/chart checks that they agree).
# OME runtimes: the engine's containers are "runner" objects, not a pod spec (leader and
# worker runners for multi-node), with ordinary pod-spec lists beside them.
_OME_PLACES = tuple(
    f"spec.{c}{p}"
    for c in ("engineConfig", "decoderConfig", "routerConfig")
    for p in ("", ".leader", ".worker")
)
_OME = {"containers": tuple(f"{p}.runner" for p in _OME_PLACES), "podSpecs": _OME_PLACES}
PATH_KINDS: tuple[KindSpec, ...] = (
    _kind(
        DISAGG,
        "DisaggregatedSet",
        "disaggregatedsets",
        ("v1",),
        templates=(
            "spec.roles[].spec.leaderWorkerTemplate.leaderTemplate",
            "spec.roles[].spec.leaderWorkerTemplate.workerTemplate",
        ),
    ),
    _kind(OME, "ServingRuntime", "servingruntimes", ("v1beta1",), **_OME),
    _kind(OME, "ClusterServingRuntime", "clusterservingruntimes", ("v1beta1",), **_OME),
)

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
        (RBG, "RoleBasedGroup"),
        *((k.group, k.kind) for k in PATH_KINDS),
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


def as_mapping(value: Any) -> Mapping[str, Any]:
    """:func:`as_map` for any Mapping: kopf hands its handlers and filters a ``Body``, a
    Mapping view (not a dict) whose items are the raw dicts, in which as_map sees
    nothing."""
    return value if isinstance(value, Mapping) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def annotations_of(obj: Any) -> Mapping[str, str]:
    ann = as_map(as_map(as_map(obj).get("metadata")).get("annotations"))
    return {k: v for k, v in ann.items() if isinstance(k, str) and isinstance(v, str)}


def describe(kind: str, namespace: str | None, name: str) -> str:
    """An object in logs and messages: ``Kind ns/name``, or ``Kind name`` outside a
    namespace."""
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"


def describe_object(obj: Any) -> str:
    """:func:`describe` for an object as the API server or a manifest gives it."""
    o = as_map(obj)
    meta = as_map(o.get("metadata"))
    kind, namespace = o.get("kind"), meta.get("namespace")
    return describe(
        kind if isinstance(kind, str) else "object",
        namespace if isinstance(namespace, str) else None,
        str(meta.get("name") or meta.get("generateName") or "<unnamed>"),
    )


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


def _by_name(
    base: Any, patch: Any, merge: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
) -> list[Any]:
    """The items of ``patch`` laid over ``base`` by name, as a strategic merge does
    (same-named items merged by ``merge``, others added in order)."""
    merged: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    for i, raw in enumerate([*as_list(base), *as_list(patch)]):
        item = dict(as_map(raw))
        name = item.get("name")
        key = name if isinstance(name, str) and name else f"#{i}"
        if key not in merged:
            order.append(key)
            merged[key] = {}
        merged[key] = merge(merged[key], item)
    return [merged[k] for k in order]


def _merge_container(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A container laid over another field by field; its ``env`` merged by name (a
    patch with its own env kept none of the template's, so a $(VAR) the template set
    was unknown)."""
    out = {**base, **patch}
    if "env" in base and "env" in patch:
        out["env"] = _by_name(base["env"], patch["env"], lambda b, p: {**b, **p})
    return out


def _merge_containers(base: Any, patch: Any) -> list[Any]:
    """Containers of ``patch`` laid over ``base`` by name, as RBG's templateRef does (a
    strategic merge: same-named containers merge field by field, others are added)."""
    return _by_name(base, patch, _merge_container)


def _patched(base: Any, patch: Any) -> dict[str, Any]:
    """A pod template with a patch laid over it (containers merged by name)."""
    b, p = as_map(base), as_map(patch)
    bs, ps = as_map(b.get("spec")), as_map(p.get("spec"))
    spec = {**bs, **ps}
    for field in ("containers", "initContainers"):
        if field in bs or field in ps:
            spec[field] = _merge_containers(bs.get(field), ps.get(field))
    meta = {**as_map(b.get("metadata")), **as_map(p.get("metadata"))}
    return {"metadata": meta, "spec": spec}


def _rbg_templates(spec: Mapping[str, Any]) -> Iterator[PodTemplateView | None]:
    """RoleBasedGroup (SGLang's own). v1alpha1: ``roles[].template``, or a
    ``templateRef`` to ``roleTemplates[]`` with the role's ``templatePatch``; then
    ``leaderWorkerSet.patchLeaderTemplate`` / ``patchWorkerTemplate`` on top;
    ``components[].template``; engineRuntimes sidecars. v1alpha2:
    ``standalonePattern`` / ``leaderWorkerPattern`` with a ``template`` or a
    ``templateRef`` plus its ``patch``, and leader/worker patches on top;
    ``customComponentsPattern.components[].template``. The image often sits in the role
    template and the command in a patch, so they are merged before judging."""
    shared: dict[str, Any] = {}
    for t in as_list(spec.get("roleTemplates")):
        name = as_map(t).get("name")
        if isinstance(name, str):
            shared[name] = as_map(t).get("template")

    def referenced(holder: Mapping[str, Any], patch: Any) -> Any:
        ref_name = as_map(holder.get("templateRef")).get("name")
        return _patched(shared.get(ref_name) if isinstance(ref_name, str) else None, patch)

    for i, role in enumerate(as_list(spec.get("roles"))):
        r = as_map(role)
        label = r.get("name") if isinstance(r.get("name"), str) else str(i)
        where = f"spec.roles[{label}]"
        base: Any = r.get("template")
        yield _template(f"{where}.template", base)
        if r.get("templateRef") or r.get("templatePatch"):
            base = referenced(r, r.get("templatePatch"))
            yield _template(f"{where}.templateRef", base)
        lws = as_map(r.get("leaderWorkerSet"))
        for side in ("patchLeaderTemplate", "patchWorkerTemplate"):
            if side in lws:
                yield _template(f"{where}.leaderWorkerSet.{side}", _patched(base, lws.get(side)))
        for j, runtime in enumerate(as_list(r.get("engineRuntimes"))):
            containers = tuple(_containers(as_map(runtime)))
            if containers:
                yield PodTemplateView(f"{where}.engineRuntimes[{j}]", {}, containers)
        components = [
            (f"{where}.components", as_list(r.get("components"))),
            (
                f"{where}.customComponentsPattern.components",
                as_list(as_map(r.get("customComponentsPattern")).get("components")),
            ),
        ]
        for at, items in components:
            for j, component in enumerate(items):
                yield _template(f"{at}[{j}]", as_map(component).get("template"))
        for pattern in ("standalonePattern", "leaderWorkerPattern"):
            pat = as_map(r.get(pattern))
            if not pat:
                continue
            base = pat.get("template")
            if pat.get("templateRef"):
                base = referenced(pat, as_map(pat.get("templateRef")).get("patch"))
            yield _template(f"{where}.{pattern}", base)
            for side in ("leaderTemplatePatch", "workerTemplatePatch"):
                if side in pat:
                    yield _template(f"{where}.{pattern}.{side}", _patched(base, pat.get(side)))


def _path_templates(spec: KindSpec, obj: Any) -> Iterator[PodTemplateView | None]:
    for path in spec.paths:
        for where, value in path.walk(obj):
            if path.shape == "template":
                yield _template(where, value)
            elif path.shape == "podSpec":
                containers = tuple(_containers(as_map(value)))
                if containers:
                    yield PodTemplateView(where, {}, containers)
            elif isinstance(value, dict):
                name = value.get("name")
                label = name if isinstance(name, str) and name else where.rsplit(".", 1)[-1]
                yield PodTemplateView(where, {}, (ContainerView(label, "container", value),))


class KindRegistry:
    """The kinds one webhook (or one ``epguard check``) judges: the built-in ones plus
    those an admin added (chart value ``webhook.extraKinds``)."""

    def __init__(self, extra: Sequence[KindSpec] = ()) -> None:
        self.extra = tuple(extra)
        self._by_key = {(k.group, k.kind): k for k in (*PATH_KINDS, *self.extra)}
        self.keys = KNOWN_KINDS | frozenset(self._by_key)

    def knows(self, group: str, kind: str) -> bool:
        return (group, kind) in self.keys

    def pod_templates(self, group: str, kind: str, obj: Any) -> list[PodTemplateView] | None:
        """The pods an object describes, or None when epguard does not judge this kind."""
        spec = self._by_key.get((group, kind))
        if spec is not None:
            return [v for v in _path_templates(spec, obj) if v is not None]
        return pod_templates(group, kind, obj)


BUILTIN = KindRegistry()


def pod_templates(group: str, kind: str, obj: Any) -> list[PodTemplateView] | None:
    """The pods an object of a built-in kind describes, or None for any other kind."""
    if (group, kind) not in KNOWN_KINDS:
        return None
    o = as_map(obj)
    spec = as_map(o.get("spec"))
    views: list[PodTemplateView | None]
    path_kind = next((k for k in PATH_KINDS if (k.group, k.kind) == (group, kind)), None)
    if path_kind is not None:
        views = list(_path_templates(path_kind, o))
    elif kind == "Pod":
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
    elif kind == "RoleBasedGroup":
        views = list(_rbg_templates(spec))
    else:
        views = [_template("spec.template", spec.get("template"))]
    return [v for v in views if v is not None]
