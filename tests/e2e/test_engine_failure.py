"""An exception inside epguard's engine, through a real kube-apiserver: the webhook
answers 500, so the API server applies the webhook's failurePolicy -- Ignore admits the
pod unjudged, Fail refuses it as a failed call -- instead of epguard answering
"allowed" on its own (or "denied", which the API server would obey whatever the policy).

The webhook runs in this process (a loopback TLS server, as in tests/webhook) with the
engine patched to raise; its ValidatingWebhookConfiguration is the test's own, scoped to
the test's namespace, which carries ``epguard.io/ignore=true`` so no other epguard
configuration of the session is called for it."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster import ControlPlane
from epguard.webhook.admission import handler
from tests.e2e.e2e_kube import apply, denied_by_epguard, eventually, pod, worker
from tests.factory import BAD_IMAGE, TEST_RULES
from tests.servers import RunningServer, running_server

pytestmark = pytest.mark.e2e


def _config(name: str, server: RunningServer, namespace: str, policy: str) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "pods.engine-failure.e2e.epguard.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": policy,
                "timeoutSeconds": 5,
                "namespaceSelector": {"matchLabels": {"epguard-e2e": namespace}},
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


@pytest.fixture(params=["Ignore", "Fail"])
def policy_webhook(
    request: pytest.FixtureRequest, control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> Iterator[tuple[str, RunningServer]]:
    control_plane.kubectl("label", "namespace", namespace, "epguard.io/ignore=true", check=True)
    name = f"e2e-engine-failure-{namespace}"
    policy = str(request.param)
    with running_server(tmp_path, TEST_RULES) as server:
        try:
            r = apply(control_plane, _config(name, server, namespace, policy))
            assert r.returncode == 0, r.stderr
            # In effect once the API server calls it: the test rules refuse BAD_IMAGE.
            eventually(
                lambda: denied_by_epguard(
                    apply(control_plane, pod("sync", namespace, worker(BAD_IMAGE)), dry_run=True)
                ),
                what="the webhook configuration to take effect",
            )
            yield policy, server
        finally:
            control_plane.kubectl("delete", "validatingwebhookconfiguration", name)


def test_an_engine_exception_is_decided_by_the_failure_policy(
    control_plane: ControlPlane,
    policy_webhook: tuple[str, RunningServer],
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy, server = policy_webhook

    def broken(*_: object, **__: object) -> object:
        raise RuntimeError("engine bug (test)")

    monkeypatch.setattr(handler, "decide", broken)
    r = apply(control_plane, pod("judged", namespace, worker(BAD_IMAGE)), dry_run=True)

    # Counted once the answer has been sent: the API server may have it first.
    errors = server.runtime.metrics.reviews.labels("validate", "error")
    eventually(lambda: errors._value.get() >= 1, within=10, what="the 500 to be counted")
    if policy == "Ignore":
        # Admitted unjudged: the API server ignored the failed call.
        assert r.returncode == 0, r.stderr
    else:
        # Refused as a failed call, not as epguard's decision.
        assert r.returncode != 0
        assert "failed calling webhook" in r.stderr, r.stderr
        assert "denied the request" not in r.stderr
