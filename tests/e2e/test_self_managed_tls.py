"""The chart's default TLS, end to end through a real kube-apiserver: the controller creates
the CA and the serving certificate (Secret ``epguard-tls``) and puts the CA into the
webhook configuration's ``caBundle``; a webhook serving that Secret's certificate is then
called by the API server, which trusts it only through that caBundle.

The one thing changed from a cluster install: the API server here has no Services, so the
configuration's ``clientConfig.service`` becomes a ``url`` on 127.0.0.1 (and the controller
is told to add that address to the certificate, ``--extra-san 127.0.0.1``). The caBundle
is never touched by the test: only the controller writes it.

This test owns its control plane and chart install, so it cannot disturb the session's.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from devcluster import ControlPlane
from devcluster.process import ManagedProcess, free_port
from devcluster.stack import CHART_DIR, NAMESPACE, REPO_ROOT, _child_env, install_chart
from tests.control_plane import running_control_plane
from tests.e2e.e2e_kube import apply, eventually, output, pod, worker

pytestmark = pytest.mark.e2e

IMAGE = "registry.example.com/tls/sglang:bad-1"
RULE_ID = "tls-e2e-bad"
SECRET = "epguard-tls"
CONFIG = "epguard"


def secret_data(cp: ControlPlane) -> dict[str, bytes] | None:
    r = cp.kubectl("get", "secret", SECRET, "-n", NAMESPACE, "-o", "json")
    if r.returncode != 0:
        return None
    data = json.loads(r.stdout).get("data") or {}
    return {k: base64.b64decode(v) for k, v in data.items()}


def ca_bundles(cp: ControlPlane) -> list[bytes]:
    r = cp.kubectl("get", "validatingwebhookconfiguration", CONFIG, "-o", "json", check=True)
    hooks = json.loads(r.stdout)["webhooks"]
    return [base64.b64decode(h["clientConfig"].get("caBundle", "")) for h in hooks]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    values = tmp_path_factory.mktemp("values") / "values.yaml"
    rule = {
        "id": RULE_ID,
        "image": "registry.example.com/tls/sglang:bad-*",
        "reason": "the e2e image is known bad",
        "remedy": "use another",
        "action": "deny",
    }
    values.write_text(yaml.safe_dump({"rules": {"extra": [rule]}}))
    with running_control_plane() as cp:
        install_chart(cp, CHART_DIR, ["-f", str(values)])
        yield cp


@pytest.fixture(scope="module")
def controller(cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    logs = tmp_path_factory.mktemp("controller")
    creds = cluster.service_account_kubeconfig(
        NAMESPACE, "epguard-controller", logs / "controller.kubeconfig"
    )
    argv = [
        sys.executable, "-m", "epguard.webhook.controller",
        "--namespace", NAMESPACE,
        "--manage-certs", "true",
        "--extra-san", "127.0.0.1",
        "--mutating-webhook", "epguard-inject",
        "--peering", "",
        "--liveness", "",
        "--poll-interval", "2",
    ]  # fmt: skip
    proc = ManagedProcess.spawn(
        "controller", argv, logs / "controller.log", env=_child_env(cluster, creds), cwd=REPO_ROOT
    )
    try:
        eventually(
            lambda: (
                secret_data(cluster) is not None
                and all(b"BEGIN CERTIFICATE" in b for b in ca_bundles(cluster))
            ),
            within=90,
            what=f"the controller's Secret and caBundle\n{proc.log_tail()}",
        )
        yield
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def webhook_url(
    cluster: ControlPlane, controller: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The webhook serving the controller's certificate, and the configuration's
    clientConfig pointed at it (the caBundle left as the controller wrote it)."""
    work = tmp_path_factory.mktemp("webhook")
    data = secret_data(cluster)
    assert data is not None
    (work / "tls.crt").write_bytes(data["tls.crt"])
    (work / "tls.key").write_bytes(data["tls.key"])
    rules = json.loads(
        cluster.kubectl(
            "get", "configmap", "epguard-rules", "-n", NAMESPACE, "-o", "json", check=True
        ).stdout
    )["data"]["rules.yaml"]
    (work / "rules.yaml").write_text(rules)
    port = free_port()
    creds = cluster.service_account_kubeconfig(
        NAMESPACE, "epguard-webhook", work / "webhook.kubeconfig"
    )
    argv = [
        sys.executable, "-m", "webhook",
        "--rules", str(work / "rules.yaml"),
        "--tls-cert", str(work / "tls.crt"), "--tls-key", str(work / "tls.key"),
        "--host", "127.0.0.1", "--port", str(port),
        "--kubeconfig", str(creds), "--namespace", NAMESPACE,
    ]  # fmt: skip
    proc = ManagedProcess.spawn(
        "webhook", argv, work / "webhook.log", env=_child_env(cluster, creds), cwd=REPO_ROOT
    )
    url = f"https://127.0.0.1:{port}"
    config = json.loads(
        cluster.kubectl("get", "validatingwebhookconfiguration", CONFIG, "-o", "json").stdout
    )
    patch = []
    for i, hook in enumerate(config["webhooks"]):
        path = hook["clientConfig"]["service"].get("path", "/validate")
        patch.append({"op": "remove", "path": f"/webhooks/{i}/clientConfig/service"})
        patch.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/url", "value": url + path})
    cluster.kubectl(
        "patch", "validatingwebhookconfiguration", CONFIG, "--type=json",
        "-p", json.dumps(patch), check=True,
    )  # fmt: skip
    try:
        yield url
    finally:
        proc.stop()


def test_the_controller_issues_a_ca_and_a_serving_cert_for_the_service_and_the_extra_san(
    cluster: ControlPlane, controller: None, tmp_path: Path
) -> None:
    from cryptography import x509

    data = secret_data(cluster)
    assert data is not None and {"tls.crt", "tls.key", "ca.crt"} <= data.keys()
    leaf = x509.load_pem_x509_certificate(data["tls.crt"])
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"epguard-webhook.{NAMESPACE}.svc" in sans.get_values_for_type(x509.DNSName)
    assert "127.0.0.1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    assert all(bundle == data["ca.crt"] for bundle in ca_bundles(cluster))


def test_the_api_server_calls_the_webhook_through_the_controllers_ca_bundle(
    cluster: ControlPlane, webhook_url: str
) -> None:
    cluster.kubectl("create", "namespace", "tls", check=True)
    bad = pod("worker", "tls", worker(IMAGE))
    # The configuration change reaches the API server's informer shortly after the patch.
    eventually(
        lambda: RULE_ID in output(apply(cluster, bad, dry_run=True)),
        within=60,
        what="the API server to call the webhook over the controller-issued TLS",
    )
    r = apply(cluster, bad)
    assert r.returncode != 0
    assert "denied the request" in r.stderr and f"[epguard rule {RULE_ID}]" in r.stderr
    # The caBundle the API server used is still the controller's, untouched by the test.
    data = secret_data(cluster)
    assert data is not None
    assert all(bundle == data["ca.crt"] for bundle in ca_bundles(cluster))
