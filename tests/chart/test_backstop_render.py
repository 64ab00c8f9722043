"""The chart's side of the outage backstop: on where the API server can run it, off with
a warning where it cannot, and the controller given what it needs to judge as the
webhook does (the policies themselves are the controller's; see tests/e2e)."""

from __future__ import annotations

from typing import Any

import pytest

from epguard.webhook.controller.compiler import BackstopConfig, object_names
from tests.chart.chartlib import CHART, Rendered, notes, render, run_helm

Obj = dict[str, Any]


def controller_env(r: Rendered) -> dict[str, Any]:
    deploy = r.one("Deployment", "epguard-controller")
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def policy_rules(r: Rendered) -> list[Obj]:
    role = r.one("ClusterRole", "epguard-controller")
    return [x for x in role["rules"] if "validatingadmissionpolicies" in x["resources"]]


def test_on_by_default_with_the_webhooks_judgement_settings() -> None:
    r = render(
        "--set",
        "webhook.mode=warn",
        "--set",
        "webhook.excludeNamespaces={batch}",
        "--set-json",
        'webhook.objectSelector={"matchLabels":{"team":"ml"}}',
    )
    env = controller_env(r)
    assert env["EPGUARD_BACKSTOP"] == "epguard-backstop"
    assert env["EPGUARD_BACKSTOP_ENABLED"] == "true"
    assert env["EPGUARD_MODE"] == "warn"
    assert env["EPGUARD_ALLOW_SKIP"] == "true"
    assert env["EPGUARD_VERDICT_TTL_HOURS"] == "24"
    assert env["EPGUARD_EXCLUDE_NAMESPACES"] == "kube-system,batch"
    assert env["EPGUARD_OBJECT_SELECTOR"] == '{"matchLabels":{"team":"ml"}}'


def params_rules(r: Rendered) -> list[Obj]:
    role = r.one("ClusterRole", "epguard-controller")
    return [x for x in role["rules"] if "refusedimagelists" in x["resources"]]


def test_the_controller_may_touch_only_the_backstops_own_policies_and_parameters() -> None:
    r = render()
    names = object_names(BackstopConfig("", name="epguard-backstop"))
    by_verbs = {tuple(x["verbs"]): x.get("resourceNames") for x in policy_rules(r)}
    assert by_verbs == {("create",): None, ("get", "update", "delete"): names}
    # The parameters are epguard's own kind: a ConfigMap paramKind would need read access
    # to every ConfigMap in the cluster (the API server checks it when a policy is made).
    # Its shards' names carry their count: written by kind, not by name.
    assert {tuple(x["verbs"]): x.get("resourceNames") for x in params_rules(r)} == {
        ("get", "list", "watch", "create", "update", "delete"): None,
    }
    role = r.one("Role", "epguard-controller")
    configmaps = [x for x in role["rules"] if x["resources"] == ["configmaps"]]
    assert {tuple(x["verbs"]): x.get("resourceNames") for x in configmaps} == {
        ("get",): ["epguard-rules"],
    }
    cluster = r.one("ClusterRole", "epguard-controller")
    assert not [x for x in cluster["rules"] if "configmaps" in x["resources"]]


@pytest.mark.parametrize(
    "args",
    [("--set", "backstop.enabled=false"), ("--kube-version", "1.33.0")],
    ids=["disabled", "kubernetes-1.33"],
)
def test_off_means_only_the_right_to_remove_its_own_policies(args: tuple[str, ...]) -> None:
    # Turned off after it was on, the controller removes what the earlier release
    # installed: delete, by name, and nothing else.
    r = render(*args)
    env = controller_env(r)
    assert env["EPGUARD_BACKSTOP_ENABLED"] == "false"
    assert env["EPGUARD_BACKSTOP"] == "epguard-backstop"
    assert "EPGUARD_MODE" not in env
    names = object_names(BackstopConfig("", name="epguard-backstop"))
    assert [(x["verbs"], x.get("resourceNames")) for x in policy_rules(r)] == [(["delete"], names)]
    assert [(x["verbs"], x.get("resourceNames")) for x in params_rules(r)] == [
        (["delete"], ["epguard-backstop"]),
        (["deletecollection"], None),
    ]
    role = r.one("Role", "epguard-controller")
    assert not [x for x in role["rules"] if x["resources"] == ["configmaps"]]


def test_turned_off_the_notes_warn_that_known_bad_images_pass_during_an_outage() -> None:
    # (`helm install --dry-run` has no --kube-version: the 1.33 case is rendered above.)
    text = notes("--set", "backstop.enabled=false")
    assert "backstop.enabled is false" in text and "admitted" in text


def test_the_default_notes_say_the_backstop_covers_the_outage() -> None:
    assert "the backstop ValidatingAdmissionPolicies still refuse" in notes()


def test_a_typo_under_backstop_fails_the_install() -> None:
    r = run_helm("template", "x", str(CHART), "--set", "backstop.enabeld=true", check=False)
    assert r.returncode != 0 and "enabeld" in r.stderr


def test_the_parameter_maps_are_atomic_so_managed_fields_stay_small() -> None:
    # Per-key field ownership would list every digest again in managedFields and take
    # a 1 MiB shard past etcd's 1.5 MiB request limit.
    crd = render().one("CustomResourceDefinition", "refusedimagelists.epguard.io")
    data = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["data"]
    props = data["properties"]
    assert props["d"]["x-kubernetes-map-type"] == "atomic"
    assert props["t"]["x-kubernetes-map-type"] == "atomic"
    assert props["t"]["additionalProperties"]["x-kubernetes-map-type"] == "atomic"
    assert props["r"]["type"] == "array" and props["rules"]["type"] == "boolean"
