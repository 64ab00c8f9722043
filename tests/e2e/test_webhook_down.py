"""The webhook process killed: pods that do not mention the elastic-EP flag are still
admitted (the API server's `matchConditions` never call epguard for them), and pods that
do are handled per `failurePolicy` — admitted unjudged with Ignore, refused with Fail.

The damage is contained: each test runs its own webhook process and its own
ValidatingWebhookConfiguration (a copy of the chart's Pod webhook, same
matchConditions) scoped to the test's namespace, which carries `epguard.io/ignore=true`
so the session's webhook configuration leaves it alone. The session's webhook is never
touched; the killed one is restarted at the end of the test and must judge again."""

from __future__ import annotations

import base64
import copy
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devcluster import ControlPlane
from devcluster.process import ManagedProcess
from devcluster.stack import Stack, start_webhook
from tests.e2e.e2e_kube import (
    BAD_IMAGE,
    DENY_RULE_ID,
    apply,
    denied_by_epguard,
    eventually,
    exists,
    output,
    plain,
    pod,
    worker,
)

pytestmark = pytest.mark.e2e

WEBHOOK_NAME = "pods.webhook-down.e2e.epguard.io"


@dataclass
class OwnWebhook:
    """A webhook process of the test's own, and the configuration that calls it."""

    cp: ControlPlane
    stack: Stack
    config_name: str
    failure_policy: str
    namespace: str

    @property
    def process(self) -> ManagedProcess:
        return self.stack.extras[-1]

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)  # the group leader is the webhook
        eventually(lambda: not self.process.alive(), what="the webhook to die")

    def restart(self) -> None:
        """A new webhook process (new port, new certificate), and the configuration
        pointed at it."""
        self.stack.extras = [p for p in self.stack.extras if p.alive()]
        start_webhook(self.stack, self.cp)
        self.apply_config()

    def apply_config(self) -> None:
        epguard_config = json.loads(
            self.cp.kubectl(
                "get", "validatingwebhookconfiguration", "epguard", "-o", "json", check=True
            ).stdout
        )
        chart_pods = next(w for w in epguard_config["webhooks"] if w["name"] == "pods.epguard.io")
        hook: dict[str, Any] = copy.deepcopy(chart_pods)
        assert self.stack.webhook_url is not None
        hook.update(
            name=WEBHOOK_NAME,
            failurePolicy=self.failure_policy,
            timeoutSeconds=2,
            namespaceSelector={"matchLabels": {"epguard-e2e": self.namespace}},
            clientConfig={
                "url": self.stack.webhook_url,
                "caBundle": base64.b64encode(
                    self.stack.webhook_tls.bundle_file.read_bytes()
                ).decode(),
            },
        )
        config = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": self.config_name},
            "webhooks": [hook],
        }
        r = apply(self.cp, config)
        assert r.returncode == 0, r.stderr


@pytest.fixture(params=["Ignore", "Fail"])
def own_webhook(
    request: pytest.FixtureRequest,
    control_plane: ControlPlane,
    epguard: Stack,
    deny_rule: str,
    namespace: str,
    tmp_path: Path,
) -> Iterator[OwnWebhook]:
    # Out of the session's webhook configuration's reach: only ours is called here.
    control_plane.kubectl("label", "namespace", namespace, "epguard.io/ignore=true", check=True)
    stack = Stack(run_dir=tmp_path / "own-webhook", detached=False)
    (stack.run_dir / "logs").mkdir(parents=True)
    own = OwnWebhook(
        control_plane, stack, f"e2e-webhook-down-{namespace}", str(request.param), namespace
    )
    try:
        start_webhook(stack, control_plane)
        own.apply_config()
        # In effect once the API server calls it: the session's deny rule refuses.
        judged = pod("sync", namespace, worker(BAD_IMAGE))
        eventually(
            lambda: denied_by_epguard(apply(control_plane, judged, dry_run=True)),
            what="our webhook configuration to take effect",
        )
        yield own
    finally:
        control_plane.kubectl("delete", "validatingwebhookconfiguration", own.config_name)
        stack.stop()


def test_with_the_webhook_killed_a_pod_without_the_flag_is_still_admitted(
    control_plane: ControlPlane, own_webhook: OwnWebhook, namespace: str
) -> None:
    own_webhook.kill()

    r = apply(control_plane, pod("web", namespace, plain(BAD_IMAGE)))

    assert r.returncode == 0, r.stderr
    assert "pod/web created" in r.stdout
    assert "webhook" not in output(r)


def test_with_the_webhook_killed_an_elastic_ep_pod_is_handled_per_failure_policy(
    control_plane: ControlPlane, own_webhook: OwnWebhook, namespace: str
) -> None:
    own_webhook.kill()

    r = apply(control_plane, pod("sglang", namespace, worker(BAD_IMAGE)))

    if own_webhook.failure_policy == "Ignore":
        # Admitted unjudged: no denial, no warning; the in-pod probe is the next line.
        assert r.returncode == 0, r.stderr
        assert "epguard" not in output(r)
        assert exists(control_plane, "pod", "sglang", namespace)
    else:
        assert r.returncode != 0
        assert f'failed calling webhook "{WEBHOOK_NAME}"' in r.stderr
        assert "connection refused" in r.stderr
        assert not exists(control_plane, "pod", "sglang", namespace)


def test_a_restarted_webhook_judges_again(
    control_plane: ControlPlane, own_webhook: OwnWebhook, namespace: str
) -> None:
    own_webhook.kill()

    own_webhook.restart()

    obj = pod("sglang", namespace, worker(BAD_IMAGE))
    eventually(
        lambda: DENY_RULE_ID in apply(control_plane, obj, dry_run=True).stderr,
        what="the restarted webhook to be called",
    )
    r = apply(control_plane, obj)
    assert denied_by_epguard(r), output(r)
    assert f"[epguard rule {DENY_RULE_ID}]" in r.stderr
