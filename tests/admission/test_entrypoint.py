"""`python -m epguard.webhook`: options and environment variables, and a real process start/stop."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from devcluster.process import free_port
from epguard.webhook.engine.rules import default_rules_path
from epguard.webhook.settings import SettingsError, load
from tests.factory import TEST_RULES
from tests.pki import issue, make_ca, write_pair

REPO = Path(__file__).resolve().parents[2]


def test_reads_every_option_from_the_environment() -> None:
    s = load(
        [],
        {
            "EPGUARD_RULES": "/r.yaml",
            "EPGUARD_TLS_CERT": "/c",
            "EPGUARD_TLS_KEY": "/k",
            "EPGUARD_HOST": "127.0.0.1",
            "EPGUARD_PORT": "9443",
            "EPGUARD_MODE": "warn",
            "EPGUARD_ALLOW_SKIP": "false",
            "EPGUARD_NAMESPACE": "ops",
            "EPGUARD_RULES_CONFIGMAP": "my-rules",
            "EPGUARD_KUBECONFIG": "/kc",
        },
    )
    assert (s.rules, s.tls_cert, s.tls_key, s.host, s.port) == (
        "/r.yaml",
        "/c",
        "/k",
        "127.0.0.1",
        9443,
    )
    assert (s.mode, s.allow_skip, s.namespace, s.rules_configmap, s.kubeconfig) == (
        "warn",
        False,
        "ops",
        "my-rules",
        "/kc",
    )


def test_flags_beat_the_environment_and_defaults_are_documented() -> None:
    s = load(
        ["--port", "1234", "--mode", "audit"], {"EPGUARD_PORT": "9443", "EPGUARD_MODE": "warn"}
    )
    assert s.port == 1234 and s.mode == "audit"
    d = load([], {})
    assert (d.port, d.mode, d.allow_skip, d.namespace, d.rules_configmap) == (
        8443,
        "enforce",
        True,
        "epguard-system",
        "epguard-rules",
    )


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({"EPGUARD_MODE": "strict"}, "EPGUARD_MODE: must be one of"),
        ({"EPGUARD_PORT": "http"}, "EPGUARD_PORT: must be a number"),
        ({"EPGUARD_ALLOW_SKIP": "maybe"}, "EPGUARD_ALLOW_SKIP: must be true or false"),
        ({"EPGUARD_TLS_CERT": "/c"}, "give both --tls-cert and --tls-key"),
    ],
)
def test_rejects_bad_settings(env: dict[str, str], complaint: str) -> None:
    with pytest.raises(SettingsError, match=complaint):
        load([], env)


def test_runs_as_a_process_and_stops_on_sigterm(tmp_path: Path) -> None:
    issued = issue(make_ca())
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    write_pair(issued, cert, key)
    (tmp_path / "ca.crt").write_bytes(issued.ca_pem)
    rules = tmp_path / "rules.yaml"
    rules.write_text(TEST_RULES)
    port = free_port()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("EPGUARD_") and k != "KUBECONFIG"
    }
    env["EPGUARD_MODE"] = "warn"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epguard.webhook",
            "--rules",
            str(rules),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        ready = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(
                    f"https://127.0.0.1:{port}/readyz",
                    verify=ssl.create_default_context(cafile=str(tmp_path / "ca.crt")),
                )
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert ready is not None and ready.json()["mode"] == "warn"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status tells why.
    assert proc.returncode in (0, -signal.SIGTERM)
    assert "Finished server process" in out
    assert "no cluster credentials: running on the rules file" in out
    assert "3 rule(s) from" in out


def test_a_broken_rules_file_at_start_serves_the_built_in_rules_and_says_so(
    tmp_path: Path,
) -> None:
    # In the chart the rules file is the mounted rules ConfigMap: a broken edit of it must
    # not crash-loop the webhook on its next restart.
    issued = issue(make_ca())
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    write_pair(issued, cert, key)
    (tmp_path / "ca.crt").write_bytes(issued.ca_pem)
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {id: a, image: x, reason: r, remedy: m, action: nope}\n")
    port = free_port()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("EPGUARD_") and k != "KUBECONFIG"
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "epguard.webhook", "--rules", str(rules), "--tls-cert", str(cert),
         "--tls-key", str(key), "--host", "127.0.0.1", "--port", str(port),
         "--reload-interval", "0.2"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))

    def readyz() -> dict[str, object] | None:
        try:
            r = httpx.get(f"https://127.0.0.1:{port}/readyz", verify=ctx)
        except httpx.TransportError:
            return None
        body: dict[str, object] = r.json()
        return body

    try:
        deadline = time.monotonic() + 60
        ready = None
        while time.monotonic() < deadline and proc.poll() is None and ready is None:
            ready = readyz()
            time.sleep(0.2)
        assert ready is not None, "the webhook did not start"
        assert "rules[0] (id 'a'): action" in str(ready["rules_file_error"])
        assert ready["rules_source"] == str(default_rules_path())
        # Fixed: the file is taken, and the error clears.
        rules.write_text(TEST_RULES)
        while time.monotonic() < deadline:
            now = readyz()
            if now and now["rules_file_error"] is None:
                assert now["rules_source"] == str(rules)
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the fixed rules file was not taken")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert "the rules file does not load; starting on the" in out
