"""Modes (enforce, warn, audit), the per-namespace override, and the skip annotation."""

from __future__ import annotations

from epguard.webhook.engine.policy import PolicyState, decide
from tests.factory import (
    GOOD_IMAGE,
    container,
    make_state,
    pod,
    pod_spec,
    request,
    template,
    workload,
)

RULE = "sglang-0516-cu129-test"


def test_enforce_denies() -> None:
    d = decide(request(pod()), make_state())
    assert not d.allowed and d.result == "denied" and d.fired == (RULE,)
    assert d.audit_annotations == {"denied": RULE}


def test_warn_mode_allows_with_the_denial_as_a_warning() -> None:
    d = decide(request(pod()), make_state(default_mode="warn"))
    assert d.allowed and d.result == "warned"
    assert d.warnings[0].startswith('epguard (warn mode) would deny: container "worker"')
    assert d.message is None


def test_audit_mode_allows_silently_but_records_the_would_be_denial() -> None:
    d = decide(request(pod()), make_state(default_mode="audit"))
    assert d.allowed and d.result == "audited"
    assert d.warnings == ()
    assert d.audit_annotations == {"would-deny": RULE}
    assert d.message is not None and RULE in d.message  # logged by the server


def test_namespace_label_overrides_the_global_mode(state: PolicyState) -> None:
    state.namespaces.upsert("ml", {"epguard.io/mode": "warn"})
    assert decide(request(pod(), namespace="ml"), state).result == "warned"
    assert decide(request(pod(), namespace="other"), state).result == "denied"
    state.namespaces.upsert("ml", {"epguard.io/mode": "Audit "})
    assert decide(request(pod(), namespace="ml"), state).result == "audited"


def test_namespace_label_can_tighten_a_lenient_global_mode() -> None:
    state = make_state(default_mode="audit")
    state.namespaces.upsert("prod", {"epguard.io/mode": "enforce"})
    assert decide(request(pod(), namespace="prod"), state).result == "denied"


def test_ignores_an_invalid_mode_label(state: PolicyState) -> None:
    s = state.namespaces.upsert("ml", {"epguard.io/mode": "strict"})
    assert s.bad_mode == "strict"
    assert decide(request(pod(), namespace="ml"), state).result == "denied"


def test_honours_the_skip_annotation_and_says_why(state: PolicyState) -> None:
    d = decide(
        request(pod(annotations={"epguard.io/skip": "vendor image, checked by hand"})), state
    )
    assert d.allowed and d.result == "exempted"
    assert d.exemption == "vendor image, checked by hand"
    assert "skipped by annotation epguard.io/skip: vendor image, checked by hand" in d.warnings[0]
    assert d.fired == (RULE,)  # still known, for the log


def test_skip_annotation_on_a_template_exempts_that_template(state: PolicyState) -> None:
    t = template(annotations={"epguard.io/skip": "ticket 42"})
    d = decide(request(workload("Deployment", t)), state)
    assert d.allowed and d.result == "exempted" and d.exemption == "ticket 42"


def test_skip_annotation_on_one_lws_template_leaves_the_other_judged(state: PolicyState) -> None:
    obj = workload("LeaderWorkerSet")
    obj["spec"]["leaderWorkerTemplate"]["leaderTemplate"] = template(
        annotations={"epguard.io/skip": "x"}
    )
    d = decide(request(obj), state)
    assert not d.allowed
    assert "workerTemplate" in (d.message or "") and "leaderTemplate" not in (d.message or "")


def test_skip_annotation_is_ignored_when_the_admin_disables_it() -> None:
    state = make_state(allow_skip=False)
    d = decide(request(pod(annotations={"epguard.io/skip": "please"})), state)
    assert not d.allowed
    assert any("annotation is disabled in this cluster" in w for w in d.warnings)


def test_injection_label_counts_as_a_probe_for_templates(state: PolicyState) -> None:
    obj = workload("Deployment", template(pod_spec([container(image=GOOD_IMAGE)])))
    assert any("add the epguard probe" in w for w in decide(request(obj), state).warnings)
    state.namespaces.upsert("ml", {"epguard.io/inject": "enabled"})
    assert decide(request(obj), state).warnings == ()


def test_rules_swap_takes_effect_on_the_next_review(state: PolicyState) -> None:
    from epguard.webhook.engine.rules import load_rules_text

    assert not decide(request(pod()), state).allowed
    state.rules.set_live(load_rules_text("rules: []", "cm"))
    assert decide(request(pod([container(image=GOOD_IMAGE, args=["--tp", "1"])])), state).allowed
    assert decide(request(pod()), state).allowed


def test_skip_annotation_on_an_object_that_would_pass_anyway_is_not_counted_as_exempted(
    state: PolicyState,
) -> None:
    good = pod([container(image=GOOD_IMAGE)], annotations={"epguard.io/skip": "habit"})
    d = decide(request(good), state)
    assert d.allowed and d.result == "allowed" and d.exemption is None
