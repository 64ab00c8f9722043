"""What `helm template` renders, with the defaults and with each ci/*.yaml variant."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml

from epguard.probe import cmdline
from epguard.webhook import settings
from epguard.webhook.controller.compiler import BackstopConfig, object_names
from epguard.webhook.engine import rules as rule_loader
from epguard.webhook.engine.workloads import PATH_KINDS
from tests.chart.chartlib import (
    CHART,
    CI_VALUES,
    NAMESPACE,
    REPO,
    Rendered,
    notes,
    render,
    run_helm,
    variant_args,
)

Obj = dict[str, Any]

WORKLOAD_RESOURCES = {
    ("", "pods"),
    ("", "pods/ephemeralcontainers"),  # kubectl debug
    ("apps", "deployments"),
    ("apps", "statefulsets"),
    ("apps", "daemonsets"),
    ("apps", "replicasets"),
    ("batch", "jobs"),
    ("batch", "cronjobs"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets"),
    ("nvidia.com", "dynamographdeployments"),
    ("workloads.x-k8s.io", "rolebasedgroups"),
    ("disaggregatedset.x-k8s.io", "disaggregatedsets"),
    ("ome.io", "servingruntimes"),
    ("ome.io", "clusterservingruntimes"),
}


def container(deploy: Obj, name: str) -> Obj:
    found: list[Obj] = [
        c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == name
    ]
    assert len(found) == 1, name
    return found[0]


def env_of(c: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


class TestLint:
    @pytest.mark.parametrize(
        "values", [None, *CI_VALUES], ids=["defaults", *(p.stem for p in CI_VALUES)]
    )
    def test_helm_lint_passes_in_strict_mode(self, values: Any) -> None:
        proc = run_helm(
            "lint", str(CHART), "--strict", "--namespace", NAMESPACE, *variant_args(values)
        )
        assert "0 chart(s) failed" in proc.stdout

    def test_every_variant_renders_the_core_objects(self, variant: Rendered) -> None:
        kinds = {o["kind"] for o in variant.objects}
        assert {"Deployment", "Service", "ValidatingWebhookConfiguration", "ClusterRole"} <= kinds

    def test_no_object_uses_helm_hooks_except_the_test_pod(self, variant: Rendered) -> None:
        # GitOps tools skip hooks: TLS and everything else must come without them.
        hooked = [
            o["metadata"]["name"]
            for o in variant.objects
            if "helm.sh/hook" in (o["metadata"].get("annotations") or {})
        ]
        assert all(o["kind"] == "Pod" for o in variant.objects if o["metadata"]["name"] in hooked)
        for o in variant.objects:
            if o["metadata"]["name"] in hooked:
                assert o["metadata"]["annotations"]["helm.sh/hook"] == "test"


class TestWebhookDeployment:
    def test_two_replicas_rolling_without_losing_one(self, defaults: Rendered) -> None:
        d = defaults.one("Deployment", "epguard-webhook")
        assert d["spec"]["replicas"] == 2
        assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    def test_a_stopping_pod_keeps_serving_while_its_endpoint_is_withdrawn(
        self, defaults: Rendered
    ) -> None:
        d = defaults.one("Deployment", "epguard-webhook")
        c = container(d, "webhook")
        delay = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert delay >= 3
        grace = d["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        assert grace >= delay + 10  # then uvicorn's own 10 s graceful shutdown
        off = render("--set", "webhook.shutdownDelaySeconds=0").one("Deployment", "epguard-webhook")
        assert "lifecycle" not in container(off, "webhook")

    def test_every_pod_meets_the_restricted_pod_security_standard(self, variant: Rendered) -> None:
        specs = [d["spec"]["template"]["spec"] for d in variant.all("Deployment")]
        specs += [p["spec"] for p in variant.all("Pod")]  # the helm test pod too
        allowed_volumes = {"configMap", "secret", "emptyDir", "projected", "downwardAPI"}
        for pod in specs:
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
            for v in pod.get("volumes", []):
                assert set(v) - {"name"} <= allowed_volumes, v
            for c in pod["containers"] + pod.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["readOnlyRootFilesystem"] is True
                assert sc["capabilities"]["drop"] == ["ALL"]
                assert not sc.get("capabilities", {}).get("add")
                assert not sc.get("privileged")

    def test_the_default_uid_is_the_images_fixed_non_root_uid(self, defaults: Rendered) -> None:
        pod = defaults.one("Deployment", "epguard-webhook")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 65532
        dockerfile = (REPO / "Dockerfile").read_text()
        assert "65532" in dockerfile

    def test_platform_assigned_uids_leave_the_fields_out(
        self, ci_file: Callable[..., Rendered]
    ) -> None:
        pod = ci_file("metrics-values").one("Deployment", "epguard-webhook")["spec"]["template"]
        assert "runAsUser" not in pod["spec"]["securityContext"]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True

    def test_requests_are_set_and_no_cpu_limit_throttles_admissions(
        self, variant: Rendered
    ) -> None:
        for d in variant.all("Deployment"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                assert c["resources"]["requests"]["cpu"]
                assert c["resources"]["requests"]["memory"]
                assert "cpu" not in c["resources"].get("limits", {})

    def test_probes_hit_healthz_and_readyz_over_https(self, defaults: Rendered) -> None:
        c = container(defaults.one("Deployment", "epguard-webhook"), "webhook")
        assert c["livenessProbe"]["httpGet"] == {
            "path": "/healthz",
            "port": "https",
            "scheme": "HTTPS",
        }
        assert c["readinessProbe"]["httpGet"] == {
            "path": "/readyz",
            "port": "https",
            "scheme": "HTTPS",
        }
        assert c["startupProbe"]["httpGet"] == c["livenessProbe"]["httpGet"]

    def test_the_startup_probe_is_quick_but_kills_no_sooner_than_liveness(
        self, defaults: Rendered
    ) -> None:
        # Checked every second, so readiness is checked as soon as the webhook answers;
        # liveness waits for it, so a slow start must get at least liveness's own grace.
        c = container(defaults.one("Deployment", "epguard-webhook"), "webhook")
        startup, liveness = c["startupProbe"], c["livenessProbe"]
        assert startup["periodSeconds"] == 1
        assert (
            startup["periodSeconds"] * startup["failureThreshold"]
            >= liveness["periodSeconds"] * liveness["failureThreshold"]
        )

    def test_the_webhook_gets_the_agreed_environment(self, defaults: Rendered) -> None:
        c = container(defaults.one("Deployment", "epguard-webhook"), "webhook")
        env = env_of(c)
        assert c["command"] == ["epguard-webhook"]
        assert env["EPGUARD_TLS_CERT"] == "/etc/epguard/tls/tls.crt"
        assert env["EPGUARD_TLS_KEY"] == "/etc/epguard/tls/tls.key"
        assert env["EPGUARD_RULES"] == "/etc/epguard/rules/rules.yaml"
        assert env["EPGUARD_PORT"] == "8443"
        assert env["EPGUARD_MODE"] == "enforce"
        assert env["EPGUARD_ALLOW_SKIP"] == "true"
        assert env["EPGUARD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert env["EPGUARD_RULES_CONFIGMAP"] == "epguard-rules"

    def test_the_webhook_settings_parser_accepts_the_rendered_environment(
        self, defaults: Rendered
    ) -> None:
        c = container(defaults.one("Deployment", "epguard-webhook"), "webhook")
        env = {k: v for k, v in env_of(c).items() if isinstance(v, str)}
        loaded = settings.load([], env)
        assert loaded.port == 8443 and loaded.mode == "enforce" and loaded.allow_skip is True

    def test_mode_and_exemptions_follow_the_values(self, ci_file: Callable[..., Rendered]) -> None:
        env = env_of(
            container(
                ci_file("no-exemptions-values").one("Deployment", "epguard-webhook"), "webhook"
            )
        )
        assert (env["EPGUARD_MODE"], env["EPGUARD_ALLOW_SKIP"]) == ("audit", "false")

    def test_only_the_serving_pair_is_mounted_never_the_ca_keys(self, variant: Rendered) -> None:
        d = variant.one("Deployment", f"{fullname(variant)}-webhook")
        (tls,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
        assert tls["secret"]["secretName"] == "epguard-tls"
        assert {i["key"] for i in tls["secret"]["items"]} == {"tls.crt", "tls.key"}

    def test_replicas_prefer_different_nodes(self, defaults: Rendered) -> None:
        pod = defaults.one("Deployment", "epguard-webhook")["spec"]["template"]["spec"]
        term = pod["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ][0]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert (
            term["podAffinityTerm"]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"]
            == "webhook"
        )

    def test_a_pdb_protects_two_replicas_and_is_left_out_for_one(
        self, defaults: Rendered, ci_file: Callable[..., Rendered]
    ) -> None:
        pdb = defaults.one("PodDisruptionBudget", "epguard-webhook")
        assert pdb["spec"]["minAvailable"] == 1
        assert ci_file("one-replica-fail-values").maybe("PodDisruptionBudget") is None

    def test_the_service_sends_443_to_the_https_port(self, defaults: Rendered) -> None:
        svc = defaults.one("Service", "epguard-webhook")
        assert svc["spec"]["ports"] == [
            {"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"}
        ]
        d = defaults.one("Deployment", "epguard-webhook")
        assert (
            svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        )

    def test_a_pinned_digest_replaces_the_tag(self, ci_file: Callable[..., Rendered]) -> None:
        d = ci_file("metrics-values").one("Deployment", "epguard-webhook")
        assert container(d, "webhook")["image"].endswith("@sha256:" + "1" * 64)


def fullname(r: Rendered) -> str:
    return "guard" if r.name == "minimal-values" else "epguard"


RULES_WEBHOOK = "rules.epguard.io"


def judging(r: Rendered) -> list[dict[str, Any]]:
    """The webhooks that judge workloads (all but the check of epguard's own rules)."""
    hooks = r.one("ValidatingWebhookConfiguration")["webhooks"]
    return [w for w in hooks if w["name"] != RULES_WEBHOOK]


class TestValidatingWebhookConfiguration:
    def test_every_webhook_has_the_fixed_safety_settings(self, variant: Rendered) -> None:
        vwc = variant.one("ValidatingWebhookConfiguration")
        for w in vwc["webhooks"]:
            assert w["admissionReviewVersions"] == ["v1"]
            assert w["sideEffects"] == "None"
            assert w["clientConfig"]["service"]["path"] == "/validate"
            assert "caBundle" not in w["clientConfig"]  # owned by the controller/cainjector
            assert len(w["matchConditions"]) == 1

    def test_defaults_are_ignore_and_five_seconds(self, defaults: Rendered) -> None:
        for w in defaults.one("ValidatingWebhookConfiguration")["webhooks"]:
            assert (w["failurePolicy"], w["timeoutSeconds"]) == ("Ignore", 5)

    def test_failure_policy_and_timeout_follow_the_values(
        self, ci_file: Callable[..., Rendered]
    ) -> None:
        hooks = ci_file("one-replica-fail-values").one("ValidatingWebhookConfiguration")["webhooks"]
        for w in hooks:
            # The check of epguard's own rules ConfigMap is always Ignore: an outage must
            # never keep an admin from fixing the rules.
            want = "Ignore" if w["name"] == RULES_WEBHOOK else "Fail"
            assert (w["failurePolicy"], w["timeoutSeconds"]) == (want, 10)
        assert RULES_WEBHOOK in {w["name"] for w in hooks}

    def test_only_the_rules_configmap_of_the_release_is_checked(self, defaults: Rendered) -> None:
        [w] = [
            w
            for w in defaults.one("ValidatingWebhookConfiguration")["webhooks"]
            if w["name"] == RULES_WEBHOOK
        ]
        assert w["rules"] == [
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["configmaps"],
                "operations": ["CREATE", "UPDATE"],
                "scope": "Namespaced",
            }
        ]
        assert w["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": "epguard-system"}
        }
        assert w["matchConditions"] == [
            {"name": "the-rules-configmap", "expression": "object.metadata.name == 'epguard-rules'"}
        ]

    def test_rules_cover_pods_and_every_workload_kind_on_create_and_update(
        self, defaults: Rendered
    ) -> None:
        seen = set()
        for w in judging(defaults):
            for rule in w["rules"]:
                assert rule["operations"] == ["CREATE", "UPDATE"]
                seen |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
        assert seen == WORKLOAD_RESOURCES

    def test_system_release_and_opted_out_namespaces_are_excluded(
        self, ci_file: Callable[..., Rendered], defaults: Rendered
    ) -> None:
        for r, extra in (
            (defaults, set()),
            (ci_file("no-exemptions-values"), {"monitoring", "gpu-operator"}),
        ):
            for w in judging(r):
                exprs = {e["key"]: e for e in w["namespaceSelector"]["matchExpressions"]}
                names = exprs["kubernetes.io/metadata.name"]
                assert names["operator"] == "NotIn"
                assert set(names["values"]) == {"kube-system", NAMESPACE} | extra
                assert exprs["epguard.io/ignore"] == {
                    "key": "epguard.io/ignore",
                    "operator": "NotIn",
                    "values": ["true"],
                }

    def test_extra_annotations_reach_the_configuration(
        self, ci_file: Callable[..., Rendered]
    ) -> None:
        vwc = ci_file("warn-mode-values").one("ValidatingWebhookConfiguration")
        assert vwc["metadata"]["annotations"] == {"admissions.enforcer/disabled": "true"}

    def test_cert_manager_mode_asks_cainjector_for_the_bundle(
        self, ci_file: Callable[..., Rendered], defaults: Rendered
    ) -> None:
        vwc = ci_file("cert-manager-values").one("ValidatingWebhookConfiguration")
        assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
            f"{NAMESPACE}/epguard-webhook"
        )
        assert "annotations" not in defaults.one("ValidatingWebhookConfiguration")["metadata"]

    def test_the_service_reference_matches_the_rendered_service(self, variant: Rendered) -> None:
        svc_names = {s["metadata"]["name"] for s in variant.all("Service")}
        for w in variant.one("ValidatingWebhookConfiguration")["webhooks"]:
            ref = w["clientConfig"]["service"]
            assert ref["name"] in svc_names and ref["namespace"] == NAMESPACE and ref["port"] == 443

    def test_the_cel_needle_is_the_shortest_spelling_some_sglang_release_accepts(
        self, defaults: Rendered
    ) -> None:
        # Derived here from SGLang's option table: the shortest spelling a release leaves
        # unambiguous (every longer one holds it), as written, or with any non-word
        # characters between its letters (a shell's quotes, -''-elastic-ep-backend).
        shortest = cmdline.min_prefix()
        assert cmdline.BACKEND.startswith(shortest)
        pattern = "\\W*".join(shortest)
        for w in judging(defaults):
            expression = w["matchConditions"][0]["expression"]
            assert expression.count(f'string(s).contains("{shortest}")') == 1
            assert expression.count(f'string(s).matches(r"{pattern}")') == 1

    def test_every_path_kind_the_engine_knows_is_sent_by_the_chart(
        self, defaults: Rendered
    ) -> None:
        sent = {
            (g, r)
            for w in defaults.one("ValidatingWebhookConfiguration")["webhooks"]
            for rule in w["rules"]
            for g in rule["apiGroups"]
            for r in rule["resources"]
        }
        assert {(k.group, k.resource) for k in PATH_KINDS} <= sent
        assert ("workloads.x-k8s.io", "rolebasedgroups") in sent

    def test_each_rolebasedgroup_version_is_sent_as_it_is_written(
        self, defaults: Rendered
    ) -> None:
        # Under matchPolicy Equivalent the API server converts an object to a webhook's
        # version before its CEL, through RBG's conversion webhook; with a webhook per
        # version that made every RoleBasedGroup write depend on RBG's webhook.
        hooks = defaults.one("ValidatingWebhookConfiguration")["webhooks"]
        rbg = [w for w in hooks if "rolebasedgroups" in w["rules"][0]["resources"]]
        versions = sorted(v for w in rbg for v in w["rules"][0]["apiVersions"])
        assert versions == ["v1alpha1", "v1alpha2"] and len(rbg) == 2
        assert {w["matchPolicy"] for w in rbg} == {"Exact"}
        others = {w["matchPolicy"] for w in hooks if w not in rbg}
        assert others == {"Equivalent"}


