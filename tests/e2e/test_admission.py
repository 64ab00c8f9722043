"""Admission through the real kube-apiserver: what `kubectl apply` says for Pods and for
every workload kind, ordinary pods, server-side dry runs, exemptions, and the warn and
audit modes of a namespace. The webhook and its rules are the session's (`epguard`
fixture); the deny rule is `e2e_kube.DENY_RULE`, added to the live rules ConfigMap."""

from __future__ import annotations

import re
import ssl

import httpx
import pytest

from devcluster import ControlPlane
from devcluster.stack import Stack
from tests.e2e.e2e_kube import (
    BAD_IMAGE,
    DENY_RULE,
    DENY_RULE_ID,
    GOOD_IMAGE,
    apply,
    denied_by_epguard,
    eventually,
    exists,
    output,
    plain,
    pod,
    worker,
    workload,
)

pytestmark = pytest.mark.e2e

RULE_MESSAGE = (
    f"requests --elastic-ep-backend mooncake, which this image cannot serve: "
    f"{DENY_RULE['reason']}. Fix: {DENY_RULE['remedy']}. [epguard rule {DENY_RULE_ID}]"
)


class TestPods:
    def test_an_elastic_ep_pod_on_a_denied_image_is_refused_with_the_rules_reason(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        r = apply(control_plane, pod("sglang", namespace, worker(BAD_IMAGE)))

        assert r.returncode != 0
        assert 'admission webhook "pods.epguard.io" denied the request: ' in r.stderr
        assert f'container "worker" (image {BAD_IMAGE}) {RULE_MESSAGE}' in r.stderr
        assert not exists(control_plane, "pod", "sglang", namespace)

    def test_every_offending_container_is_named_in_one_message(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        obj = pod(
            "sglang",
            namespace,
            worker(BAD_IMAGE),
            initContainers=[worker(BAD_IMAGE, name="warmup")],
        )

        r = apply(control_plane, obj)

        assert denied_by_epguard(r), output(r)
        assert f'init container "warmup" (image {BAD_IMAGE}) {RULE_MESSAGE}; ' in r.stderr
        assert f'container "worker" (image {BAD_IMAGE}) {RULE_MESSAGE}' in r.stderr

    def test_the_same_pod_on_a_good_image_is_created(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        obj = pod("sglang", namespace, worker(GOOD_IMAGE))

        r = apply(control_plane, obj)

        assert r.returncode == 0, r.stderr
        assert "pod/sglang created" in r.stdout
        assert exists(control_plane, "pod", "sglang", namespace)

    def test_an_ordinary_pod_is_admitted_without_a_word_from_epguard(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        # The bad image without the flag: matchConditions keep it away from epguard.
        r = apply(control_plane, pod("web", namespace, plain(BAD_IMAGE)))

        assert r.returncode == 0, r.stderr
        assert "pod/web created" in r.stdout
        assert "epguard" not in output(r)

    def test_a_pod_carrying_epguards_label_is_refused_even_without_the_flag(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        # The label puts a pod on the list the controller reads each pass: only pods
        # epguard signed may carry it (the chart's matchCondition sends the rest).
        obj = pod("labelled", namespace, plain(GOOD_IMAGE))
        obj["metadata"]["labels"] = {"epguard.io/probed": "true"}

        r = apply(control_plane, obj)

        assert 'admission webhook "pods.epguard.io" denied the request: ' in r.stderr, output(r)
        assert "are epguard's own: remove them" in r.stderr
        assert not exists(control_plane, "pod", "labelled", namespace)

    def test_an_update_that_brings_in_a_denied_image_is_refused(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        # Only the image of a Pod may change after creation.
        assert apply(control_plane, pod("sglang", namespace, worker(GOOD_IMAGE))).returncode == 0

        r = apply(control_plane, pod("sglang", namespace, worker(BAD_IMAGE)))

        assert denied_by_epguard(r), output(r)
        assert "error when applying patch" in r.stderr
        got = control_plane.kubectl(
            "get", "pod", "sglang", "-n", namespace, "-o", "jsonpath={.spec.containers[0].image}"
        )
        assert got.stdout == GOOD_IMAGE


WORKLOADS = [
    # (kind as e2e_kube.workload names it, resource for kubectl get, webhook, where)
    ("Deployment", "deployment", "workloads.epguard.io", "spec.template"),
    ("StatefulSet", "statefulset", "workloads.epguard.io", "spec.template"),
    ("DaemonSet", "daemonset", "workloads.epguard.io", "spec.template"),
    ("ReplicaSet", "replicaset", "workloads.epguard.io", "spec.template"),
    ("Job", "job", "workloads.epguard.io", "spec.template"),
    ("CronJob", "cronjob", "cronjobs.epguard.io", "spec.jobTemplate.spec.template"),
    (
        "LeaderWorkerSet",
        "leaderworkerset",
        "leaderworkersets.epguard.io",
        "spec.leaderWorkerTemplate.workerTemplate",
    ),
    (
        "DynamoGraphDeployment",
        "dynamographdeployment.v1alpha1.nvidia.com",
        "dynamographdeployments.epguard.io",
        "spec.services.decode.extraPodSpec",
    ),
    (
        "DynamoGraphDeployment/v1beta1",
        "dynamographdeployment.v1beta1.nvidia.com",
        "dynamographdeployments.epguard.io",
        "spec.components[decode].podTemplate",
    ),
]


@pytest.mark.usefixtures("workload_crds")
class TestWorkloads:
    @pytest.mark.parametrize(("kind", "resource", "webhook", "where"), WORKLOADS)
    def test_a_workload_on_a_denied_image_is_refused_at_apply_naming_the_template(
        self,
        control_plane: ControlPlane,
        deny_rule: str,
        namespace: str,
        kind: str,
        resource: str,
        webhook: str,
        where: str,
    ) -> None:
        r = apply(control_plane, workload(kind, "sglang", namespace, BAD_IMAGE))

        assert r.returncode != 0
        assert f'admission webhook "{webhook}" denied the request: ' in r.stderr
        container = "main" if kind == "DynamoGraphDeployment" else "worker"
        assert f'container "{container}" in {where} (image {BAD_IMAGE}) {RULE_MESSAGE}' in r.stderr
        assert not exists(control_plane, resource, "sglang", namespace)

    @pytest.mark.parametrize(("kind", "resource", "webhook", "where"), WORKLOADS)
    def test_the_same_workload_on_a_good_image_is_created(
        self,
        control_plane: ControlPlane,
        deny_rule: str,
        namespace: str,
        kind: str,
        resource: str,
        webhook: str,
        where: str,
    ) -> None:
        r = apply(control_plane, workload(kind, "sglang", namespace, GOOD_IMAGE))

        assert r.returncode == 0, r.stderr
        assert "created" in r.stdout
        assert exists(control_plane, resource, "sglang", namespace)


class TestServerDryRun:
    def test_a_server_dry_run_is_refused_with_the_same_message(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        r = apply(control_plane, pod("sglang", namespace, worker(BAD_IMAGE)), dry_run=True)

        assert denied_by_epguard(r), output(r)
        assert f'container "worker" (image {BAD_IMAGE}) {RULE_MESSAGE}' in r.stderr

    def test_an_admitted_server_dry_run_creates_nothing(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        r = apply(control_plane, pod("sglang", namespace, worker(GOOD_IMAGE)), dry_run=True)

        assert r.returncode == 0, r.stderr
        assert "pod/sglang created (server dry run)" in r.stdout
        assert not exists(control_plane, "pod", "sglang", namespace)


class TestExemption:
    def test_the_skip_annotation_admits_a_denied_pod_with_a_warning_quoting_why(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        why = "INC-1234: image verified by hand"
        obj = pod("sglang", namespace, worker(BAD_IMAGE), annotations={"epguard.io/skip": why})

        r = apply(control_plane, obj)

        assert r.returncode == 0, r.stderr
        assert f"epguard checks skipped by annotation epguard.io/skip: {why}" in r.stderr
        assert exists(control_plane, "pod", "sglang", namespace)

    def test_the_skip_annotation_on_a_pod_template_admits_the_workload(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        obj = workload(
            "Deployment",
            "sglang",
            namespace,
            BAD_IMAGE,
            template_annotations={"epguard.io/skip": "canary"},
        )

        r = apply(control_plane, obj)

        assert r.returncode == 0, r.stderr
        assert "epguard.io/skip: canary" in r.stderr
        assert exists(control_plane, "deployment", "sglang", namespace)


def _webhook_metrics(epguard: Stack) -> str:
    assert epguard.webhook_url is not None
    base = epguard.webhook_url.rsplit("/", 1)[0]
    verify = ssl.create_default_context(cafile=str(epguard.webhook_tls.bundle_file))
    with httpx.Client(verify=verify, trust_env=False, timeout=10) as client:
        return client.get(f"{base}/metrics").text


def _audited(epguard: Stack) -> float:
    pattern = (
        r'^epguard_admission_decisions_total\{result="audited",rule="'
        + re.escape(DENY_RULE_ID)
        + r'"\} (\S+)$'
    )
    found = re.search(pattern, _webhook_metrics(epguard), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


class TestNamespaceModes:
    def test_in_a_warn_mode_namespace_a_denied_pod_is_admitted_with_the_denial_as_a_warning(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        control_plane.kubectl("label", "namespace", namespace, "epguard.io/mode=warn", check=True)
        obj = pod("sglang", namespace, worker(BAD_IMAGE))
        # The webhook learns namespace labels from a watch: wait until a dry run shows it.
        eventually(
            lambda: apply(control_plane, obj, dry_run=True).returncode == 0,
            what="the webhook to see the warn label",
        )

        r = apply(control_plane, obj)

        assert r.returncode == 0, r.stderr
        assert (
            f'Warning: epguard (warn mode) would deny: container "worker" (image {BAD_IMAGE})'
            in r.stderr
        )
        assert f"[epguard rule {DENY_RULE_ID}]" in r.stderr
        assert exists(control_plane, "pod", "sglang", namespace)

    def test_in_an_audit_mode_namespace_a_denied_pod_is_admitted_silently_and_counted(
        self, control_plane: ControlPlane, epguard: Stack, deny_rule: str, namespace: str
    ) -> None:
        control_plane.kubectl("label", "namespace", namespace, "epguard.io/mode=audit", check=True)
        obj = pod("sglang", namespace, worker(BAD_IMAGE))
        eventually(
            lambda: apply(control_plane, obj, dry_run=True).returncode == 0,
            what="the webhook to see the audit label",
        )
        before = _audited(epguard)

        r = apply(control_plane, obj)

        assert r.returncode == 0, r.stderr
        assert "epguard" not in output(r)
        assert exists(control_plane, "pod", "sglang", namespace)
        assert _audited(epguard) == before + 1

    def test_removing_the_mode_label_enforces_again(
        self, control_plane: ControlPlane, deny_rule: str, namespace: str
    ) -> None:
        obj = pod("sglang", namespace, worker(BAD_IMAGE))
        control_plane.kubectl("label", "namespace", namespace, "epguard.io/mode=warn", check=True)
        eventually(lambda: apply(control_plane, obj, dry_run=True).returncode == 0, what="warn")

        control_plane.kubectl("label", "namespace", namespace, "epguard.io/mode-", check=True)
        eventually(
            lambda: denied_by_epguard(apply(control_plane, obj, dry_run=True)), what="enforce"
        )

        r = apply(control_plane, obj)
        assert denied_by_epguard(r), output(r)
        assert not exists(control_plane, "pod", "sglang", namespace)
