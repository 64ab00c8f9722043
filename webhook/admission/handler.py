"""Decision layer: one AdmissionRequest and the in-memory state → one :class:`Outcome`.

Pure and synchronous like the engine under it (``policy.decide`` for ``/validate``, the
probe-injection plan for ``/mutate``; ``epguard check`` runs the same ``decide``): no
I/O, no HTTP, no metrics. What the wire looks like is completion's business, counting
and logging instrumentation's. A handler may raise; completion turns that into an error
the API server's failurePolicy decides on.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from epguard.webhook.engine.injection import (
    InjectionSettings,
    metadata_patch,
    plan,
    plan_without_probe,
)
from epguard.webhook.engine.namespaces import INJECT_KEY, PreflightMode, opts_in
from epguard.webhook.engine.outcome import PROBE_VOLUME, PROBED_LABEL
from epguard.webhook.engine.policy import (
    SKIP_ANNOTATION,
    Decision,
    PolicyState,
    decide,
)
from epguard.webhook.engine.preflight import PREFLIGHT_LABEL, gate_patch, ungate_patch, unjudged
from epguard.webhook.engine.review import AdmissionRequest
from epguard.webhook.engine.rules import RulesError, load_rules_text, rule_warnings
from epguard.webhook.engine.signing import (
    FRESH_SECONDS,
    PREFIX,
    SIGNATURE_ANNOTATION,
    KeyringHolder,
    Verification,
    check_signature,
    exposure,
    fresh,
    parts_of,
    sign,
    verify,
)
from epguard.webhook.engine.workloads import annotations_of, as_map, describe_object

# The result of each handler: a closed set, so metric labels stay bounded.
VALIDATE_RESULTS = ("allowed", "denied", "warned", "audited", "exempted", "ignored")
MUTATE_RESULTS = ("injected", "gated", "unchanged", "not_opted_in", "exempted")
# Results that are the everyday case: nothing to log.
ROUTINE = frozenset({"allowed", "ignored", "unchanged", "not_opted_in"})


Clock = Callable[[], dt.datetime]


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True, slots=True)
class Outcome:
    allowed: bool
    result: str  # one of the handler's ``results``
    message: str | None = None  # why it is refused (or would be, in warn/audit mode)
    warnings: tuple[str, ...] = ()
    audit_annotations: dict[str, str] | None = None
    patch: list[dict[str, Any]] | None = None  # a JSON patch (mutating handlers only)
    # Policy decisions only (None otherwise): the rules or verdicts behind would-be
    # denials ("none" when nothing would deny), and the source of each warning finding.
    rules: tuple[str, ...] | None = None
    warned_by: tuple[str, ...] = ()
    # What happened, in words, for the log (only for results outside ROUTINE).
    note: str | None = None


class Handler(Protocol):
    endpoint: str  # the metric label and the path, without the slash
    results: tuple[str, ...]

    def __call__(self, request: AdmissionRequest) -> Outcome: ...


def _what(req: AdmissionRequest) -> str:
    return f"{req.operation} {describe_object(req.object)} in namespace {req.namespace or '-'}"


_ALLOWED_RULES = ("none",)


def outcome_of(req: AdmissionRequest, d: Decision) -> Outcome:
    """A policy decision as an outcome (shared by /validate and tests)."""
    result = d.result
    warned_by = tuple(f.source or "none" for f in d.findings if f.severity == "warn")
    if result == "ignored":
        return Outcome(True, result, rules=None)
    if result == "allowed":
        return Outcome(True, result, warnings=d.warnings, rules=_ALLOWED_RULES, warned_by=warned_by)
    rules = d.fired or _ALLOWED_RULES
    if result == "exempted":
        note = f"exempted {_what(req)}: {d.exemption}; would-deny={','.join(rules)}"
    elif result == "denied":
        note = f"denied {_what(req)}: {d.message}"
    else:
        note = f"{result} {_what(req)} in {d.mode} mode: would deny: " + "; ".join(
            f.message for f in d.denials
        )
    return Outcome(
        d.allowed,
        result,
        message=d.message,
        warnings=d.warnings,
        audit_annotations=d.audit_annotations,
        rules=rules,
        warned_by=warned_by,
        note=note,
    )


@dataclass(frozen=True, slots=True)
class RulesConfigMap:
    """Where the live rules are: epguard judges edits of this one ConfigMap."""

    namespace: str
    name: str
    key: str


def rules_edit_outcome(req: AdmissionRequest, where: RulesConfigMap) -> Outcome:
    """An edit of the rules ConfigMap: refused at ``kubectl apply`` when its rules would
    not load (naming the entry or the YAML line), so a broken edit never reaches the
    webhook, and never becomes the file a restarted webhook starts from."""
    meta = as_map(as_map(req.object).get("metadata"))
    if req.namespace != where.namespace or meta.get("name") != where.name:
        return Outcome(True, "ignored")
    text = as_map(as_map(req.object).get("data")).get(where.key)
    source = f"configmap {where.namespace}/{where.name} key {where.key}"
    if text is None:
        return Outcome(
            True,
            "warned",
            warnings=(f"epguard: {source} is missing, so epguard uses its built-in rules",),
            note=f"rules edit without {where.key}",
        )
    try:
        rules = load_rules_text(text if isinstance(text, str) else "", source)
    except RulesError as exc:
        message = f"epguard refuses this rules edit; the rules in use stay as they are: {exc}"
        return Outcome(False, "denied", message=message, note=f"refused a rules edit: {exc}")
    warnings = tuple(f"epguard: {w}" for w in rule_warnings(rules))
    if warnings:
        return Outcome(
            True,
            "warned",
            warnings=warnings,
            note=f"rules edit accepted with {len(warnings)} warning(s): {warnings[0]}",
        )
    return Outcome(True, "allowed", rules=_ALLOWED_RULES, note=f"{len(rules)} rule(s) accepted")


def _name_of(obj: Any) -> str:
    meta = as_map(as_map(obj).get("metadata"))
    return str(meta.get("name") or meta.get("generateName") or "?")


def forged_parts_outcome(
    req: AdmissionRequest, keys: KeyringHolder, now: dt.datetime | None = None
) -> Outcome | None:
    """A pod whose parts under epguard's names are not exactly what epguard signed is
    refused, in every mode: this is not a judgement of the image but a pod impersonating
    epguard, whose "probe" could print any verdict. So is a pod created with a signature
    made for another pod (older than FRESH_SECONDS: copied). None: nothing to say.

    Without a key (none loaded yet, or the Secret gone before this replica started) an
    unsigned probe passes (the controller verifies every pod before it learns anything,
    so it is never evidence), and so does a signature this replica cannot check (another
    replica holding the key made it); but not the label without a signature: no
    injection makes that, and the label puts a pod on the controller's lists. On UPDATE,
    parts unchanged since the pod was created pass (a label edit, or a pod signed with a
    key that has rotated out since)."""
    if req.kind.kind != "Pod" or req.kind.group or req.subResource:
        return None
    if req.operation not in ("CREATE", "UPDATE"):
        return None
    obj = as_map(req.object)
    parts = parts_of(obj)
    if not parts.present:
        return None
    unchanged = req.operation == "UPDATE" and parts_of(as_map(req.oldObject)) == parts
    if keys.ring is None:
        if unchanged or parts.label is None or parts.signature is not None:
            return None  # as created, unsigned, or signed by a replica that holds the key
        return _forged(
            req,
            obj,
            f"its {PROBED_LABEL} label comes with no {SIGNATURE_ANNOTATION} annotation "
            f"(epguard labels only the pods it signs)",
        )
    checked = check_signature(keys.ring, req.namespace or "", obj)
    stale = (
        (checked.ok or checked.outdated)
        and req.operation == "CREATE"
        and checked.signed_at is not None
        and not fresh(checked.signed_at, now or _utcnow())
    )
    if stale:
        checked = Verification(
            False,
            f"its {SIGNATURE_ANNOTATION} was made for another pod (signed more than "
            f"{FRESH_SECONDS} s before this one was created; a signature is used once)",
            checked.key_id,
        )
    if checked.ok:
        return _exposure_warning(req, obj)
    if checked.outdated:
        # An old replica's /mutate during an upgrade: admitted, never evidence (the
        # controller verifies every pod before it learns anything).
        return _learns_nothing(req, obj, checked.reason)
    if unchanged:
        return None
    return _forged(req, obj, checked.reason)


def _forged(req: AdmissionRequest, obj: Mapping[str, Any], reason: str) -> Outcome:
    message = (
        f"epguard refuses pod {req.namespace}/{_name_of(obj)}: {reason}. "
        f"Init containers named {PREFIX}*, the {PROBE_VOLUME} volume, the {PROBED_LABEL} "
        f"label and the {SIGNATURE_ANNOTATION} annotation are epguard's own: remove them; "
        f"epguard injects its probe itself into pods that opt in ({INJECT_KEY}=enabled)"
    )
    return Outcome(False, "denied", message=message, rules=("forged-probe",), note=message)


def _exposure_warning(req: AdmissionRequest, obj: Mapping[str, Any]) -> Outcome | None:
    """A signed pod whose other parts can reach the probe is admitted (refusing it would
    make a mesh's first init container an outage), but its probe teaches nothing: the
    controller checks the same (signing.verify) and says so; the tenant is told now."""
    exposed = exposure(obj)
    if exposed is None:
        return None
    return _learns_nothing(req, obj, exposed)


def _learns_nothing(req: AdmissionRequest, obj: Mapping[str, Any], why: str) -> Outcome:
    warning = (
        f"epguard: the probe's result in pod {req.namespace}/{_name_of(obj)} will not be "
        f"learned: {why}"
    )
    return Outcome(True, "warned", warnings=(warning,), rules=("probe-exposed",), note=warning)


class Validator:
    """``/validate``: the policy engine's decision; for the rules ConfigMap, whether its
    rules load."""

    endpoint: str = "validate"
    results: tuple[str, ...] = VALIDATE_RESULTS

    def __init__(
        self, state: PolicyState, rules: RulesConfigMap | None = None, clock: Clock = _utcnow
    ) -> None:
        self.state = state
        self.rules = rules
        self.clock = clock

    def __call__(self, request: AdmissionRequest) -> Outcome:
        if self.rules is not None and request.kind.kind == "ConfigMap" and not request.kind.group:
            return rules_edit_outcome(request, self.rules)
        now = self.clock()
        forged = forged_parts_outcome(request, self.state.keys, now)
        if forged is not None and not forged.allowed:
            return forged
        decided = outcome_of(request, decide(request, self.state, now))
        if forged is not None and decided.allowed:
            return Outcome(
                True,
                decided.result if decided.result != "allowed" else forged.result,
                message=decided.message,
                warnings=(*decided.warnings, *forged.warnings),
                audit_annotations=decided.audit_annotations,
                rules=decided.rules,
                warned_by=(*decided.warned_by, *(forged.rules or ())),
                note=forged.note if decided.note is None else decided.note,
            )
        return decided


@dataclass(frozen=True, slots=True)
class InjectionResult:
    result: str  # one of MUTATE_RESULTS
    patch: list[dict[str, Any]]
    warnings: tuple[str, ...] = ()
    removed: bool = False  # the pod brought parts under epguard's names; they were removed


def _without_probe(
    obj: Mapping[str, Any], result: str, spec_ops: list[dict[str, Any]] | None = None
) -> InjectionResult:
    """No probe for this pod; but whatever it carries under epguard's names goes.
    ``spec_ops``: the spec's share when ``plan`` already computed it."""
    if spec_ops is None:
        spec_ops = plan_without_probe(obj.get("spec"))
    removal = [*spec_ops, *metadata_patch(obj.get("metadata"), probed=False, signature=None)]
    return InjectionResult(result, removal, removed=bool(removal))


def injection_for(
    req: AdmissionRequest,
    state: PolicyState,
    settings: InjectionSettings,
    now: dt.datetime | None = None,
) -> InjectionResult:
    """The result and patch for one request. Opt-in is the namespace label or the pod
    annotation ``epguard.io/inject: enabled``; the chart's MutatingWebhookConfiguration
    filters on both with CEL already, and this checks again so a misconfigured webhook
    never injects into a pod that did not ask. Either way, parts under epguard's names
    that the pod brought itself are removed (webhook/engine/signing.py)."""
    if req.kind.kind != "Pod" or req.operation != "CREATE" or req.subResource:
        return InjectionResult("unchanged", [])
    obj = as_map(req.object)
    now = now or _utcnow()
    if _signed_preflight(obj, state, req.namespace or "", now):
        return InjectionResult("unchanged", [])
    annotations = annotations_of(obj)
    if not (state.namespaces.get(req.namespace).inject or opts_in(annotations.get(INJECT_KEY))):
        return _without_probe(obj, "not_opted_in")
    if state.config.allow_skip and SKIP_ANNOTATION in annotations:
        return _without_probe(obj, "exempted")
    injection = plan(obj.get("spec"), settings)
    if not injection.containers:
        return _without_probe(obj, "unchanged", injection.patch)
    ring = state.keys.ring
    warnings: tuple[str, ...] = ()
    signature: str | None = None
    if ring is None:
        # The probe still stops this pod early; only its result is not learned. The
        # controller creates the key at start, so this lasts seconds on a fresh install.
        warnings = (
            "epguard: the probe was injected unsigned (no signing key loaded yet: "
            f"{state.keys.error}); its result will not be learned",
        )
    else:
        stored = {"metadata": {"labels": {PROBED_LABEL: "true"}}, "spec": injection.spec}
        signature = sign(ring.current, req.namespace or "", stored, now)
    # Without a key the controller cannot sign a preflight either: no gate then.
    gate: list[dict[str, Any]] = []
    gated = signature is not None and _preflight_mode(state, req.namespace, settings) == "gate"
    # A pod already bound to a node (spec.nodeName) is never scheduled, and the API
    # server refuses one that also has a scheduling gate: gating it made it impossible
    # to create. Its injected probe still stops it before the worker starts.
    bound = bool(as_map(obj.get("spec")).get("nodeName"))
    if gated and not bound and unjudged(injection.settled, state.verdicts, now):
        gate = gate_patch(as_map(obj.get("spec")))
    # The label only with a signature: it puts the pod on the controller's lists, and
    # /validate refuses it on a pod epguard did not sign. Nor epguard's gate: a pod a
    # keyed replica gated, reinvoked here without a key, would wait where nothing looks.
    signed_meta = metadata_patch(obj.get("metadata"), signature is not None, signature)
    if signature is None or bound:
        # A bound pod reinvoked here (a later webhook set spec.nodeName after epguard
        # gated it) loses epguard's gate, or the API server refuses it.
        gate = ungate_patch(obj)
    patch = [*injection.patch, *gate, *signed_meta]
    return InjectionResult("gated" if gate else "injected", patch, warnings, injection.removed)


def _preflight_mode(
    state: PolicyState, namespace: str | None, settings: InjectionSettings
) -> PreflightMode:
    return state.namespaces.get(namespace).preflight or settings.preflight


def _signed_preflight(
    obj: Mapping[str, Any], state: PolicyState, namespace: str, now: dt.datetime
) -> bool:
    """A preflight pod the controller built and signed (engine/preflight.py): /mutate
    leaves it as it is (re-injecting would replace its --files-only probe). A label alone
    proves nothing; the signature must verify, now."""
    labels = as_map(as_map(obj.get("metadata")).get("labels"))
    ring = state.keys.ring
    if labels.get(PREFLIGHT_LABEL) != "true" or ring is None:
        return False
    checked = verify(ring, namespace, obj)
    return checked.ok and checked.signed_at is not None and fresh(checked.signed_at, now)


class Injector:
    """``/mutate``: put the epguard probe first in worker pods that opted in.

    Every outcome is allowed: injection is best-effort, and refusing a pod for want of a
    diagnostic would make epguard the outage (``/validate`` still judges it)."""

    endpoint: str = "mutate"
    results: tuple[str, ...] = MUTATE_RESULTS

    def __init__(
        self, state: PolicyState, settings: InjectionSettings, clock: Clock = _utcnow
    ) -> None:
        self.state = state
        self.settings = settings
        self.clock = clock

    def __call__(self, request: AdmissionRequest) -> Outcome:
        done = injection_for(request, self.state, self.settings, self.clock())
        if not done.patch:
            return Outcome(True, done.result, warnings=done.warnings)
        name = _name_of(request.object)
        what = {
            "injected": "injected the probe into",
            "gated": "injected the probe into, and gated until its image is judged,",
        }.get(done.result, "left no probe in")
        removed = " (removed epguard-* parts it brought itself)" if done.removed else ""
        return Outcome(
            True,
            done.result,
            warnings=done.warnings,
            patch=done.patch,
            note=f"{what} pod {request.namespace}/{name}{removed}",
        )