class TestTLS:
    def test_self_managed_tls_runs_the_controller_with_cert_management(
        self, defaults: Rendered
    ) -> None:
        c = container(defaults.one("Deployment", "epguard-controller"), "controller")
        env = env_of(c)
        assert c["command"] == ["epguard-controller"]
        assert env["EPGUARD_MANAGE_CERTS"] == "true"
        assert env["EPGUARD_TLS_SECRET"] == "epguard-tls"
        assert env["EPGUARD_SERVICE"] == "epguard-webhook"
        assert env["EPGUARD_VALIDATING_WEBHOOK"] == "epguard"
        assert defaults.maybe("Certificate") is None

    def test_the_controller_parses_its_rendered_environment(self, variant: Rendered) -> None:
        from epguard.webhook.controller.config import parse

        d = variant.one("Deployment", f"{fullname(variant)}-controller")
        env = {k: v for k, v in env_of(container(d, "controller")).items() if isinstance(v, str)}
        cfg = parse([], env=env)
        svc = f"{fullname(variant)}-webhook"
        if cfg.manage_certs:
            assert (
                cfg.policy is not None and cfg.policy.dns_names[0] == f"{svc}.{cfg.namespace}.svc"
            )

    def test_cert_manager_mode_issues_into_the_same_secret(
        self, ci_file: Callable[..., Rendered]
    ) -> None:
        r = ci_file("cert-manager-values")
        cert = r.one("Certificate", "epguard-webhook")
        assert cert["spec"]["secretName"] == "epguard-tls"
        assert "epguard-webhook.epguard-system.svc" in cert["spec"]["dnsNames"]
        assert cert["spec"]["issuerRef"]["name"] == "epguard-ca"
        assert {i["metadata"]["name"] for i in r.all("Issuer")} == {
            "epguard-selfsigned",
            "epguard-ca",
        }
        env = env_of(container(r.one("Deployment", "epguard-controller"), "controller"))
        assert env["EPGUARD_MANAGE_CERTS"] == "false"

    def test_an_existing_issuer_is_used_without_creating_one(
        self, ci_file: Callable[..., Rendered]
    ) -> None:
        r = ci_file("cert-manager-issuer-values")
        assert r.one("Certificate")["spec"]["issuerRef"] == {
            "name": "corp-ca",
            "kind": "ClusterIssuer",
            "group": "cert-manager.io",
        }
        assert r.all("Issuer") == []


