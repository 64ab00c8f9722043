"""Issue 21 point 4 through a real kube-apiserver:

* a large pod review epguard cannot judge in time is *refused* under ``failurePolicy:
  Ignore``, because epguard answers it by mode (an AdmissionReview the API server
  obeys), where a 500 was admitted unjudged;
* with a client CA (``--client-ca``), the API server is answered once its
  AdmissionConfiguration gives it a client certificate for the webhook.

The webhook runs in this process (a loopback TLS server, as in tests/webhook) with its
own ValidatingWebhookConfiguration scoped to the test's namespace, which carries
``epguard.io/ignore=true`` so no other epguard configuration of the session is called."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster import ControlPlane
from epguard.webhook.admission import handler
from tests.e2e.e2e_kube import apply, denied_by_epguard, eventually, pod, worker
from tests.factory import BAD_IMAGE, TEST_RULES
from tests.pki import issue, make_ca, write_pair
from tests.servers import RunningServer, running_server

pytestmark = pytest.mark.e2e


def _config(name: str, server: RunningServer, selector: dict[str, str], policy: str) -> Any:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "pods.unjudged.e2e.epguard.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": policy,
                "timeoutSeconds": 10,
                "namespaceSelector": {"matchLabels": selector},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ],
                "clientConfig": {
                    "url": f"https://127.0.0.1:{server.port}/validate",
                    "caBundle": base64.b64encode(server.ca_path.read_bytes()).decode(),
                },
            }
        ],
    }


@pytest.fixture
def slow_webhook(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> Iterator[RunningServer]:
    control_plane.kubectl("label", "namespace", namespace, "epguard.io/ignore=true", check=True)
    name = f"e2e-unjudged-{namespace}"
    with running_server(tmp_path, TEST_RULES, deadline_seconds=0.5) as server:
        try:
            config = _config(name, server, {"epguard-e2e": namespace}, "Ignore")
            r = apply(control_plane, config)
            assert r.returncode == 0, r.stderr
            eventually(
                lambda: denied_by_epguard(
                    apply(control_plane, pod("sync", namespace, worker(BAD_IMAGE)), dry_run=True)
                ),
                what="the webhook configuration to take effect",
            )
            yield server
        finally:
            control_plane.kubectl("delete", "validatingwebhookconfiguration", name)


def test_a_large_pod_not_judged_in_time_is_refused_under_ignore(
    control_plane: ControlPlane,
    slow_webhook: RunningServer,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = handler.decide

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.5)  # past the 0.5 s deadline, inside the 10 s timeoutSeconds
        return real(*args, **kwargs)

    monkeypatch.setattr(handler, "decide", slow)
    big = pod("slow", namespace, worker(BAD_IMAGE), annotations={"pad": "x" * 80_000})
    r = apply(control_plane, big, dry_run=True)
    # Refused as epguard's decision, which the API server obeys under Ignore; a 500 would
    # have been ignored and the pod admitted unjudged.
    assert r.returncode != 0, r.stdout
    assert "denied the request" in r.stderr and "could not judge this request" in r.stderr


class _ClientCertControlPlane(ControlPlane):
    """A control plane whose API server presents a client certificate to webhooks, as
    the file its --admission-control-config-file names tells it to."""

    def __init__(self, admission_config: Path) -> None:
        super().__init__()
        self.admission_config = admission_config

    def apiserver_args(self) -> list[str]:
        return [
            *super().apiserver_args(),
            f"--admission-control-config-file={self.admission_config}",
        ]


def test_with_a_client_ca_the_api_server_is_answered_with_its_certificate(
    tmp_path: Path,
) -> None:
    client_ca = make_ca("apiserver-webhook-client-ca")
    cert = issue(client_ca, cn="kube-apiserver-webhook-client")
    write_pair(cert, tmp_path / "client.crt", tmp_path / "client.key")
    (tmp_path / "client-ca.crt").write_bytes(cert.ca_pem)
    srv = tmp_path / "server"
    srv.mkdir()
    with running_server(srv, TEST_RULES, client_ca=str(tmp_path / "client-ca.crt")) as server:
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            # For a webhook called by URL the API server looks the user up by host:port.
            "users": [
                {
                    "name": f"127.0.0.1:{server.port}",
                    "user": {
                        "client-certificate": str(tmp_path / "client.crt"),
                        "client-key": str(tmp_path / "client.key"),
                    },
                }
            ],
        }
        (tmp_path / "webhook-client.kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        plugin = {
            "apiVersion": "apiserver.config.k8s.io/v1",
            "kind": "WebhookAdmissionConfiguration",
            "kubeConfigFile": str(tmp_path / "webhook-client.kubeconfig"),
        }
        admission = {
            "apiVersion": "apiserver.config.k8s.io/v1",
            "kind": "AdmissionConfiguration",
            "plugins": [
                {"name": "ValidatingAdmissionWebhook", "configuration": plugin},
                {"name": "MutatingAdmissionWebhook", "configuration": plugin},
            ],
        }
        (tmp_path / "admission.yaml").write_text(yaml.safe_dump(admission))
        cp = _ClientCertControlPlane(tmp_path / "admission.yaml")
        cp.start()
        try:
            cp.kubectl("create", "namespace", "mtls", check=True)
            cp.kubectl("label", "namespace", "mtls", "epguard-e2e=mtls", check=True)
            # Fail: a call epguard refused with 403 (no certificate) would read as
            # "failed calling webhook", not as epguard's denial.
            r = apply(cp, _config("e2e-mtls", server, {"epguard-e2e": "mtls"}, "Fail"))
            assert r.returncode == 0, r.stderr
            bad = pod("bad", "mtls", worker(BAD_IMAGE))
            eventually(
                lambda: denied_by_epguard(apply(cp, bad, dry_run=True)),
                what="epguard's denial through the API server's client certificate",
            )
            r = apply(cp, bad, dry_run=True)
            assert "failed calling webhook" not in r.stderr, r.stderr
        finally:
            cp.stop()
