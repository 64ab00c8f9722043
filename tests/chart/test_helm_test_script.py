"""The `helm test` pod's script against the real webhook server on loopback: rules and
mode as the chart renders them, TLS from the controller's certificate code with the
script trusting only ca.crt. Proves the chart's test, the webhook's answers and the
certificates agree, without a cluster."""

from __future__ import annotations

import datetime as dt
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devcluster.process import free_port
from epguard.webhook.controller import authority as certs
from tests.chart.chartlib import CHART, REPO, render


@dataclass
class Server:
    url: str
    ca: Path


def helm_test_pod_env(*values: str) -> tuple[dict[str, str], str, dict[str, str]]:
    r = render(*values)
    pod = next(o for o in r.objects if o["kind"] == "Pod")
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    webhook = next(
        o
        for o in r.objects
        if o["kind"] == "Deployment"
        and o["spec"]["template"]["spec"]["containers"][0]["name"] == "webhook"
    )
    wenv = {
        e["name"]: e["value"]
        for e in webhook["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in e
    }
    rules = next(o for o in r.objects if o["kind"] == "ConfigMap")["data"]["rules.yaml"]
    wenv["_RULES"] = rules
    return env, c["args"][0], wenv


def start_webhook(tmp: Path, webhook_env: dict[str, str]) -> Iterator[Server]:
    data = certs.reconcile(
        None, certs.TLSPolicy(dns_names=("localhost",)), dt.datetime.now(dt.UTC)
    ).data
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (tmp / name).write_bytes(data[name])
    (tmp / "rules.yaml").write_text(webhook_env["_RULES"])
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPGUARD_")}
    env.update(
        EPGUARD_RULES=str(tmp / "rules.yaml"),
        EPGUARD_TLS_CERT=str(tmp / "tls.crt"),
        EPGUARD_TLS_KEY=str(tmp / "tls.key"),
        EPGUARD_HOST="127.0.0.1",
        EPGUARD_PORT=str(port),
        EPGUARD_MODE=webhook_env["EPGUARD_MODE"],
        EPGUARD_ALLOW_SKIP=webhook_env["EPGUARD_ALLOW_SKIP"],
        EPGUARD_WATCH="off",
        KUBECONFIG="/dev/null",
    )
    log = (tmp / "webhook.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "webhook"], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
    )
    ctx = ssl.create_default_context(cafile=str(tmp / "ca.crt"))
    try:
        for _ in range(400):  # bounded wait for the listener; not a timing assertion
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(
                    f"https://localhost:{port}/readyz", context=ctx, timeout=2
                ):
                    break
            except OSError:
                time.sleep(0.1)
        assert proc.poll() is None, (tmp / "webhook.log").read_text()
        yield Server(f"https://localhost:{port}/validate", tmp / "ca.crt")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def run_script(
    script: str, env: dict[str, str], server: Server
) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env, "EPGUARD_URL": server.url, "EPGUARD_CA": str(server.ca)}
    return subprocess.run(
        [sys.executable, "-I", "-c", script], env=full, capture_output=True, text=True, timeout=120
    )


DENY_RULE = (
    "--set",
    "rules.includeDefaults=false",
    "--set",
    "rules.extra[0].id=helm-test-deny",
    "--set",
    "rules.extra[0].image=docker.io/example/sglang:bad-*",
    "--set",
    "rules.extra[0].reason=the image lacks the pg extension",
    "--set",
    "rules.extra[0].remedy=use a good image",
)
VARIANTS: dict[str, tuple[str, ...]] = {
    "defaults (enforce, warn rule)": (),
    "warn mode": ("-f", str(CHART / "ci" / "warn-mode-values.yaml")),
    "audit mode, deny rule": ("-f", str(CHART / "ci" / "no-exemptions-values.yaml")),
    "enforce mode, deny rule": DENY_RULE,
}


@pytest.fixture
def server_for(tmp_path: Path) -> Iterator[Any]:
    servers: list[Iterator[Server]] = []

    def _start(webhook_env: dict[str, str]) -> Server:
        gen = start_webhook(tmp_path, webhook_env)
        servers.append(gen)
        return next(gen)

    yield _start
    for gen in servers:
        for _ in gen:
            pass


@pytest.mark.parametrize("values", VARIANTS.values(), ids=VARIANTS.keys())
def test_the_helm_test_passes_against_the_webhook_it_was_rendered_for(
    values: tuple[str, ...], server_for: Any
) -> None:
    env, script, webhook_env = helm_test_pod_env(*values)
    server = server_for(webhook_env)
    out = run_script(script, env, server)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "epguard helm test: passed" in out.stdout


def test_the_helm_test_fails_when_the_webhook_answers_otherwise(server_for: Any) -> None:
    # The script is told to expect a denial, but the webhook runs the default (warn) rules.
    env, script, webhook_env = helm_test_pod_env()
    server = server_for(webhook_env)
    out = run_script(script, {**env, "EXPECT_RULE_ACTION": "deny"}, server)
    assert out.returncode == 1
    assert "FAIL: expected a denial" in out.stdout


def test_the_helm_test_refuses_a_server_its_ca_did_not_sign(
    server_for: Any, tmp_path: Path
) -> None:
    env, script, webhook_env = helm_test_pod_env()
    server = server_for(webhook_env)
    other = certs.reconcile(
        None, certs.TLSPolicy(dns_names=("localhost",)), dt.datetime.now(dt.UTC)
    )
    (tmp_path / "other-ca.crt").write_bytes(other.data["ca.crt"])
    out = run_script(script, env, Server(server.url, tmp_path / "other-ca.crt"))
    assert out.returncode != 0
    assert "CERTIFICATE_VERIFY_FAILED" in out.stderr