class TestRBAC:
    def rules(self, r: Rendered, kind: str, name: str) -> list[Obj]:
        return r.one(kind, name)["rules"]  # type: ignore[no-any-return]

    def test_no_rule_uses_a_wildcard(self, variant: Rendered) -> None:
        for kind in ("Role", "ClusterRole"):
            for role in variant.all(kind):
                for rule in role["rules"]:
                    for field in ("apiGroups", "resources", "verbs"):
                        assert "*" not in rule[field], (role["metadata"]["name"], rule)

    def test_the_webhook_only_reads_and_posts_events_in_its_namespace(
        self, defaults: Rendered
    ) -> None:
        for rule in self.rules(defaults, "ClusterRole", "epguard-webhook"):
            assert set(rule["verbs"]) <= {"get", "list", "watch"}
        for rule in self.rules(defaults, "Role", "epguard-webhook"):
            if rule["resources"] == ["events"]:
                assert rule["verbs"] == ["create"]
            else:
                assert set(rule["verbs"]) <= {"get", "list", "watch"}
        cluster = self.rules(defaults, "ClusterRole", "epguard-webhook")
        assert {r for rule in cluster for r in rule["resources"]} == {"namespaces", "imageverdicts"}
        ns = self.rules(defaults, "Role", "epguard-webhook")
        reads = [rule for rule in ns if rule["resources"] != ["events"]]
        assert all(rule["resourceNames"] for rule in reads)  # by name only (docs/rbac.md)

    def test_the_controller_touches_only_its_own_secret_and_webhook_configurations(
        self, defaults: Rendered
    ) -> None:
        role = self.rules(defaults, "Role", "epguard-controller")
        secret_rules = [r for r in role if "secrets" in r["resources"]]
        assert {"verbs": ["create"], "apiGroups": [""], "resources": ["secrets"]} in secret_rules
        for r in secret_rules:
            if r["verbs"] != ["create"]:
                assert r["resourceNames"] in (["epguard-tls"], ["epguard-probe-key"])
        cluster = self.rules(defaults, "ClusterRole", "epguard-controller")
        policies = object_names(BackstopConfig("", name="epguard-backstop"))
        for r in cluster:
            if r["apiGroups"] != ["admissionregistration.k8s.io"]:
                continue
            if any(res.endswith("webhookconfigurations") for res in r["resources"]):
                assert r["resourceNames"] in (["epguard"], ["epguard-inject"])
                assert "delete" not in r["verbs"] and "create" not in r["verbs"]
            elif r["verbs"] != ["create"]:
                # The backstop's policies and bindings: by name (`create` cannot be).
                assert r["resourceNames"] == policies

    def test_with_cert_manager_the_controller_gets_only_the_probe_key_and_no_webhook_access(
        self, ci_file: Callable[..., Rendered]
    ) -> None:
        r = ci_file("cert-manager-values")
        every = self.rules(r, "Role", "epguard-controller") + self.rules(
            r, "ClusterRole", "epguard-controller"
        )
        resources = {res for rule in every for res in rule["resources"]}
        named = {
            n
            for rule in every
            if "secrets" in rule["resources"]
            for n in rule.get("resourceNames", [])
        }
        assert named == {"epguard-probe-key"}  # the probe key only: no TLS Secret
        # Only the backstop's ownerReference needs the webhook configuration: read it.
        webhook_rules = [r for r in every if "validatingwebhookconfigurations" in r["resources"]]
        assert [r["verbs"] for r in webhook_rules] == [["get"]]
        assert "mutatingwebhookconfigurations" not in resources

    def test_bindings_point_at_the_rendered_service_accounts(self, variant: Rendered) -> None:
        accounts = {s["metadata"]["name"] for s in variant.all("ServiceAccount")}
        for kind in ("RoleBinding", "ClusterRoleBinding"):
            for b in variant.all(kind):
                if b["metadata"]["name"] == "epguard-scan-recorder":
                    continue  # accounts the admin names (test_scan_recorder_render.py)
                for s in b["subjects"]:
                    assert s["name"] in accounts and s["namespace"] == NAMESPACE

    def test_pods_mount_tokens_only_where_needed(self, defaults: Rendered) -> None:
        for sa in defaults.all("ServiceAccount"):
            assert sa["automountServiceAccountToken"] is False
        test_pod = defaults.one("Pod")
        assert test_pod["spec"]["automountServiceAccountToken"] is False


