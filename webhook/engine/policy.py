"""The decision engine: one admission request plus in-memory state → one decision.

Pure and synchronous: no I/O, no API calls (everything it needs is in
``PolicyState``, kept current by watches), so the HTTP server and the offline
CLI share it and say the same words.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from epguard.probe import shell
from epguard.webhook.engine.argv import FLAG, NOTHING, analyse_container
from epguard.webhook.engine.imageref import ImageRef, ImageRefError, parse
from epguard.webhook.engine.namespaces import INJECT_KEY, Mode, NamespaceIndex, opts_in
from epguard.webhook.engine.outcome import is_probe, runs_as_injected
from epguard.webhook.engine.review import AdmissionRequest
from epguard.webhook.engine.rules import Rule, RulesHolder
from epguard.webhook.engine.signing import KeyringHolder
from epguard.webhook.engine.verdicts import NoVerdicts, VerdictHit, VerdictLookup
from epguard.webhook.engine.workloads import (
    BUILTIN,
    ContainerView,
    KindRegistry,
    PodTemplateView,
    TooManyPlaces,
    annotations_of,
    as_map,
)

SKIP_ANNOTATION = "epguard.io/skip"
JUDGED_OPERATIONS = frozenset({"CREATE", "UPDATE"})
# Subresources that carry a pod spec worth judging; /status, /scale … do not.
JUDGED_SUBRESOURCES = frozenset({"", "ephemeralcontainers"})

Severity = Literal["deny", "warn"]
Result = Literal["allowed", "denied", "warned", "audited", "exempted", "ignored"]


@dataclass(frozen=True, slots=True)
class Finding:
    severity: Severity
    message: str
    # What fired: a rule id, "verdict:<ImageVerdict name>", or None for advice.
    source: str | None = None
    # Identity used to recognise the same problem in oldObject on UPDATE.
    key: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    default_mode: Mode = "enforce"
    allow_skip: bool = True
    kinds: KindRegistry = BUILTIN


@dataclass
class PolicyState:
    rules: RulesHolder
    namespaces: NamespaceIndex = field(default_factory=NamespaceIndex)
    verdicts: VerdictLookup = field(default_factory=NoVerdicts)
    config: PolicyConfig = field(default_factory=PolicyConfig)
    # The probe-signing keys (webhook/engine/signing.py), from the Secret the controller keeps.
    keys: KeyringHolder = field(default_factory=KeyringHolder)


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    result: Result
    mode: Mode
    message: str | None = None
    warnings: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = ()
    exemption: str | None = None
    audit_annotations: dict[str, str] | None = None

    @property
    def denials(self) -> tuple[Finding, ...]:
        return _denials(self.findings)

    @property
    def fired(self) -> tuple[str, ...]:
        return _fired(self.findings)


def _denials(findings: Iterable[Finding]) -> tuple[Finding, ...]:
    return tuple(f for f in findings if f.severity == "deny")


def _fired(findings: Iterable[Finding]) -> tuple[str, ...]:
    """Rule/verdict ids behind would-be denials, in order, without repeats."""
    return tuple(dict.fromkeys(f.source for f in _denials(findings) if f.source))


ALLOW_IGNORED = Decision(allowed=True, result="ignored", mode="enforce")


def _strip_period(text: str) -> str:
    return text.strip().rstrip(".").strip()


def _is_probe(c: ContainerView) -> bool:
    """The probe epguard injects (outcome.is_probe), as an init container, run exactly as
    injection.py writes it (``python3 -I <mount>/probe … --``). It is left unjudged: the
    worker argv it carries after ``--`` is what it checks, not what it runs. Anything
    else, even named like the probe, is judged like any container: `sh -c "exec python3
    -m sglang.launch_server … mooncake" probe --` passed for a probe, its own launch
    unjudged, wherever no key checked its signature (a template, or before the
    controller wrote the key: review helper)."""
    return c.kind == "initContainer" and is_probe(c.raw) and runs_as_injected(c.raw)


def _subject(c: ContainerView, where: str, image: str) -> str:
    label = {"initContainer": "init container", "ephemeralContainer": "ephemeral container"}.get(
        c.kind, "container"
    )
    place = f" in {where}" if where else ""
    return f'{label} "{c.name}"{place} (image {image})'


def rule_denial(rule: Rule) -> str:
    """What a deny rule says after ``<subject> requests <flag> mooncake, ``: the reason,
    the fix and the rule id. The backstop policy (backstop.py) says exactly this too."""
    return (
        f"which this image cannot serve: {_strip_period(rule.reason)}. "
        f"Fix: {_strip_period(rule.remedy)}. [epguard rule {rule.id}]"
    )


def verdict_denial(hit: VerdictHit, namespace: str | None = None) -> str:
    """What an Unusable verdict says after ``<subject> requests <flag> mooncake, ``, to a
    request in ``namespace`` (VerdictHit.where: another namespace's pod is not named)."""
    v = hit.verdict
    if v.from_scan:
        reason = _strip_period(v.reason) or "epguard scan found an image cause"
        rebuild = (
            f"rebuild the image so that `epguard scan` passes (a passing `epguard scan "
            f"--record` of these bytes deletes ImageVerdict {v.object_name})"
        )
        fix = f"{_strip_period(v.fix)}, then {rebuild}" if v.fix else "R" + rebuild[1:]
    else:
        reason = _strip_period(v.reason) or "its epguard probe failed"
        fix = (
            f"use an image whose epguard probe passes; once this one is fixed, delete "
            f"ImageVerdict {v.object_name}"
        )
    return (
        f"which this image cannot serve: {reason} ({hit.where(namespace)}). Fix: {fix}. "
        f"[epguard verdict {v.object_name}]"
    )


def _rule_finding(subject: str, rule: Rule, key: tuple[str, ...]) -> Finding:
    if rule.action == "deny":
        text = f"{subject} requests {FLAG} mooncake, {rule_denial(rule)}"
    else:
        text = (
            f"{subject} requests {FLAG} mooncake, which this image may not serve: "
            f"{_strip_period(rule.reason)}. Fix: {_strip_period(rule.remedy)}. "
            f"[epguard rule {rule.id}, warn]"
        )
    return Finding(rule.action, text, rule.id, (*key, rule.id))


def _verdict_finding(
    subject: str, hit: VerdictHit, key: tuple[str, ...], namespace: str | None
) -> Finding:
    v = hit.verdict
    src = f"verdict:{v.object_name}"
    if hit.trust == "deny":
        return Finding(
            "deny",
            f"{subject} requests {FLAG} mooncake, {verdict_denial(hit, namespace)}",
            src,
            (*key, src),
        )
    if v.from_scan:
        earlier = "an earlier epguard scan of this tag's image found"
        reason = _strip_period(v.reason) or "an image cause"
    else:
        earlier = "an earlier pod on this tag failed its epguard probe:"
        reason = _strip_period(v.reason) or "its epguard probe failed"
    return Finding(
        "warn",
        f"{subject} requests {FLAG} mooncake; {earlier} {reason} ({hit.where(namespace)}), "
        "but tags move and that verdict is older than the TTL. Pin the image by digest to be "
        f"sure. [epguard verdict {v.object_name}, warn]",
        src,
        (*key, src),
    )


def _template_findings(
    t: PodTemplateView,
    state: PolicyState,
    now: dt.datetime,
    namespace_injects: bool,
    budget: shell.Budget,
    namespace: str | None,
) -> list[Finding]:
    findings: list[Finding] = []
    # Each container is asked once (the question splits the probe's argv).
    probes = [_is_probe(c) for c in t.containers]
    injects = namespace_injects or opts_in(t.annotations.get(INJECT_KEY))
    # A probe speaks only for the image it ran in: a worker whose image is not one the
    # pod's probes checked (an UPDATE swapped it, or a hand-made pod) is not probed.
    probed_images = {c.image for c, p in zip(t.containers, probes, strict=True) if p}
    rules = state.rules.current
    for c, c_is_probe in zip(t.containers, probes, strict=True):
        if c_is_probe:
            continue  # the probe carries the worker's argv after "--"; it is not a worker
        report = analyse_container(c.raw, budget)
        if report is NOTHING:
            continue  # the common case: nothing to see, no strings to build
        image_text = c.image if c.image is not None else "<none>"
        subject = _subject(c, t.where, image_text)
        probe_present = injects or c.image in probed_images
        # The probe sees what admission cannot (injection.plan probes such a worker).
        then = (
            "; the epguard probe checks it when the pod starts"
            if probe_present
            else "; add the epguard probe (enable injection) to have it checked when the pod starts"
        )
        if report.unresolved_value is not None:
            # The probe reads it again with the pod's variables; what the shell computes
            # as it runs (${V,,}, $(printf ...)) it cannot read either, and says so.
            computed = (
                "; a value the shell computes as it runs is read by neither, so spell it "
                "literally to have it checked"
                if probe_present
                else ""
            )
            findings.append(
                Finding(
                    "warn",
                    f"{subject} passes {FLAG} {report.unresolved_value}, whose value cannot be "
                    "resolved at admission (it comes from a Secret, ConfigMap, field or shell "
                    f"variable), so epguard could not judge it here{then}{computed}",
                )
            )
        hidden = report.config_file is not None and not report.worker
        if hidden and report.looks_like_sglang:
            findings.append(
                Finding(
                    "warn",
                    f"{subject} reads --config {report.config_file or '<file>'}; a {FLAG} set "
                    f"in that file cannot be seen at admission, so epguard could not judge it "
                    f"here{then}",
                )
            )
        if not report.requests_mooncake:
            continue
        try:
            ref: ImageRef = parse(c.image) if c.image is not None else parse("")
        except ImageRefError as exc:
            findings.append(
                Finding(
                    "warn",
                    f"{subject} requests {FLAG} mooncake but its image reference is not valid "
                    f"({exc}); epguard could not check it",
                )
            )
            continue
        subject = _subject(c, t.where, str(ref))
        key = (t.where, c.kind, c.name, str(ref))
        matched = rules.match(ref)
        findings.extend(_rule_finding(subject, r, key) for r in matched)
        hit = state.verdicts.lookup(ref, now)
        if hit is not None and hit.trust != "usable":
            findings.append(_verdict_finding(subject, hit, key, namespace))
        if probed_images and c.image not in probed_images and report.worker:
            findings.append(
                Finding(
                    "deny",
                    f"{subject} requests {FLAG} mooncake but the pod's epguard probe checked "
                    f"another image ({', '.join(sorted(str(i) for i in probed_images))[:300]}), "
                    "so its result says nothing about this one. Fix: recreate the pod (delete "
                    "it; a new one gets a probe of its own image) instead of changing its "
                    "image in place. [epguard stale-probe]",
                    "stale-probe",
                    (*key, "stale-probe"),
                )
            )
        if not matched and hit is None and report.unplaced and not probe_present:
            findings.append(
                Finding(
                    "warn",
                    f"{subject} mentions {FLAG} mooncake where epguard cannot tell what runs "
                    "it (eval, a script on a shell's stdin, a here-document, an env value), "
                    "so it judged the image by rules and learned verdicts only, and no probe "
                    "checks it; write the flag on the container's command line to have it "
                    "probed",
                )
            )
        elif not matched and hit is None and not probe_present:
            findings.append(
                Finding(
                    "warn",
                    f"{subject} requests {FLAG} mooncake and epguard knows nothing about this "
                    "image: add the epguard probe or enable injection "
                    f"(label the namespace {INJECT_KEY}=enabled)",
                )
            )
    return findings


@dataclass(frozen=True, slots=True)
class _Judgement:
    findings: list[Finding]
    # Why the whole object is exempt (its own annotation), if it is.
    exemption: str | None
    # Why a template's denials were dropped (its annotation), if any were.
    template_exemption: str | None


def _judge(
    templates: list[PodTemplateView],
    obj_annotations: dict[str, str],
    state: PolicyState,
    now: dt.datetime,
    namespace_injects: bool,
    namespace: str | None,
) -> _Judgement:
    allow_skip = state.config.allow_skip
    findings: list[Finding] = []
    obj_skip = obj_annotations.get(SKIP_ANNOTATION)
    exemption = obj_skip if allow_skip else None
    template_exemption: str | None = None
    # One reading budget for the whole object: many huge containers cost what one does.
    budget = shell.Budget()
    for t in templates:
        tf = _template_findings(t, state, now, namespace_injects, budget, namespace)
        t_skip = t.annotations.get(SKIP_ANNOTATION)
        # (When the object itself is exempt, keep the denials: the log shows what was skipped.)
        if (
            t_skip is not None
            and allow_skip
            and obj_skip is None
            and any(f.severity == "deny" for f in tf)
        ):
            # A template's annotation exempts that template, and so the pods made from
            # it (the annotation is copied onto them).
            template_exemption = template_exemption if template_exemption is not None else t_skip
            tf = [f for f in tf if f.severity != "deny"]
        findings.extend(tf)
    if not allow_skip and (
        obj_skip is not None or any(SKIP_ANNOTATION in t.annotations for t in templates)
    ):
        findings.append(
            Finding(
                "warn",
                f"the {SKIP_ANNOTATION} annotation is disabled in this cluster and was ignored",
            )
        )
    return _Judgement(findings, exemption, template_exemption)


def decide(
    request: AdmissionRequest, state: PolicyState, now: dt.datetime | None = None
) -> Decision:
    if request.operation not in JUDGED_OPERATIONS:
        return ALLOW_IGNORED
    if (request.subResource or "") not in JUDGED_SUBRESOURCES:
        return ALLOW_IGNORED
    templates, unread = _pods_of(request, request.object, state.config.kinds)
    if templates is None:
        return ALLOW_IGNORED  # a kind epguard does not judge: never in the way
    now = now or dt.datetime.now(dt.UTC)
    ns = state.namespaces.get(request.namespace)
    mode: Mode = ns.mode or state.config.default_mode
    obj_annotations = dict(annotations_of(request.object))
    judgement = _judge(templates, obj_annotations, state, now, ns.inject, request.namespace)
    findings = unread + judgement.findings

    if request.operation == "UPDATE" and request.oldObject is not None:
        # Do not block an update (a scale-down, a finalizer removal, a label) of an
        # object whose problem was already there: only what the update introduces.
        old_templates, old_unread = _pods_of(request, request.oldObject, state.config.kinds)
        old_findings = _judge(
            old_templates or [], {}, state, now, ns.inject, request.namespace
        ).findings
        old_keys = {f.key for f in old_unread + old_findings if f.severity == "deny"}
        findings = [
            Finding(
                "warn",
                f.message + " (already present before this update; not blocking it)",
                f.source,
                f.key,
            )
            if f.severity == "deny" and f.key in old_keys
            else f
            for f in findings
        ]
    # An exemption counts only where it let a denial through: an annotated object that
    # would have been admitted anyway is plain "allowed", so the exempted count (and the
    # log line) measure what the annotation actually did.
    # (Without any denial left, a template exemption is what dropped them, if anything.)
    denied = any(f.severity == "deny" for f in findings)
    return _conclude(
        findings, mode, judgement.exemption if denied else judgement.template_exemption
    )


def _pods_of(
    request: AdmissionRequest, obj: Any, kinds: KindRegistry
) -> tuple[list[PodTemplateView] | None, list[Finding]]:
    """The pods ``obj`` describes (None: a kind epguard does not judge), and a denial when
    it is too large to read them from: never taken for an object without pods (the pods
    it makes are judged one by one as they are created). The denial goes through the
    mode, the object's exemption and the UPDATE rule like any other."""
    try:
        return kinds.pod_templates(request.kind.group, request.kind.kind, obj), []
    except TooManyPlaces as exc:
        name = as_map(as_map(obj).get("metadata")).get("name")
        message = (
            f"{request.kind.kind} {str(name)[:253]!r} is too large for epguard to read its "
            f"pods from ({exc}); the pods it creates are judged as they are created"
        )
        return [], [Finding("deny", message, "too-large", ("too-large",))]


def _conclude(findings: list[Finding], mode: Mode, exemption: str | None) -> Decision:
    denials = _denials(findings)
    warnings = [f.message for f in findings if f.severity == "warn"]
    fired = ",".join(_fired(findings))
    if exemption is not None:
        why = exemption.strip() or "(no reason given)"
        note = f"epguard checks skipped by annotation {SKIP_ANNOTATION}: {why}"
        return Decision(
            allowed=True,
            result="exempted",
            mode=mode,
            warnings=(note, *warnings),
            findings=tuple(findings),
            exemption=exemption,
            audit_annotations={"exempted": exemption[:256] or "(no reason given)"},
        )
    if not denials:
        return Decision(
            allowed=True,
            result="allowed",
            mode=mode,
            warnings=tuple(warnings),
            findings=tuple(findings),
        )
    message = "; ".join(f.message for f in denials)
    if mode == "enforce":
        return Decision(
            allowed=False,
            result="denied",
            mode=mode,
            message=message,
            warnings=tuple(warnings),
            findings=tuple(findings),
            audit_annotations={"denied": fired},
        )
    if mode == "warn":
        return Decision(
            allowed=True,
            result="warned",
            mode=mode,
            warnings=(
                *(f"epguard (warn mode) would deny: {f.message}" for f in denials),
                *warnings,
            ),
            findings=tuple(findings),
            audit_annotations={"would-deny": fired},
        )
    return Decision(
        allowed=True,
        result="audited",
        mode=mode,
        warnings=tuple(warnings),
        findings=tuple(findings),
        audit_annotations={"would-deny": fired},
        message=message,
    )
