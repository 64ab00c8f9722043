"""Live rule edits: the rules ConfigMap (`epguard-rules` in `epguard-system`, key
`rules.yaml`) edited with kubectl changes what `kubectl apply` gets within 10 seconds,
with no restart. Each test restores the ConfigMap it found."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from devcluster import ControlPlane
from devcluster.stack import Stack
from tests.e2e.e2e_kube import (
    RELEASE_NAMESPACE,
    RULES_CONFIGMAP,
    apply,
    denied_by_epguard,
    eventually,
    output,
    pod,
    rules_text,
    set_rules_text,
    with_rule,
    without_rule,
    worker,
)

pytestmark = pytest.mark.e2e

LIVE_IMAGE = "registry.example.com/e2e/live:2026.11"
LIVE_RULE = {
    "id": "e2e-live-edit",
    "image": "registry.example.com/e2e/live:*",
    "reason": "added live by an admin",
    "remedy": "wait for the fixed build",
    "action": "deny",
}
WITHIN = 10.0  # what the issue promises for an edit


@pytest.fixture
def live_rules(control_plane: ControlPlane, epguard: Stack) -> Iterator[str]:
    """The rules text in force before the test; put back afterwards."""
    original = rules_text(control_plane)
    try:
        yield original
    finally:
        set_rules_text(control_plane, original)


def test_a_deny_rule_added_to_the_configmap_refuses_the_next_apply_within_10_seconds(
    control_plane: ControlPlane, live_rules: str, namespace: str
) -> None:
    obj = pod("sglang", namespace, worker(LIVE_IMAGE))
    assert apply(control_plane, obj, dry_run=True).returncode == 0

    set_rules_text(control_plane, with_rule(live_rules, LIVE_RULE))
    eventually(
        lambda: denied_by_epguard(apply(control_plane, obj, dry_run=True)),
        within=WITHIN,
        what="the new rule to refuse",
    )

    r = apply(control_plane, obj)
    assert denied_by_epguard(r), output(r)
    assert (
        "added live by an admin. Fix: wait for the fixed build. [epguard rule e2e-live-edit]"
        in (r.stderr)
    )


def test_a_rule_turned_from_deny_to_warn_admits_with_a_warning_within_10_seconds(
    control_plane: ControlPlane, live_rules: str, namespace: str
) -> None:
    obj = pod("sglang", namespace, worker(LIVE_IMAGE))
    set_rules_text(control_plane, with_rule(live_rules, LIVE_RULE))
    eventually(lambda: denied_by_epguard(apply(control_plane, obj, dry_run=True)), what="deny")

    set_rules_text(control_plane, with_rule(live_rules, {**LIVE_RULE, "action": "warn"}))
    eventually(
        lambda: apply(control_plane, obj, dry_run=True).returncode == 0,
        within=WITHIN,
        what="the rule to turn into a warning",
    )

    r = apply(control_plane, obj)
    assert r.returncode == 0, r.stderr
    assert "which this image may not serve: added live by an admin" in r.stderr
    assert "[epguard rule e2e-live-edit, warn]" in r.stderr


def test_a_rule_removed_from_the_configmap_stops_refusing_within_10_seconds(
    control_plane: ControlPlane, live_rules: str, namespace: str
) -> None:
    obj = pod("sglang", namespace, worker(LIVE_IMAGE))
    with_live = with_rule(live_rules, LIVE_RULE)
    set_rules_text(control_plane, with_live)
    eventually(lambda: denied_by_epguard(apply(control_plane, obj, dry_run=True)), what="deny")

    set_rules_text(control_plane, without_rule(with_live, LIVE_RULE["id"]))
    eventually(
        lambda: apply(control_plane, obj, dry_run=True).returncode == 0,
        within=WITHIN,
        what="the removed rule to stop refusing",
    )

    r = apply(control_plane, obj)
    assert r.returncode == 0, r.stderr
    assert "e2e-live-edit" not in output(r)


def test_a_rules_edit_that_does_not_load_is_refused_at_apply_naming_the_entry(
    control_plane: ControlPlane, live_rules: str
) -> None:
    broken = with_rule(live_rules, {**LIVE_RULE, "action": "explode"})
    patch = json.dumps({"data": {"rules.yaml": broken}})
    r = control_plane.kubectl(
        "patch", "configmap", RULES_CONFIGMAP, "-n", RELEASE_NAMESPACE, "--type=merge",
        "-p", patch,
    )  # fmt: skip
    assert r.returncode != 0
    assert 'admission webhook "rules.epguard.io" denied the request' in r.stderr
    assert "epguard refuses this rules edit" in r.stderr
    assert "(id 'e2e-live-edit'): action" in r.stderr
    # Nothing was written: the ConfigMap still holds what was there.
    assert rules_text(control_plane) == live_rules
    # A valid edit still goes through.
    set_rules_text(control_plane, with_rule(live_rules, LIVE_RULE))
    assert "e2e-live-edit" in rules_text(control_plane)


def test_a_glob_that_can_never_match_is_warned_at_apply_and_told_on_the_configmap(
    control_plane: ControlPlane, live_rules: str
) -> None:
    typo = {**LIVE_RULE, "id": "e2e-typo", "image": "registry.example.com/E2E/live:*"}
    patch = json.dumps({"data": {"rules.yaml": with_rule(live_rules, typo)}})
    r = control_plane.kubectl(
        "patch", "configmap", RULES_CONFIGMAP, "-n", RELEASE_NAMESPACE, "--type=merge",
        "-p", patch,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    # kubectl prints the admission warning to the admin who made the edit ...
    assert "rule 'e2e-typo'" in r.stderr and "can never match" in r.stderr
    told: dict[str, str] = {}

    def on_the_configmap() -> bool:  # ... and the webhook tells it where rules live
        events = control_plane.kubectl(
            "get", "events", "-n", RELEASE_NAMESPACE, "-o", "json",
            f"--field-selector=involvedObject.name={RULES_CONFIGMAP},reason=EpguardRulesWarning",
        )  # fmt: skip
        items = json.loads(events.stdout)["items"] if events.returncode == 0 else []
        told.update(message=" ".join(e["message"] for e in items))
        return "e2e-typo" in told["message"]

    eventually(on_the_configmap, within=WITHIN, what="an EpguardRulesWarning Event")
    assert "lowercase" in told["message"]
