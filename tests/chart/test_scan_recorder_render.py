"""The chart's scan recorder (scanRecorder.serviceAccounts): nobody by default; the named
accounts bound and held by a ValidatingAdmissionPolicy; typos and API servers without
ValidatingAdmissionPolicy fail the install; NOTES says who can refuse images. What the
policy admits and refuses is tested on a real API server (tests/e2e/test_scan_record.py)."""

from __future__ import annotations

import json

from tests.chart.chartlib import CHART, NAMESPACE, RELEASE, Rendered, notes, render, run_helm

NAME = "epguard-scan-recorder"
VALUES = CHART / "ci" / "scan-recorder-values.yaml"
TWO = json.dumps([{"namespace": "ci", "name": "image-scanner"},
                  {"namespace": "build-2", "name": "kaniko.bot"}])  # fmt: skip


def with_two() -> Rendered:
    return render("--set-json", f"scanRecorder.serviceAccounts={TWO}")


def test_nobody_may_record_scans_by_default(defaults: Rendered) -> None:
    names = {o["metadata"]["name"] for o in defaults.objects}
    assert NAME not in names
    assert not defaults.all("ClusterRoleBinding") or all(
        s.get("name") != "image-scanner"
        for b in defaults.all("ClusterRoleBinding") for s in b["subjects"]
    )  # fmt: skip


def test_each_named_account_is_bound_to_the_recorder_role() -> None:
    r = with_two()
    binding = r.one("ClusterRoleBinding", NAME)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": NAME}  # fmt: skip
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "namespace": "ci", "name": "image-scanner"},
        {"kind": "ServiceAccount", "namespace": "build-2", "name": "kaniko.bot"},
    ]


def test_the_policy_matches_only_the_named_accounts_and_denies() -> None:
    r = with_two()
    policy = r.one("ValidatingAdmissionPolicy", NAME)["spec"]
    assert policy["failurePolicy"] == "Fail"
    [match] = policy["matchConditions"]
    assert match["expression"] == (
        'request.userInfo.username in ["system:serviceaccount:ci:image-scanner",'
        '"system:serviceaccount:build-2:kaniko.bot"]'
    )
    [rule] = policy["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["imageverdicts"] and rule["apiGroups"] == ["epguard.io"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    binding = r.one("ValidatingAdmissionPolicyBinding", NAME)["spec"]
    assert binding == {"policyName": NAME, "validationActions": ["Deny"]}


def test_an_account_without_a_name_fails_the_install() -> None:
    bad = json.dumps([{"namespace": "ci"}])
    r = run_helm("template", RELEASE, str(CHART), "--set-json",
                 f"scanRecorder.serviceAccounts={bad}", check=False)  # fmt: skip
    assert r.returncode != 0 and "missing property 'name'" in r.stderr


def test_a_namespace_that_cannot_exist_fails_the_install() -> None:
    bad = json.dumps([{"namespace": "CI_Jobs", "name": "x"}])
    r = run_helm("template", RELEASE, str(CHART), "--set-json",
                 f"scanRecorder.serviceAccounts={bad}", check=False)  # fmt: skip
    assert r.returncode != 0 and "/scanRecorder/serviceAccounts/0/namespace" in r.stderr


def test_a_misspelt_key_fails_the_install() -> None:
    r = run_helm("template", RELEASE, str(CHART), "--set-json",
                 'scanRecorder.serviceAccount=[]', check=False)  # fmt: skip
    assert r.returncode != 0 and "'serviceAccount' not allowed" in r.stderr


def test_without_validating_admission_policy_the_install_fails() -> None:
    # A cluster's capabilities list kinds; this one lists Deployments but no VAP kind.
    r = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(VALUES),
                 "--api-versions", "apps/v1/Deployment", check=False)  # fmt: skip
    assert r.returncode != 0
    assert "scanRecorder.serviceAccounts needs admissionregistration.k8s.io/v1" in r.stderr


def test_the_notes_warn_who_can_refuse_any_image() -> None:
    text = notes("-f", str(VALUES))
    assert "scanRecorder.serviceAccounts: ci/image-scanner can refuse any image" in text
    assert "scanRecorder" not in notes()
