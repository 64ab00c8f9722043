"""The probe-injection side of the chart: the MutatingWebhookConfiguration, the values it
reads, the environment the webhook and the controller get for it, and its RBAC."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from epguard.webhook.engine.namespaces import INJECT_ON
from tests.chart.chartlib import (
    CHART,
    NAMESPACE,
    REPO,
    VARIANT_IDS,
    VARIANTS,
    Rendered,
    notes,
    render,
    run_helm,
    variant_args,
)

Obj = dict[str, Any]
MUTATING = "MutatingWebhookConfiguration"
MIRROR = "registry.example.com/mirror/epguard@sha256:" + "2" * 64


def fullname(r: Rendered) -> str:
    return "guard" if r.name == "minimal-values" else "epguard"


def container(r: Rendered, deployment: str, name: str) -> Obj:
    d = r.one("Deployment", f"{fullname(r)}-{deployment}")
    (c,) = [c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c  # type: ignore[no-any-return]


def env_of(c: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def hooks(r: Rendered) -> dict[str, Obj]:
    return {w["name"]: w for w in r.one(MUTATING)["webhooks"]}


def selector(hook: Obj) -> dict[str, Obj]:
    return {e["key"]: e for e in hook["namespaceSelector"]["matchExpressions"]}


# Every variant but the one that turns injection off (test_turning_injection_off_removes_it).
INJECTING = [(p, i) for p, i in zip(VARIANTS, VARIANT_IDS, strict=True) if i != "minimal-values"]


@pytest.fixture(params=[p for p, _ in INJECTING], ids=[i for _, i in INJECTING])
def injecting(request: pytest.FixtureRequest) -> Rendered:
    path: Path | None = request.param
    return render(*variant_args(path), name=path.stem if path else "defaults")


class TestMutatingWebhookConfiguration:
    def test_it_is_named_for_the_controller_and_has_the_two_opt_in_webhooks(
        self, injecting: Rendered
    ) -> None:
        r = injecting
        assert r.one(MUTATING)["metadata"]["name"] == f"{fullname(r)}-inject"
        assert list(hooks(r)) == ["namespace.inject.epguard.io", "annotation.inject.epguard.io"]

    def test_every_webhook_has_the_fixed_settings_of_best_effort_injection(
        self, injecting: Rendered
    ) -> None:
        r = injecting
        for w in hooks(r).values():
            assert w["admissionReviewVersions"] == ["v1"]
            assert w["sideEffects"] == "None"
            assert w["failurePolicy"] == "Ignore"
            assert w["reinvocationPolicy"] == "IfNeeded"
            assert "caBundle" not in w["clientConfig"]  # owned by the controller/cainjector

    def test_only_pod_creation_is_sent(self, injecting: Rendered) -> None:
        r = injecting
        for w in hooks(r).values():
            assert w["rules"] == [
                {
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": ["pods"],
                    "operations": ["CREATE"],
                    "scope": "Namespaced",
                }
            ]

    def test_it_calls_mutate_on_the_rendered_webhook_service(self, injecting: Rendered) -> None:
        r = injecting
        (svc,) = r.all("Service")
        port = svc["spec"]["ports"][0]["port"]
        for w in hooks(r).values():
            assert w["clientConfig"]["service"] == {
                "name": svc["metadata"]["name"],
                "namespace": NAMESPACE,
                "path": "/mutate",
                "port": port,
            }

    def test_the_timeout_follows_the_value(
        self, defaults: Rendered, ci_file: Callable[[str], Rendered]
    ) -> None:
        assert {w["timeoutSeconds"] for w in hooks(defaults).values()} == {5}
        assert {w["timeoutSeconds"] for w in hooks(ci_file("injection-values")).values()} == {10}

    def test_system_release_and_opted_out_namespaces_are_never_injected(
        self, defaults: Rendered, ci_file: Callable[[str], Rendered]
    ) -> None:
        for r, extra in (
            (defaults, set()),
            (ci_file("no-exemptions-values"), {"monitoring", "gpu-operator"}),
        ):
            for w in hooks(r).values():
                exprs = selector(w)
                assert exprs["kubernetes.io/metadata.name"]["operator"] == "NotIn"
                assert (
                    set(exprs["kubernetes.io/metadata.name"]["values"])
                    == {
                        "kube-system",
                        NAMESPACE,
                    }
                    | extra
                )
                assert exprs["epguard.io/ignore"] == {
                    "key": "epguard.io/ignore",
                    "operator": "NotIn",
                    "values": ["true"],
                }

    def test_the_namespace_exclusions_are_the_validating_webhooks_own(
        self, injecting: Rendered
    ) -> None:
        r = injecting
        vwc = r.one("ValidatingWebhookConfiguration")["webhooks"][0]
        for w in hooks(r).values():
            assert (
                w["namespaceSelector"]["matchExpressions"][:-1]
                == (vwc["namespaceSelector"]["matchExpressions"])
            )

    def test_namespace_opt_in_and_annotation_opt_in_select_disjoint_namespaces(
        self, defaults: Rendered
    ) -> None:
        # webhook matchConditions get no namespaceObject (it is null there), so the
        # namespace label can only be read by a namespaceSelector; NotIn also matches
        # namespaces without the label. Disjoint: no pod is ever sent twice.
        h = hooks(defaults)
        assert selector(h["namespace.inject.epguard.io"])["epguard.io/inject"] == {
            "key": "epguard.io/inject",
            "operator": "In",
            "values": sorted(INJECT_ON, key=["enabled", "true"].index),
        }
        assert selector(h["annotation.inject.epguard.io"])["epguard.io/inject"] == {
            "key": "epguard.io/inject",
            "operator": "NotIn",
            "values": sorted(INJECT_ON, key=["enabled", "true"].index),
        }

    def test_the_elastic_ep_condition_is_the_validating_pods_condition_verbatim(
        self, injecting: Rendered
    ) -> None:
        r = injecting
        (pods,) = [
            w
            for w in r.one("ValidatingWebhookConfiguration")["webhooks"]
            if w["name"] == "pods.epguard.io"
        ]
        # The validating pods webhook also sends pods that carry epguard's own parts:
        # its condition is that test OR the mutating webhooks' condition, verbatim.
        (sent,) = pods["matchConditions"]
        parts, _, mentions = sent["expression"].partition(" || (has(object.spec)")
        assert sent["name"] == "mentions-elastic-ep-or-epguard-parts"
        assert "epguard.io/probed" in parts
        for w in hooks(r).values():
            assert w["matchConditions"][0] == {
                "name": "mentions-elastic-ep",
                "expression": "(has(object.spec)" + mentions,
            }

    def test_only_the_annotation_webhook_checks_the_annotation(self, defaults: Rendered) -> None:
        h = hooks(defaults)
        assert [c["name"] for c in h["namespace.inject.epguard.io"]["matchConditions"]] == [
            "mentions-elastic-ep"
        ]
        assert [c["name"] for c in h["annotation.inject.epguard.io"]["matchConditions"]] == [
            "mentions-elastic-ep",
            "inject-annotation",
        ]

    def test_no_condition_reads_the_namespace_object_the_api_server_leaves_null(
        self, injecting: Rendered
    ) -> None:
        r = injecting
        for w in hooks(r).values():
            for cond in w["matchConditions"]:
                assert "namespaceObject" not in cond["expression"]

    def test_the_object_selector_is_shared_with_the_validating_webhooks(
        self, ci_file: Callable[[str], Rendered], defaults: Rendered
    ) -> None:
        r = ci_file("no-exemptions-values")
        for w in hooks(r).values():
            assert w["objectSelector"] == {
                "matchExpressions": [{"key": "epguard.io/opt-out", "operator": "DoesNotExist"}]
            }
        assert all("objectSelector" not in w for w in hooks(defaults).values())

    def test_cert_manager_mode_asks_cainjector_for_this_bundle_too(
        self, ci_file: Callable[[str], Rendered], defaults: Rendered
    ) -> None:
        for stem in ("cert-manager-values", "cert-manager-issuer-values"):
            mwc = ci_file(stem).one(MUTATING)
            assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
                f"{NAMESPACE}/epguard-webhook"
            )
        assert "annotations" not in defaults.one(MUTATING)["metadata"]

    def test_platform_annotations_reach_both_configurations(
        self, ci_file: Callable[[str], Rendered]
    ) -> None:
        r = ci_file("warn-mode-values")
        assert r.one(MUTATING)["metadata"]["annotations"] == {
            "admissions.enforcer/disabled": "true"
        }

    def test_turning_injection_off_removes_it(self, ci_file: Callable[[str], Rendered]) -> None:
        assert ci_file("minimal-values").maybe(MUTATING) is None


class TestControllerKeepsTheBundle:
    def test_the_controller_is_told_the_mutating_configurations_name(
        self, variant: Rendered
    ) -> None:
        from epguard.webhook.controller.config import parse

        env = env_of(container(variant, "controller", "controller"))
        mwc = variant.maybe(MUTATING)
        expected = mwc["metadata"]["name"] if mwc else ""
        assert env["EPGUARD_MUTATING_WEBHOOK"] == expected
        strings = {k: v for k, v in env.items() if isinstance(v, str)}
        assert parse([], env=strings).mutating_webhook == expected

    def test_rbac_lets_it_patch_exactly_that_configuration(self, variant: Rendered) -> None:
        role = variant.one("ClusterRole", f"{fullname(variant)}-controller")
        rules = [r for r in role["rules"] if "mutatingwebhookconfigurations" in r["resources"]]
        mwc = variant.maybe(MUTATING)
        cert_manager = variant.maybe("Certificate") is not None
        if mwc is None or cert_manager:
            assert rules == []
        else:
            (rule,) = rules
            assert rule["resourceNames"] == [mwc["metadata"]["name"]]
            assert set(rule["verbs"]) == {"get", "list", "watch", "patch"}


class TestWebhookEnvironment:
    def test_the_probe_copy_image_defaults_to_the_charts_own_image(
        self, defaults: Rendered, ci_file: Callable[[str], Rendered]
    ) -> None:
        c = container(defaults, "webhook", "webhook")
        assert env_of(c)["EPGUARD_INJECT_IMAGE"] == c["image"]
        pinned = container(ci_file("metrics-values"), "webhook", "webhook")
        assert env_of(pinned)["EPGUARD_INJECT_IMAGE"] == pinned["image"]
        assert pinned["image"].endswith("@sha256:" + "1" * 64)

    def test_a_mirrored_copy_image_and_the_probe_level_follow_the_values(
        self, defaults: Rendered, ci_file: Callable[[str], Rendered]
    ) -> None:
        assert env_of(container(defaults, "webhook", "webhook"))["EPGUARD_PROBE_LEVEL"] == "import"
        env = env_of(container(ci_file("injection-values"), "webhook", "webhook"))
        assert (env["EPGUARD_INJECT_IMAGE"], env["EPGUARD_PROBE_LEVEL"]) == (MIRROR, "smoke")

    def test_the_webhooks_settings_read_the_injection_environment(
        self, ci_file: Callable[[str], Rendered]
    ) -> None:
        from epguard.webhook import settings

        c = container(ci_file("injection-values"), "webhook", "webhook")
        env = {k: v for k, v in env_of(c).items() if isinstance(v, str)}
        loaded = settings.load([], env)
        assert (loaded.inject_image, loaded.probe_level) == (MIRROR, "smoke")

    def test_the_probe_levels_offered_are_the_probes_own(self) -> None:
        # Asked from the probe's own command line, as the injected container runs it.
        out = subprocess.run(
            [sys.executable, str(REPO / "probe"), "--help"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        match = re.search(r"--level \{([a-z,]+)\}", out)
        assert match, out
        schema = json.loads((CHART / "values.schema.json").read_text())
        offered = schema["properties"]["injection"]["properties"]["probeLevel"]["enum"]
        assert offered == match.group(1).split(",")

    @pytest.mark.parametrize(
        ("stem", "hours"),
        [(None, 24.0), ("injection-values", 0.5), ("metrics-values", 12.0)],
    )
    def test_the_verdict_ttl_reaches_the_webhooks_settings(
        self,
        stem: str | None,
        hours: float,
        defaults: Rendered,
        ci_file: Callable[[str], Rendered],
    ) -> None:
        from epguard.webhook import settings

        r = defaults if stem is None else ci_file(stem)
        env = {
            k: v
            for k, v in env_of(container(r, "webhook", "webhook")).items()
            if isinstance(v, str)
        }
        assert settings.load([], env).verdict_ttl_hours == hours

    def test_no_container_sets_a_variable_twice(self, variant: Rendered) -> None:
        for d in variant.all("Deployment"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                names = [e["name"] for e in c.get("env", [])]
                assert len(names) == len(set(names)), (d["metadata"]["name"], names)

    @pytest.mark.parametrize(
        ("section", "variable"),
        [
            ("webhook", "EPGUARD_VERDICT_TTL_HOURS"),
            ("webhook", "EPGUARD_PROBE_LEVEL"),
            ("controller", "EPGUARD_MUTATING_WEBHOOK"),
        ],
    )
    def test_extra_env_that_shadows_a_value_fails_the_render_and_names_it(
        self, section: str, variable: str
    ) -> None:
        proc = run_helm(
            "template",
            "x",
            str(CHART),
            "--set",
            f"{section}.extraEnv[0].name={variable}",
            "--set-string",
            f"{section}.extraEnv[0].value=1",
            check=False,
        )
        assert proc.returncode != 0
        assert f"{section}.extraEnv sets {variable}" in proc.stderr

    def test_other_extra_env_is_appended(self, ci_file: Callable[[str], Rendered]) -> None:
        env = container(ci_file("metrics-values"), "webhook", "webhook")["env"]
        assert env[-1] == {"name": "EPGUARD_RELOAD_INTERVAL", "value": "5"}


class TestNotes:
    def notes(self, *extra: str) -> str:
        return notes(*extra)

    def test_notes_say_how_to_opt_in_to_injection(self) -> None:
        text = self.notes()
        assert "kubectl label namespace NAME epguard.io/inject=enabled" in text
        assert 'epguard.io/inject: "enabled"' in text
        assert "kubectl get mutatingwebhookconfiguration epguard-inject" in text
        assert "24 hours (webhook.verdictTTLHours)" in text

    def test_notes_say_when_injection_is_off(self) -> None:
        text = self.notes("--set", "injection.enabled=false")
        assert "Probe injection is off" in text
        assert "epguard.io/inject=enabled" not in text


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--set", "backstop.enabled=false"),
        ("--set", "fullnameOverride=guard", "--set", "backstop.enabled=false"),
        ("--set", "fullnameOverride=guard", "--kube-version", "1.33.0"),
        ("--set", "injection.keyRotationDays=7", "--set", "backstop.enabled=false"),
    ],
    ids=["defaults", "backstop-off", "renamed-backstop-off", "renamed-1.33", "rotation-7"],
)
def test_the_controller_makes_the_probe_key_the_webhook_reads_whatever_the_backstop(
    args: tuple[str, ...],
) -> None:
    # The controller creates and rotates the signing key; the webhook reads it by name.
    # These two settings once rendered only with the backstop on: a release not named
    # "epguard" with the backstop off (off by default on Kubernetes 1.30-1.33) left the
    # webhook with no key at all (unsigned probes, no preflight gate, no learning).
    r = render(*args)
    name = "guard" if "fullnameOverride=guard" in args else "epguard"

    def env(component: str) -> dict[str, Any]:
        d = r.one("Deployment", f"{name}-{component}")
        (c,) = [c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == component]
        return env_of(c)

    controller, webhook = env("controller"), env("webhook")
    assert controller["EPGUARD_PROBE_KEY_SECRET"] == webhook["EPGUARD_PROBE_KEY_SECRET"]
    assert webhook["EPGUARD_PROBE_KEY_SECRET"] == f"{name}-probe-key"
    days = "7" if "injection.keyRotationDays=7" in args else "30"
    assert controller["EPGUARD_PROBE_KEY_ROTATION_DAYS"] == days
