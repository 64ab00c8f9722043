"""webhook.extraKinds: an admin's own workload kind, judged at apply without a release.
The chart renders its rule and matchCondition from the same template paths the engine
walks; the engine gets them through EPGUARD_EXTRA_KINDS."""

from __future__ import annotations

import json
from typing import Any

import celpy
import pytest

from epguard.webhook.engine.workloads import KindError, KindRegistry, parse_kinds
from epguard.webhook.settings import SettingsError, load
from tests.chart.chartlib import CEL_FUNCTIONS, render

FLAG = ["python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "mooncake"]
IMAGE = "registry.example.com/ml/sglang:0.5.23"


def _rendered() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    r = render("-f", "charts/epguard/ci/extra-kinds-values.yaml")
    vwc = next(o for o in r.objects if o["kind"] == "ValidatingWebhookConfiguration")
    deploy = next(
        o
        for o in r.objects
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-webhook")
    )
    env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    kinds = json.loads(next(e["value"] for e in env if e["name"] == "EPGUARD_EXTRA_KINDS"))
    return vwc, kinds


def pool(worker_args: list[str], router_args: list[str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "workers": [
            {
                "name": "w",
                "template": {
                    "spec": {
                        "containers": [{"name": "sglang", "image": IMAGE, "args": worker_args}]
                    }
                },
            }
        ]
    }
    if router_args is not None:
        spec["router"] = {"name": "router", "image": IMAGE, "args": router_args}
    return {
        "apiVersion": "serving.example.com/v1",
        "kind": "InferencePool",
        "metadata": {"name": "p", "namespace": "ml"},
        "spec": spec,
    }


def test_each_extra_kind_gets_a_rule_and_a_cel_condition_from_its_paths() -> None:
    vwc, _ = _rendered()
    hooks = {w["name"]: w for w in vwc["webhooks"]}
    pool_hook = hooks["inferencepools.serving.example.com.extra.epguard.io"]
    assert pool_hook["rules"][0]["apiGroups"] == ["serving.example.com"]
    assert pool_hook["rules"][0]["apiVersions"] == ["v1", "v1beta1"]
    assert pool_hook["rules"][0]["scope"] == "Namespaced"
    trainer = hooks["clustertrainers.batch.example.com.extra.epguard.io"]
    assert trainer["rules"][0]["scope"] == "Cluster"
    expression = pool_hook["matchConditions"][0]["expression"]
    env = celpy.Environment()
    program = env.program(env.compile(expression), functions=CEL_FUNCTIONS)

    def sent(obj: dict[str, Any]) -> bool:
        return bool(program.evaluate({"object": celpy.json_to_cel(obj)}))

    assert sent(pool(FLAG))
    assert sent(pool(["--tp", "8"], router_args=FLAG))
    assert not sent(pool(["--tp", "8"]))
    assert not sent(
        {
            "apiVersion": "serving.example.com/v1",
            "kind": "InferencePool",
            "metadata": {"name": "p"},
            "spec": {},
        }
    )


def test_the_engine_judges_the_kind_from_the_values_the_chart_passes() -> None:
    _, kinds = _rendered()
    settings = load([], {"EPGUARD_EXTRA_KINDS": json.dumps(kinds)})
    registry = KindRegistry(settings.extra_kinds)
    views = registry.pod_templates("serving.example.com", "InferencePool", pool(FLAG, ["-v"]))
    assert views is not None
    assert [v.where for v in views] == ["spec.workers[w].template", "spec.router"]
    assert [c.name for v in views for c in v.containers] == ["sglang", "router"]
    assert registry.pod_templates("serving.example.com", "Other", {}) is None


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("{}", "expected a list"),
        ("[{kind: X}]", "group"),
        (
            '[{group: g, versions: [v1], kind: K, resource: ks, templates: ["spec.a-b"]}]',
            "dotted field names",
        ),
        ("[{group: g, versions: [v1], kind: K, resource: ks}]", "at least one"),
        (
            '[{group: g, versions: [v1], kind: K, resource: ks, podSpecs: ["spec"], scope: Both}]',
            "scope",
        ),
        (
            "[{group: apps, versions: [v1], kind: Deployment, resource: deployments, "
            'templates: ["spec.template"]}]',
            "built in already",
        ),
        ("[unclosed", "not valid JSON or YAML"),
    ],
)
def test_a_bad_extra_kind_is_refused_naming_the_field(text: str, complaint: str) -> None:
    with pytest.raises(KindError, match=complaint):
        parse_kinds(text, "webhook.extraKinds")
    with pytest.raises(SettingsError, match=complaint):
        load([], {"EPGUARD_EXTRA_KINDS": text})