class TestNetworkPolicy:
    def test_the_webhook_accepts_only_its_port(self, defaults: Rendered) -> None:
        np = defaults.one("NetworkPolicy", "epguard-webhook")
        assert np["spec"]["policyTypes"] == ["Ingress"]
        for rule in np["spec"]["ingress"]:
            assert rule["ports"] == [{"port": "https", "protocol": "TCP"}]

    def test_metrics_scrapers_are_admitted_only_when_metrics_are_on(
        self, defaults: Rendered, ci_file: Callable[..., Rendered]
    ) -> None:
        def peers(r: Rendered) -> list[Obj]:
            np = r.one("NetworkPolicy", "epguard-webhook")
            return [p for rule in np["spec"]["ingress"] for p in rule["from"]]

        monitoring = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
        }
        assert monitoring not in peers(defaults)
        on = peers(ci_file("metrics-values"))
        assert monitoring in on
        assert {"ipBlock": {"cidr": "10.0.0.0/16"}} in on

    def test_metrics_on_adds_scrape_annotations_for_https(
        self, defaults: Rendered, ci_file: Callable[..., Rendered]
    ) -> None:
        def annotations(r: Rendered) -> dict[str, str]:
            meta = r.one("Deployment", "epguard-webhook")["spec"]["template"]["metadata"]
            return meta.get("annotations") or {}

        assert "prometheus.io/scrape" not in annotations(defaults)
        on = annotations(ci_file("metrics-values"))
        assert on["prometheus.io/scrape"] == "true" and on["prometheus.io/scheme"] == "https"
        assert on["prometheus.io/port"] == "8443" and on["prometheus.io/path"] == "/metrics"

    def test_the_controller_accepts_no_connections(self, defaults: Rendered) -> None:
        np = defaults.one("NetworkPolicy", "epguard-controller")
        assert np["spec"]["ingress"] == []

    def test_network_policies_can_be_turned_off(self, ci_file: Callable[..., Rendered]) -> None:
        assert ci_file("minimal-values").all("NetworkPolicy") == []


