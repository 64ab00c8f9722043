"""``python -m devcluster up`` / ``down`` (``make up`` / ``make down``): a real one-node
cluster with epguard installed by helm as pods, and a host left as it was found."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devcluster import binaries
from devcluster.node import host_snapshot
from devcluster.process import running

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.node, pytest.mark.usefixtures("machine_to_itself")]


def _devcluster(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devcluster", "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=900,
    )


def _gone(pid: int) -> bool:
    return not running(pid)


def test_up_runs_epguard_as_the_charts_pods_and_down_leaves_the_host_as_it_was(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    before = host_snapshot()

    up = _devcluster(run_dir, "up")
    # Said first: a start that failed removes its run directory, and with it the logs.
    assert up.returncode == 0, f"make up failed:\n{up.stdout[-4000:]}\n{up.stderr[-4000:]}"
    try:
        last = up.stdout.strip().splitlines()[-1] if up.stdout.strip() else ""
        state = json.loads((run_dir / "state.json").read_text())
        pids = [
            p["pid"]
            for part in (state["control_plane"], state["node"] or {"processes": []})
            for p in part["processes"]
        ]
        kubeconfig = last.removeprefix("export KUBECONFIG=")
        status = _devcluster(run_dir, "status")
        pods = subprocess.run(
            [str(binaries.find("kubectl")), "--kubeconfig", kubeconfig, "get", "pods",
             "-n", "epguard-system", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        webhooks = subprocess.run(
            [str(binaries.find("kubectl")), "--kubeconfig", kubeconfig, "get",
             "validatingwebhookconfigurations", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
    finally:
        down = _devcluster(run_dir, "down")
    after = host_snapshot()

    assert up.returncode == 0, up.stderr
    assert last.startswith("export KUBECONFIG=")
    assert status.returncode == 0, status.stdout
    pods_running = {
        p["metadata"]["labels"].get("app.kubernetes.io/component", p["metadata"]["name"])
        for p in json.loads(pods.stdout)["items"]
        if p["status"]["phase"] == "Running"
    }
    assert {"webhook", "controller"} <= pods_running, pods.stdout
    # The chart's own clientConfig: its Service, never a URL.
    for config in json.loads(webhooks.stdout)["items"]:
        for hook in config["webhooks"]:
            assert "service" in hook["clientConfig"] and "url" not in hook["clientConfig"]
            assert hook["clientConfig"]["caBundle"]
    assert down.returncode == 0, down.stderr
    assert all(_gone(pid) for pid in pids)
    assert not run_dir.exists()
    assert after == before
