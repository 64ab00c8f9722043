"""``python -m devcluster up`` / ``down`` (``make up`` / ``make down``): a real one-node
cluster with epguard installed by helm as pods, and a host left as it was found.

The cluster checked is the node modules' shared one (``shared_node``), which ``make up``
itself starts: ``up`` is checked after whichever module started it, and ``down`` runs
after every other test of the session (marker ``after_all``), so the host it must leave
as it was has carried the whole node phase (pods, probes, preflights, restarts), not an
idle cluster."""

from __future__ import annotations

import json
import subprocess

import pytest

from devcluster import binaries
from devcluster.node import host_snapshot
from devcluster.process import running
from tests.e2e.node_e2e import SharedCluster, devcluster_cli

pytestmark = [pytest.mark.e2e, pytest.mark.node]


def _kubectl_json(kubeconfig: str, *args: str) -> dict:
    r = subprocess.run(
        [str(binaries.find("kubectl")), "--kubeconfig", kubeconfig, *args, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_up_runs_epguard_as_the_charts_pods(shared_node: SharedCluster) -> None:
    shared_node.cluster()
    up, run_dir = shared_node.up, shared_node.run_dir
    assert up is not None and run_dir is not None
    assert up.returncode == 0, f"make up failed:\n{up.stdout[-4000:]}\n{up.stderr[-4000:]}"
    last = up.stdout.strip().splitlines()[-1] if up.stdout.strip() else ""
    assert last.startswith("export KUBECONFIG="), up.stdout
    kubeconfig = last.removeprefix("export KUBECONFIG=")
    status = devcluster_cli(run_dir, "status")
    assert status.returncode == 0, status.stdout + status.stderr

    pods = _kubectl_json(kubeconfig, "get", "pods", "-n", "epguard-system")
    pods_running = {
        p["metadata"]["labels"].get("app.kubernetes.io/component", p["metadata"]["name"])
        for p in pods["items"]
        if p["status"]["phase"] == "Running"
    }
    assert {"webhook", "controller"} <= pods_running, pods
    # The chart's own clientConfig: its Service, never a URL.
    webhooks = _kubectl_json(kubeconfig, "get", "validatingwebhookconfigurations")
    assert webhooks["items"]
    for config in webhooks["items"]:
        for hook in config["webhooks"]:
            assert "service" in hook["clientConfig"] and "url" not in hook["clientConfig"]
            assert hook["clientConfig"]["caBundle"]


@pytest.mark.after_all
def test_down_leaves_the_host_as_it_was(shared_node: SharedCluster) -> None:
    shared_node.cluster()
    run_dir, before = shared_node.run_dir, shared_node.before
    assert run_dir is not None and before is not None
    state = json.loads((run_dir / "state.json").read_text())
    pids = [
        p["pid"]
        for part in (state["control_plane"], state["node"] or {"processes": []})
        for p in part["processes"]
    ]
    assert pids and all(running(pid) for pid in pids)

    down = shared_node.stop()
    after = host_snapshot()

    assert down is not None and down.returncode == 0, down and down.stderr
    assert not [pid for pid in pids if running(pid)]
    assert not run_dir.exists()
    assert after == before