class TestRulesConfigMap:
    def test_the_chart_copy_of_the_default_rules_is_the_webhooks_file(self) -> None:
        shipped = REPO / "webhook" / "data" / "default-rules.yaml"
        assert (CHART / "files" / "default-rules.yaml").read_bytes() == shipped.read_bytes(), (
            "copy webhook/data/default-rules.yaml to charts/epguard/files/default-rules.yaml"
        )

    def test_defaults_are_shipped_verbatim(self, defaults: Rendered) -> None:
        cm = defaults.one("ConfigMap", "epguard-rules")
        assert (
            cm["data"]["rules.yaml"].strip()
            == (CHART / "files" / "default-rules.yaml").read_text().strip()
        )

    def test_extra_rules_follow_the_defaults(self, rendered_with: Callable[..., Rendered]) -> None:
        r = rendered_with(
            "--set",
            "rules.extra[0].id=mine",
            "--set",
            "rules.extra[0].image=example.com/x:*",
            "--set",
            "rules.extra[0].reason=r",
            "--set",
            "rules.extra[0].remedy=m",
        )
        rules = yaml.safe_load(r.one("ConfigMap", "epguard-rules")["data"]["rules.yaml"])["rules"]
        defaults = yaml.safe_load((CHART / "files" / "default-rules.yaml").read_text())["rules"]
        assert [x["id"] for x in rules] == [x["id"] for x in defaults] + ["mine"]

    def test_custom_rules_alone_when_defaults_are_off(
        self, ci_file: Callable[..., Rendered]
    ) -> None:
        cm = ci_file("no-exemptions-values").one("ConfigMap", "epguard-rules")
        rules = yaml.safe_load(cm["data"]["rules.yaml"])["rules"]
        assert [x["id"] for x in rules] == ["our-sglang-2026-11-bad-pg", "our-sglang-legacy"]

    def test_the_rendered_rules_load_in_the_webhooks_rule_loader(self, variant: Rendered) -> None:
        cm = variant.maybe("ConfigMap", "epguard-rules")
        if cm is None:
            assert variant.name == "minimal-values"
            return
        loaded = rule_loader.load_rules_text(cm["data"]["rules.yaml"], "chart")
        assert loaded is not None

    def test_a_duplicate_rule_id_fails_the_render(self) -> None:
        first = yaml.safe_load((CHART / "files" / "default-rules.yaml").read_text())["rules"][0][
            "id"
        ]
        proc = run_helm(
            "template",
            "x",
            str(CHART),
            "--set",
            f"rules.extra[0].id={first}",
            "--set",
            "rules.extra[0].image=a",
            "--set",
            "rules.extra[0].reason=r",
            "--set",
            "rules.extra[0].remedy=m",
            check=False,
        )
        assert proc.returncode != 0 and "used twice" in proc.stderr

    def test_the_admin_can_own_the_configmap(self, ci_file: Callable[..., Rendered]) -> None:
        r = ci_file("minimal-values")
        assert r.maybe("ConfigMap") is None
        vols = r.one("Deployment", "guard-webhook")["spec"]["template"]["spec"]["volumes"]
        assert {
            "name": "rules",
            "configMap": {
                "name": "epguard-rules",
                "items": [{"key": "rules.yaml", "path": "rules.yaml"}],
            },
        } in vols


