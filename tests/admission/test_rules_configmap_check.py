"""epguard judges edits of its own rules ConfigMap (the decision layer; the chart's
``rules.epguard.io`` webhook sends them, see tests/e2e/test_live_rules.py): an edit
whose rules would not load is refused, naming what is wrong, so a broken edit never
becomes the file a restarted webhook starts from."""

from __future__ import annotations

from typing import Any

import pytest

from epguard.webhook.admission.handler import RulesConfigMap, Validator
from epguard.webhook.engine.policy import PolicyState
from epguard.webhook.engine.review import AdmissionRequest, GroupVersionKind
from epguard.webhook.engine.rules import RuleSet, RulesHolder
from tests.factory import TEST_RULES

WHERE = RulesConfigMap("epguard-system", "epguard-rules", "rules.yaml")


def _edit(data: dict[str, Any] | None, name: str = "epguard-rules",
          namespace: str = "epguard-system") -> AdmissionRequest:  # fmt: skip
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": name, "namespace": namespace}}  # fmt: skip
    if data is not None:
        obj["data"] = data
    return AdmissionRequest(
        uid="u-1", kind=GroupVersionKind(kind="ConfigMap"), operation="UPDATE",
        namespace=namespace, object=obj,
    )  # fmt: skip


def _validate(req: AdmissionRequest) -> Any:
    return Validator(PolicyState(rules=RulesHolder(RuleSet())), WHERE)(req)


def test_an_edit_whose_rules_load_is_admitted() -> None:
    o = _validate(_edit({"rules.yaml": TEST_RULES}))
    assert o.allowed and o.result == "allowed"


def test_an_edit_with_a_bad_entry_is_refused_naming_the_entry() -> None:
    bad = "rules:\n  - {id: a, image: 'x/*', reason: r, remedy: m, action: nope}\n"
    o = _validate(_edit({"rules.yaml": bad}))
    assert not o.allowed and o.result == "denied"
    assert "rules[0] (id 'a'): action" in (o.message or "")
    assert "configmap epguard-system/epguard-rules key rules.yaml" in (o.message or "")


def test_an_edit_that_is_not_yaml_is_refused_naming_the_line() -> None:
    o = _validate(_edit({"rules.yaml": "rules:\n  - {id: a\n  - ]]\n"}))
    assert not o.allowed
    assert "not valid YAML" in (o.message or "") and "line" in (o.message or "")


def test_an_edit_without_the_key_is_admitted_with_a_warning() -> None:
    o = _validate(_edit({"other": "x"}))
    assert o.allowed and o.warnings and "built-in rules" in o.warnings[0]


def test_an_edit_with_no_rules_is_admitted_with_a_warning() -> None:
    o = _validate(_edit({"rules.yaml": "rules: []\n"}))
    assert o.allowed and o.result == "warned"
    assert "holds no rules" in o.warnings[0]


@pytest.mark.parametrize(
    ("glob", "why"),
    [
        ("docker.io/LMSysOrg/sglang:*", "lowercase"),
        ("docker.io/lmsysorg/sglang@sha256:abc*", "use 'digest:'"),
        ("docker.io/lmsysorg/sglang:v0.5 *", "whitespace"),
        ("docker.io/lmsysorg/sglang:v0.5/x", "nowhere else"),
        ("docker.io/lmsysorg/sglang:v0.5,x", "a tag holds only"),
    ],
)
def test_an_edit_with_a_glob_that_can_never_match_is_admitted_with_a_warning(
    glob: str, why: str
) -> None:
    text = f"rules:\n  - {{id: typo, image: '{glob}', reason: r, remedy: m}}\n"
    o = _validate(_edit({"rules.yaml": text}))
    assert o.allowed and o.result == "warned", o
    assert "rule 'typo'" in o.warnings[0] and "can never match" in o.warnings[0]
    assert why in o.warnings[0]


def test_an_edit_whose_globs_can_match_has_no_warning() -> None:
    glob = "registry.local:5000/lmsysorg/sglang:v0.5.16-CU12*"
    text = f"rules:\n  - {{id: ok, image: '{glob}', reason: r, remedy: m}}\n"
    o = _validate(_edit({"rules.yaml": text}))
    assert o.allowed and o.result == "allowed" and not o.warnings


def test_other_configmaps_are_not_judged() -> None:
    for req in (_edit({"rules.yaml": "]["}, name="someone-else"),
                _edit({"rules.yaml": "]["}, namespace="tenant")):  # fmt: skip
        o = _validate(req)
        assert o.allowed and o.result == "ignored"


def test_without_a_rules_configmap_a_configmap_goes_to_the_engine() -> None:
    o = Validator(PolicyState(rules=RulesHolder(RuleSet())))(_edit({"rules.yaml": "]["}))
    assert o.allowed
