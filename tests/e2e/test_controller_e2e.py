"""The controller against a real kube-apiserver (devcluster's etcd + kube-apiserver, no
kubelet): the chart's objects applied as `helm template` renders them, the controller
run as the chart runs it (its rendered environment), and the chart's RBAC checked
against the calls the controller makes."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster import ControlPlane
from devcluster.process import free_port
from devcluster.stack import NAMESPACE
from epguard.webhook.controller import authority as certs
from tests.chart.chartlib import render
from tests.control_plane import running_control_plane

pytestmark = pytest.mark.e2e

NS = NAMESPACE
CONTROLLER_SA = f"system:serviceaccount:{NS}:epguard-controller"
WEBHOOK_SA = f"system:serviceaccount:{NS}:epguard-webhook"


def rendered(*extra: str) -> list[dict[str, Any]]:
    return render(*extra).objects


class Cluster:
    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig)}

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        proc = self.cp.kubectl(*args, input=stdin)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr}")
        return proc.stdout

    def get(self, *args: str) -> dict[str, Any] | None:
        proc = self.cp.kubectl("get", *args, "-o", "json")
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def can(self, who: str, verb: str, resource: str, *extra: str) -> bool:
        proc = self.cp.kubectl("auth", "can-i", verb, resource, f"--as={who}", *extra)
        return proc.stdout.strip() == "yes"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with running_control_plane() as cp:
        c = Cluster(cp)
        c.kubectl("create", "namespace", NS)
        # Everything the chart renders except the helm-test Pod (no kubelet runs it).
        objs = [o for o in rendered() if o["kind"] != "Pod"]
        c.kubectl(
            "apply",
            "--server-side",
            "-f",
            "-",
            stdin="\n---\n".join(yaml.safe_dump(o) for o in objs),
        )
        yield c


def wait_for(what: str, check: Any, attempts: int = 240) -> Any:
    """Poll until check() is truthy. Bounded by attempts, not asserted on time."""
    for _ in range(attempts):
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"gave up waiting for {what}")


@dataclass
class Controller:
    proc: subprocess.Popen[str]
    liveness: str


@pytest.fixture(scope="module")
def controller(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    deploy = next(
        o
        for o in rendered()
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "epguard-controller"
    )
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env.update(
        EPGUARD_NAMESPACE=NS,  # the downward API's answer in the cluster
        # The chart's endpoint, on a free loopback port (a shared machine).
        EPGUARD_LIVENESS=env["EPGUARD_LIVENESS"].replace(
            "0.0.0.0:8080", f"127.0.0.1:{free_port()}"
        ),
        EPGUARD_CERT_POLL_SECONDS="1",  # the drift test below waits on one pass
    )
    log = tmp_path_factory.mktemp("controller") / "controller.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name(container["command"][0]))],
            env={**cluster.env, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        yield Controller(proc, env["EPGUARD_LIVENESS"])
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(log.read_text()[-4000:])


def bundles(cluster: Cluster) -> set[str]:
    """The caBundle of every webhook of both configurations (validating and injection)."""
    found = set()
    for kind, name in (
        ("validatingwebhookconfiguration", "epguard"),
        ("mutatingwebhookconfiguration", "epguard-inject"),
    ):
        config = cluster.get(kind, name)
        assert config is not None, f"{kind}/{name} was not applied"
        found |= {w["clientConfig"].get("caBundle", "") for w in config["webhooks"]}
    return found


def secret(cluster: Cluster) -> dict[str, Any] | None:
    return cluster.get("secret", "epguard-tls", "-n", NS)


class TestSelfManagedTLS:
    def test_the_controller_creates_the_secret_and_injects_its_ca_everywhere(
        self, cluster: Cluster, controller: Controller
    ) -> None:
        def injected() -> bool:
            s = secret(cluster)
            return s is not None and bundles(cluster) == {s["data"]["ca.crt"]}

        wait_for("the caBundle", injected)
        s = secret(cluster)
        assert s is not None and s["type"] == "kubernetes.io/tls"
        data = {k: base64.b64decode(v) for k, v in s["data"].items()}
        leaf = certs.load_bundle(data["tls.crt"])[0]
        assert any(certs.verifies(leaf, ca) for ca in certs.load_bundle(data["ca.crt"]))
        assert "epguard-webhook.epguard-system.svc" in certs.san_dns_names(leaf)
        owner = s["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("ValidatingWebhookConfiguration", "epguard")

    def test_a_reset_ca_bundle_is_restored(self, cluster: Cluster, controller: Controller) -> None:
        wait_for("the first injection", lambda: "" not in bundles(cluster))
        cluster.kubectl(
            "patch",
            "validatingwebhookconfiguration",
            "epguard",
            "--type=json",
            "-p",
            json.dumps([{"op": "remove", "path": "/webhooks/1/clientConfig/caBundle"}]),
        )
        wait_for("the caBundle to come back", lambda: "" not in bundles(cluster))
        s = secret(cluster)
        assert s is not None and bundles(cluster) == {s["data"]["ca.crt"]}

    def test_reapplying_the_chart_keeps_the_injected_bundle(
        self, cluster: Cluster, controller: Controller
    ) -> None:
        """helm 4 upgrades by server-side apply (field manager "helm"): caBundle, which
        the chart never sets, belongs to the controller and must survive it."""
        wait_for("the first injection", lambda: "" not in bundles(cluster))
        before = bundles(cluster)
        vwc = next(
            o
            for o in rendered("--set", "webhook.timeoutSeconds=7")
            if o["kind"] == "ValidatingWebhookConfiguration"
        )
        cluster.kubectl(
            "apply",
            "--server-side",
            "--field-manager=helm",
            "--force-conflicts",
            "-f",
            "-",
            stdin=yaml.safe_dump(vwc),
        )
        live = cluster.get("validatingwebhookconfiguration", "epguard")
        assert live is not None
        assert {w["timeoutSeconds"] for w in live["webhooks"]} == {7}
        assert bundles(cluster) == before

    def test_the_controller_registers_for_kopf_peering(
        self, cluster: Cluster, controller: Controller
    ) -> None:
        peering = wait_for(
            "the ClusterKopfPeering status",
            lambda: (p := cluster.get("clusterkopfpeering", "epguard")) and p.get("status") and p,
        )
        assert len(peering["status"]) == 1  # this one replica
        assert controller.proc.poll() is None

    def test_the_liveness_endpoint_the_chart_probes_answers(self, controller: Controller) -> None:
        url = controller.liveness

        def alive() -> bool:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for("the liveness endpoint", alive)


class TestRBAC:
    """The chart's roles allow what the two processes do, and not much more."""

    @pytest.mark.parametrize(
        ("verb", "resource", "extra"),
        [
            ("create", "secrets", ["-n", NS]),
            ("get", "secrets/epguard-tls", ["-n", NS]),
            ("update", "secrets/epguard-tls", ["-n", NS]),
            ("get", "validatingwebhookconfigurations/epguard", []),
            ("patch", "validatingwebhookconfigurations/epguard", []),
            ("patch", "mutatingwebhookconfigurations/epguard-inject", []),
            ("create", "clusterkopfpeerings.kopf.dev", []),
            ("patch", "clusterkopfpeerings.kopf.dev/epguard", []),
            ("watch", "pods", ["-A"]),
            ("create", "imageverdicts.epguard.io", []),
            ("create", "events", ["-n", "default"]),
            ("create", "imageverdicts.epguard.io", []),
            ("update", "imageverdicts.epguard.io", []),
            # controller/architectures.py: a probe's node, and the verdicts it forgets.
            ("get", "nodes/gpu-1", []),
            ("list", "nodes", []),
            ("delete", "imageverdicts.epguard.io", []),
            # The preflight gate's rights; the ValidatingAdmissionPolicy epguard-preflight
            # narrows them to preflight pods, the gate and its own condition
            # (tests/e2e/test_preflight_policy.py).
            ("create", "pods", ["-n", "default"]),
            ("delete", "pods", ["-n", "default"]),
            ("patch", "pods", ["-n", "default"]),
            ("patch", "pods/status", ["-n", "default"]),
        ],
    )
    def test_the_controller_may(
        self, cluster: Cluster, verb: str, resource: str, extra: list[str]
    ) -> None:
        assert cluster.can(CONTROLLER_SA, verb, resource, *extra)

    @pytest.mark.parametrize(
        ("verb", "resource", "extra"),
        [
            ("get", "secrets/sh.helm.release.v1.epguard.v1", ["-n", NS]),
            ("list", "secrets", ["-n", "default"]),
            ("patch", "validatingwebhookconfigurations/someone-elses", []),
            ("delete", "validatingwebhookconfigurations/epguard", []),
            # Pods are patched (the gate's removal), never replaced whole.
            ("update", "pods", ["-n", "default"]),
            ("update", "pods/status", ["-n", "default"]),
            ("deletecollection", "pods", ["-n", "default"]),
            ("patch", "nodes/gpu-1", []),
            ("deletecollection", "imageverdicts.epguard.io", []),
        ],
    )
    def test_the_controller_may_not(
        self, cluster: Cluster, verb: str, resource: str, extra: list[str]
    ) -> None:
        assert not cluster.can(CONTROLLER_SA, verb, resource, *extra)

    @pytest.mark.parametrize(
        ("verb", "resource", "extra", "allowed"),
        [
            # Only its own ConfigMap, by name (the watch selects metadata.name).
            ("watch", "configmaps/epguard-rules", ["-n", NS], True),
            ("list", "configmaps", ["-n", NS], False),
            ("watch", "namespaces", [], True),
            ("watch", "imageverdicts.epguard.io", [], True),
            ("get", "secrets/epguard-tls", ["-n", NS], False),
            ("watch", "configmaps", ["-n", "default"], False),
            ("update", "configmaps/epguard-rules", ["-n", NS], False),
            ("create", "imageverdicts.epguard.io", [], False),
        ],
    )
    def test_the_webhook_only_reads_what_it_holds_in_memory(
        self, cluster: Cluster, verb: str, resource: str, extra: list[str], allowed: bool
    ) -> None:
        assert cluster.can(WEBHOOK_SA, verb, resource, *extra) is allowed