class TestCRDs:
    def test_imageverdicts_are_cluster_scoped_with_the_compatibility_columns(
        self, defaults: Rendered
    ) -> None:
        crd = defaults.one("CustomResourceDefinition", "imageverdicts.epguard.io")
        assert crd["spec"]["scope"] == "Cluster"
        (v,) = crd["spec"]["versions"]
        assert v["name"] == "v1alpha1" and crd["spec"]["names"]["kind"] == "ImageVerdict"
        cols = [c["name"].upper() for c in v["additionalPrinterColumns"] if "priority" not in c]
        assert cols == [
            "IMAGE", "DIGEST", "VERDICT", "SOURCE", "SGLANG", "TORCH", "MOONCAKE", "LAST SEEN"
        ]  # fmt: skip
        spec = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        assert spec["verdict"]["enum"] == ["Usable", "Unusable"]
        assert set(spec) >= {
            "image",
            "digest",
            "verdict",
            "reason",
            "versions",
            "firstSeen",
            "lastSeen",
            "pod",
            "count",
        }

    def test_crds_survive_uninstall_by_default(self, defaults: Rendered) -> None:
        for crd in defaults.all("CustomResourceDefinition"):
            assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    def test_the_kopf_peering_crd_comes_only_with_peering(
        self, defaults: Rendered, ci_file: Callable[..., Rendered]
    ) -> None:
        assert defaults.maybe("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev")
        one = ci_file("one-replica-fail-values")
        assert one.maybe("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev") is None
        assert ci_file("minimal-values").all("CustomResourceDefinition") == []
        # Another kopf operator's CRD is used as it is: helm would refuse to take it over.
        theirs = render("--set", "crds.kopfPeering=false")
        assert theirs.maybe("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev") is None
        assert {c["metadata"]["name"] for c in theirs.all("CustomResourceDefinition")} == {
            "imageverdicts.epguard.io", "refusedimagelists.epguard.io"}  # fmt: skip


