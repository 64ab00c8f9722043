"""The outage backstop: what of epguard's judgement a ValidatingAdmissionPolicy can hold.

With ``failurePolicy: Ignore`` (the chart's default: epguard must never block a
cluster), a webhook outage means no protection at all. The API server evaluates a
ValidatingAdmissionPolicy itself, with no network hop, so the controller compiles the
part of the judgement CEL can express exactly into one (``controller/backstop.py``
keeps it in the cluster); the webhook stays the judge of everything else.

**Never stricter than the webhook.** Whatever the policy refuses, the webhook refuses
too, with the same reason, remedy and id. Everything here leans that way: when a form
cannot be read exactly in CEL, the policy leaves it to the webhook.

* Images. A deny rule's glob and an Unusable verdict's tag become regular expressions
  over the image *as written* in the pod (the policy cannot normalize
  ``lmsysorg/sglang`` into ``docker.io/lmsysorg/sglang``, so each spelling the runtime
  accepts is listed); a glob that starts with a wildcard or uses ``[...]``, and a rule
  that pins a digest beside a glob, stay with the webhook. Verdict digests match the
  ``@sha256:…`` the pod pins. Tag verdicts leave the list a minute before the webhook
  stops trusting them (CEL has no clock: the controller removes them).
* Command lines. Only two forms: an argv ``python[3] -m sglang.launch_server …`` or
  ``sglang serve …`` of plain words, and an ``sh -c`` script line of that shape made of
  plain words (no quotes, no ``$(…)``, no redirection, no comment). In both, the flag
  is ``--elastic-ep-backend mooncake`` or ``--elastic-ep-backend=mooncake`` and nothing
  after it starts with ``--el`` (argparse's last value wins, and abbreviations count).
* Only CREATE: the webhook lets an UPDATE keep a problem that was already there; the
  policy cannot compare with the old object as the engine does, and every pod is created.
* Kinds: Pods, and every workload kind described by fixed or ``[]``/``*`` template paths.
  Dynamo and RoleBasedGroup objects (whose templates the engine merges from patches)
  stay with the webhook.

The parameters are one RefusedImageList (a cluster-scoped epguard.io object holding
``data.entries``) the controller rewrites, one line per refused image
(``kind TAB pattern TAB message``), so a new verdict takes effect without touching the
policy. The CEL uses ``flatten()`` (Kubernetes 1.34's list library).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from webhook.imageref import DEFAULT_DOMAIN, LEGACY_DEFAULT_DOMAIN, OFFICIAL_REPO_PREFIX
from webhook.namespaces import MODE_LABEL, MODES, Mode
from webhook.policy import SKIP_ANNOTATION, rule_denial, verdict_denial
from webhook.rules import Rule, RuleSet
from webhook.verdicts import Verdict, VerdictHit, VerdictStore
from webhook.workloads import KindSpec, TemplatePath

FLAG = "--elastic-ep-backend"
PARAMS_KEY = "entries"
# The parameters' kind (the chart's CRD): cluster-scoped, ``data.entries`` as a ConfigMap
# would hold it. Not a ConfigMap: a policy's paramKind must be readable cluster-wide by
# whoever creates the policy, and the controller must not read every ConfigMap.
PARAMS_GROUP, PARAMS_VERSION = "epguard.io", "v1alpha1"
PARAMS_KIND, PARAMS_PLURAL = "RefusedImageList", "refusedimagelists"
ACTIONS: dict[Mode, str] = {"enforce": "Deny", "warn": "Warn", "audit": "Audit"}
# A ConfigMap holds at most 1 MiB; the lines stop well before it. An image refused by a
# line that did not fit is still refused by the webhook: the policy is only a backstop.
MAX_PARAMS_BYTES = 768 * 1024
MAX_MESSAGE = 1024
# A tag verdict leaves the list this long before the webhook stops trusting it, so the
# policy is never the stricter of the two while the controller catches up.
TAG_MARGIN = dt.timedelta(minutes=1)

EntryKind = Literal["name", "tag", "digest"]


@dataclass(frozen=True, slots=True)
class Entry:
    """One refused image: ``name`` (a regex over the image's name:tag as written),
    ``tag`` (the same, only for images not pinned by digest) or ``digest``."""

    kind: EntryKind
    pattern: str
    message: str

    def line(self) -> str:
        text = " ".join(self.message.split())[:MAX_MESSAGE]
        return f"{self.kind}\t{self.pattern}\t{text}"


@dataclass(frozen=True, slots=True)
class Params:
    entries: tuple[Entry, ...]
    # Entries that did not fit in the ConfigMap (still refused by the webhook).
    dropped: int
    # When a tag verdict leaves the list: the controller recompiles then.
    next_change: dt.datetime | None

    def data(self) -> dict[str, str]:
        return {PARAMS_KEY: "\n".join(e.line() for e in self.entries)}


# --- images as written -------------------------------------------------------------

# The reference grammar (webhook/imageref.py), as RE2: an image the webhook cannot parse
# is never refused by it, so the policy must not refuse it either.
_DOMAIN_C = r"[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?"
_PATH_C = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
VALID_IMAGE = (
    rf"^({_DOMAIN_C}(\.{_DOMAIN_C})*(:[0-9]+)?/)?{_PATH_C}(/{_PATH_C})*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$"
)
_ANY = "[A-Za-z0-9_.:/-]"
_ANY_BUT_SLASH = "[A-Za-z0-9_.:-]"
_DOCKER = rf"({re.escape(DEFAULT_DOMAIN)}/|{re.escape(LEGACY_DEFAULT_DOMAIN)}/)"


def _glob_regex(glob: str, one_component: bool) -> str | None:
    out: list[str] = []
    for ch in glob:
        if ch == "*":
            out.append((_ANY_BUT_SLASH if one_component else _ANY) + "*")
        elif ch == "?":
            out.append(_ANY_BUT_SLASH if one_component else _ANY)
        elif ch in "[]":
            return None
        else:
            out.append(re.escape(ch))
    return "".join(out)


def _looks_like_domain(component: str) -> bool:
    return "." in component or ":" in component or component == "localhost"


def spelling_regex(name_tag_glob: str) -> str | None:
    """A regex over an image's ``name:tag`` *as written* that matches only spellings
    whose normalized ``name:tag`` the glob matches; None when that cannot be exact."""
    if not name_tag_glob or name_tag_glob[0] in "*?[":
        return None
    domain, sep, rest = name_tag_glob.partition("/")
    if not sep or any(ch in domain for ch in "*?["):
        return None
    if domain != DEFAULT_DOMAIN:
        body = _glob_regex(rest, one_component=False)
        return None if body is None else f"^{re.escape(domain)}/{body}$"
    if rest.startswith(OFFICIAL_REPO_PREFIX):
        # docker.io/library/x: written "x", "library/x", "docker.io/x", … A written name
        # without "library/" is one path component, so its wildcards must not cross "/".
        tail = rest[len(OFFICIAL_REPO_PREFIX) :]
        full = _glob_regex(tail, one_component=False)
        short = _glob_regex(tail, one_component=True)
        if full is None or short is None:
            return None
        return f"^({_DOCKER}?{re.escape(OFFICIAL_REPO_PREFIX)}{full}|{_DOCKER}?{short})$"
    first, slash, _ = rest.partition("/")
    # docker.io/org/x: written "org/x" only if "org" is written out and cannot be read
    # as a registry host; otherwise only with the domain in front.
    body = _glob_regex(rest, one_component=False)
    if body is None:
        return None
    if slash and not any(ch in first for ch in "*?[") and not _looks_like_domain(first):
        return f"^{_DOCKER}?{body}$"
    return f"^{_DOCKER}{body}$" if slash else None


def rule_entries(rules: RuleSet) -> list[Entry]:
    out: list[Entry] = []
    for rule in rules.rules:
        entry = _rule_entry(rule)
        if entry is not None:
            out.append(entry)
    return out


def _rule_entry(rule: Rule) -> Entry | None:
    if rule.action != "deny":
        return None
    if rule.digest is not None:
        # A digest beside a glob narrows the rule to both; a digest alone is exact.
        return Entry("digest", rule.digest, rule_denial(rule)) if rule.image is None else None
    pattern = spelling_regex(rule.image or "")
    return None if pattern is None else Entry("name", pattern, rule_denial(rule))


def verdict_entries(
    store: VerdictStore, now: dt.datetime
) -> tuple[list[Entry], dt.datetime | None]:
    """The Unusable verdicts the webhook refuses by, and when the next tag one expires."""
    out: list[Entry] = []
    next_change: dt.datetime | None = None
    for kind, key, v in store.winners():
        if v.usable:
            continue
        if kind == "digest":
            out.append(Entry("digest", key, verdict_denial(VerdictHit(v, "deny", True))))
            continue
        if v.last_seen is None:
            continue
        leaves = v.last_seen + store.tag_ttl - TAG_MARGIN
        if leaves <= now:
            continue
        pattern = spelling_regex(key)
        if pattern is None:
            continue
        out.append(Entry("tag", pattern, verdict_denial(VerdictHit(v, "deny", False))))
        next_change = leaves if next_change is None else min(next_change, leaves)
    return out, next_change


def compile_params(rules: RuleSet, store: VerdictStore, now: dt.datetime) -> Params:
    entries = rule_entries(rules)
    learned, next_change = verdict_entries(store, now)
    entries.extend(sorted(learned, key=lambda e: (e.kind, e.pattern)))
    kept: list[Entry] = []
    size = 0
    for e in entries:
        size += len(e.line()) + 1
        if size > MAX_PARAMS_BYTES:
            break
        kept.append(e)
    return Params(tuple(kept), len(entries) - len(kept), next_change)


def verdicts_of(objects: Iterable[Verdict], tag_ttl: dt.timedelta) -> VerdictStore:
    store = VerdictStore(tag_ttl=tag_ttl)
    store.replace(objects)
    return store


# --- command lines -------------------------------------------------------------------

# A word the kubelet passes as is (no $(VAR)) and the regex can split on spaces.
_SAFE_TOKEN = r"^[A-Za-z0-9_./:=@,+%-]+$"
_LAUNCH = r"(python[0-9.]*( -[uBOsSEI]+)* -m sglang\.launch_server|sglang serve)"
DIRECT = rf"^([A-Za-z0-9_./-]*/)?{_LAUNCH}( [^ ]+)* {FLAG}(=| )mooncake( [^ ]+)*$"
# A plain script word: no quotes, backslashes, $(…), backticks, redirections or comments.
_WORD = r"[A-Za-z0-9_./:=@,+%${}-]+"
_LAUNCH_S = (
    r"(python[0-9.]*([ \t]+-[uBOsSEI]+)*[ \t]+-m[ \t]+sglang\.launch_server|sglang[ \t]+serve)"
)
SCRIPT = (
    rf"(^|[\n;&|])[ \t]*(exec[ \t]+)?([A-Za-z0-9_./-]*/)?{_LAUNCH_S}([ \t]+{_WORD})*"
    rf"[ \t]+{FLAG}(=|[ \t]+)mooncake([ \t]+{_WORD})*[ \t]*($|[\n;&|])"
)
LATER = rf"{FLAG}(=|[ \t]+)mooncake[\s\S]*--el"
SHELL = r"^(/usr)?(/bin/)?(ba|da)?sh$"


def _cel(text: str) -> str:
    """A CEL single-quoted string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def requests_mooncake(c: str) -> str:
    """CEL: container expression ``c`` asks for mooncake in a form read exactly."""
    argv = (
        f"((has({c}.command) ? {c}.command : []) + (has({c}.args) ? {c}.args : []))"
        ".map(t, string(t))"
    )
    script = f"{argv}[2].replace('\\\\\\n', ' ')"
    direct = (
        f"({argv}.all(t, t.matches({_cel(_SAFE_TOKEN)})) && "
        f"{argv}.join(' ').matches({_cel(DIRECT)}) && "
        f"!{argv}.join(' ').matches({_cel(LATER)}))"
    )
    shell = (
        f"(size({argv}) >= 3 && {argv}[0].matches({_cel(SHELL)}) && "
        f"{argv}[1].matches('^-[a-zA-Z]*c[a-zA-Z]*$') && "
        f"{script}.matches({_cel(SCRIPT)}) && !{script}.matches({_cel(LATER)}))"
    )
    return f"({direct} || {shell})"


def _name_tag(image: str) -> str:
    """CEL: the name:tag of image expression ``image`` as written, ``:latest`` added
    when neither tag nor digest is written (as the runtime does)."""
    return (
        f"({image}.contains('@') ? {image}.split('@')[0] : "
        f"({image}.substring({image}.lastIndexOf('/') + 1).contains(':') ? {image} : "
        f"{image} + ':latest'))"
    )


# --- where the containers are ------------------------------------------------------


def _skipped(t: str) -> str:
    return (
        f"(has({t}.metadata) && has({t}.metadata.annotations) && "
        f"{_cel(SKIP_ANNOTATION)} in {t}.metadata.annotations)"
    )


def _pod_spec_containers(specs: str) -> str:
    """CEL: list of pod-spec expressions → the list of their (init) containers."""
    return (
        f"{specs}.map(s, (has(s.initContainers) ? s.initContainers : []) + "
        "(has(s.containers) ? s.containers : [])).flatten()"
    )


def _walk(path: TemplatePath, allow_skip: bool) -> str:
    """CEL: the list of containers a template path reaches in ``object``."""
    values = "[object]"
    for seg in path.path.split("."):
        if seg == "*":
            values = f"{values}.filter(x, type(x) == map).map(x, x.map(k, x[k])).flatten()"
        elif seg.endswith("[]"):
            f = seg[:-2]
            values = f"{values}.filter(x, has(x.{f})).map(x, x.{f}).flatten()"
        else:
            values = f"{values}.filter(x, has(x.{seg})).map(x, x.{seg})"
    if path.shape == "container":
        return values
    if path.shape == "template":
        kept = f"{values}.filter(t, !{_skipped('t')})" if allow_skip else values
        values = f"{kept}.filter(t, has(t.spec)).map(t, t.spec)"
    return _pod_spec_containers(values)


# Built-in kinds with fixed template paths. Dynamo and RoleBasedGroup are left out (the
# engine merges their templates from patches; CEL cannot do that exactly).
_FIXED: tuple[tuple[str, str, str, tuple[str, ...], str], ...] = (
    ("", "Pod", "pods", ("v1",), "spec"),
    ("", "PodTemplate", "podtemplates", ("v1",), "template"),
    ("", "ReplicationController", "replicationcontrollers", ("v1",), "spec.template"),
    ("apps", "Deployment", "deployments", ("v1",), "spec.template"),
    ("apps", "StatefulSet", "statefulsets", ("v1",), "spec.template"),
    ("apps", "DaemonSet", "daemonsets", ("v1",), "spec.template"),
    ("apps", "ReplicaSet", "replicasets", ("v1",), "spec.template"),
    ("batch", "Job", "jobs", ("v1",), "spec.template"),
    ("batch", "CronJob", "cronjobs", ("v1",), "spec.jobTemplate.spec.template"),
)
_LWS = ("leaderworkerset.x-k8s.io", "LeaderWorkerSet", "leaderworkersets", ("v1",))


@dataclass(frozen=True, slots=True)
class BackstopConfig:
    """What the chart tells the controller (its values, via flags or env)."""

    params_namespace: str
    name: str = "epguard-backstop"
    default_mode: Mode = "enforce"
    allow_skip: bool = True
    excluded_namespaces: tuple[str, ...] = ("kube-system",)
    kinds: tuple[KindSpec, ...] = ()  # path-described kinds (built-in PATH_KINDS + extra)
    # The webhooks' objectSelector (chart value webhook.objectSelector): an object the
    # webhook is never asked about must not be refused by the backstop either.
    object_selector: dict[str, Any] | None = None


def _kind_containers(config: BackstopConfig) -> tuple[list[dict[str, Any]], str]:
    """The VAP's resource rules, and a CEL expression: the object's containers."""
    rules: dict[tuple[str, str], set[str]] = {}
    branches: list[str] = []

    def add(group: str, kind: str, resource: str, versions: Sequence[str], expr: str) -> None:
        rules.setdefault((group, ",".join(versions)), set()).add(resource)
        branches.append(f"(object.kind == {_cel(kind)} ? {expr} : [])")

    for group, kind, resource, versions, path in _FIXED:
        tp = TemplatePath(path, "podSpec" if kind == "Pod" else "template")
        add(group, kind, resource, versions, _walk(tp, config.allow_skip))
    lws = [
        TemplatePath(f"spec.leaderWorkerTemplate.{side}", "template")
        for side in ("leaderTemplate", "workerTemplate")
    ]
    add(*_LWS, " + ".join(_walk(p, config.allow_skip) for p in lws))
    for spec in config.kinds:
        expr = " + ".join(_walk(p, config.allow_skip) for p in spec.paths) or "[]"
        add(spec.group, spec.kind, spec.resource, spec.versions, expr)
    resource_rules = [
        {
            "apiGroups": [group],
            "apiVersions": versions.split(","),
            "resources": sorted(resources),
            "operations": ["CREATE"],
            "scope": "*",
        }
        for (group, versions), resources in sorted(rules.items())
    ]
    # Group and kind both decide (two CRDs may share a kind name).
    return resource_rules, " + ".join(branches)


def _refuses(e: str, x: str) -> str:
    """CEL: entry ``e`` refuses requesting container ``x`` ([name, image, name:tag])."""
    return (
        f"(({e}[0] == 'digest' && {x}[1].endsWith('@' + {e}[1])) || "
        f"({e}[0] == 'name' && {x}[2].matches({e}[1])) || "
        f"({e}[0] == 'tag' && !{x}[1].contains('@') && {x}[2].matches({e}[1])))"
    )


def _mode_expression(default: Mode) -> str:
    labels = "namespaceObject.metadata.labels"
    value = f"{labels}[{_cel(MODE_LABEL)}].lowerAscii()"
    return (
        f"(namespaceObject != null && has(namespaceObject.metadata.labels) && "
        f"{_cel(MODE_LABEL)} in {labels} && {value} in {list(MODES)!r}) ? {value} : "
        f"{_cel(default)}"
    )


def policy_name(config: BackstopConfig, mode: Mode) -> str:
    return f"{config.name}-{mode}"


def policies(config: BackstopConfig) -> list[dict[str, Any]]:
    """The three ValidatingAdmissionPolicies (one per mode, so each binding can carry
    its validation action) and their bindings."""
    resource_rules, containers = _kind_containers(config)
    entries = (
        f"has(params.data) && {_cel(PARAMS_KEY)} in params.data ? "
        f"params.data[{_cel(PARAMS_KEY)}].split('\\n').filter(l, l != '')"
        ".map(l, l.split('\\t')).filter(e, size(e) == 3) : []"
    )
    requesting = (
        f"({containers}).filter(c, has(c.image) && type(c.image) == string && "
        f"c.image.matches({_cel(VALID_IMAGE)}) && {requests_mooncake('c')})"
        f".map(c, [has(c.name) ? string(c.name) : '', string(c.image), "
        f"{_name_tag('string(c.image)')}])"
    )
    hits = f"variables.entries.filter(e, variables.requesting.exists(x, {_refuses('e', 'x')}))"
    first = f"variables.requesting.filter(x, {_refuses('variables.hits[0]', 'x')})[0]"
    exempt = _skipped("object") if config.allow_skip else "false"
    message = (
        f"'epguard (backstop policy): container \"' + {first}[0] "
        f"+ '\" (image ' + {first}[1] + ') requests {FLAG} mooncake, ' + variables.hits[0][2]"
    )
    out: list[dict[str, Any]] = []
    for mode in MODES:
        name = policy_name(config, mode)
        out.append(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicy",
                "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "epguard"}},
                "spec": {
                    # An error in the backstop itself (an old API server, a hostile
                    # object) must not block the cluster: the webhook still judges.
                    "failurePolicy": "Ignore",
                    "paramKind": {
                        "apiVersion": f"{PARAMS_GROUP}/{PARAMS_VERSION}",
                        "kind": PARAMS_KIND,
                    },
                    "matchConstraints": {"resourceRules": resource_rules},
                    "matchConditions": [
                        {"name": "not-exempt", "expression": f"!{exempt}"},
                    ],
                    "variables": [
                        {"name": "mode", "expression": _mode_expression(config.default_mode)},
                        {"name": "entries", "expression": entries},
                        {"name": "requesting", "expression": requesting},
                        {"name": "hits", "expression": hits},
                    ],
                    "validations": [
                        {
                            "expression": f"variables.mode != {_cel(mode)} || "
                            "size(variables.hits) == 0",
                            "messageExpression": message,
                            "reason": "Forbidden",
                        }
                    ],
                },
            }
        )
        out.append(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "epguard"}},
                "spec": {
                    "policyName": name,
                    "validationActions": [ACTIONS[mode]],
                    # Cluster-scoped parameters: no namespace.
                    "paramRef": {"name": config.name, "parameterNotFoundAction": "Allow"},
                    "matchResources": {
                        **(
                            {"objectSelector": config.object_selector}
                            if config.object_selector
                            else {}
                        ),
                        "namespaceSelector": {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/metadata.name",
                                    "operator": "NotIn",
                                    "values": sorted(
                                        {*config.excluded_namespaces, config.params_namespace}
                                    ),
                                },
                                {
                                    "key": "epguard.io/ignore",
                                    "operator": "NotIn",
                                    "values": ["true"],
                                },
                            ]
                        },
                    },
                },
            }
        )
    return out