class TestHelmTest:
    def test_the_test_pod_checks_tls_against_ca_crt_and_the_service_name(
        self, defaults: Rendered
    ) -> None:
        pod = defaults.one("Pod")
        c = pod["spec"]["containers"][0]
        env = env_of(c)
        assert env["EPGUARD_URL"] == f"https://epguard-webhook.{NAMESPACE}.svc:443/validate"
        vol = pod["spec"]["volumes"][0]["secret"]
        assert vol["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
        compile(c["args"][0], "helm-test", "exec")  # the script is valid Python

    def test_the_expectation_follows_mode_and_rules(
        self, ci_file: Callable[..., Rendered], defaults: Rendered
    ) -> None:
        env = env_of(defaults.one("Pod")["spec"]["containers"][0])
        first = yaml.safe_load((CHART / "files" / "default-rules.yaml").read_text())["rules"][0]
        assert env["EXPECT_RULE_ID"] == first["id"]
        custom = env_of(ci_file("no-exemptions-values").one("Pod")["spec"]["containers"][0])
        # The digest-pinned rule cannot be hit by a tag; the next one is used.
        assert (custom["EXPECT_RULE_ID"], custom["EXPECT_RULE_IMAGE"], custom["EXPECT_MODE"]) == (
            "our-sglang-legacy",
            "registry.example.com/ml/sglang:legacy-x",
            "audit",
        )


class TestNotes:
    def notes(self, *extra: str) -> str:
        return notes(*extra)

    def test_the_hold_warning_says_how_long_a_pod_is_held(self) -> None:
        # It said retainSeconds (0 s), where the retry comes after the longer of it and
        # the preflight's deadline (600 s).
        text = self.notes("--set", "preflight.onError=hold", "--set", "preflight.retainSeconds=0")
        assert "retried 600 s later" in text.split("\n\n", 1)[0]

    def test_risky_settings_come_first(self) -> None:
        text = self.notes("-f", str(CHART / "ci" / "one-replica-fail-values.yaml"))
        head = text.strip().splitlines()
        assert head[0].startswith("WARNINGS")
        warnings = text.split("\n\n", 1)[0]
        assert "replicaCount is 1" in warnings
        assert "failurePolicy is Fail" in warnings
        assert "allowSkip is true" in warnings
        assert text.index("WARNINGS") < text.index("See what epguard refused")

    def test_an_object_selector_tenants_can_step_outside_is_warned_about(self) -> None:
        assert "objectSelector" not in self.notes().split("\n\n", 1)[0]
        text = self.notes("--set", "webhook.objectSelector.matchLabels.team=ml")
        assert "webhook.objectSelector is set" in text.split("\n\n", 1)[0]

    def test_closing_the_exemption_door_removes_that_warning(self) -> None:
        text = self.notes("--set", "webhook.allowSkip=false")
        assert "allowSkip" not in text
        assert "failurePolicy is Ignore" in text  # the fail-open default is still spelled out

    def test_an_open_api_server_cidr_is_a_warning_until_narrowed(self) -> None:
        assert "apiServerCIDRs admits any address" in self.notes()
        narrowed = self.notes("--set", "networkPolicy.apiServerCIDRs={10.0.0.0/16}")
        assert "apiServerCIDRs" not in narrowed

    def test_an_architecture_left_open_or_doubled_is_a_warning(self) -> None:
        """Review helper: a tenant's pending pod for another architecture (an autoscaler
        adds the node) made the controller delete every verdict probes taught; values.yaml
        said so, the notes did not."""
        warnings = self.notes().split("\n\n", 1)[0]
        assert "controller.architectures is empty" in warnings
        one = self.notes("--set", "controller.architectures={amd64}")
        assert "controller.architectures" not in one
        two = self.notes("--set", "controller.architectures={amd64,arm64}")
        assert "controller.architectures names 2 architectures" in two.split("\n\n", 1)[0]

    def test_an_image_by_tag_alone_is_a_warning_until_pinned(self) -> None:
        warnings = self.notes().split("\n\n", 1)[0]
        assert "image.digest is empty" in warnings
        assert "ghcr.io/epguard/epguard:" in warnings
        pinned = self.notes("--set", "image.digest=sha256:" + "a" * 64)
        assert "image.digest" not in pinned

    def test_notes_say_how_to_see_refusals(self) -> None:
        text = self.notes()
        assert "kubectl get imageverdicts" in text
        assert "helm test epguard" in text
