"""docs/runbook.md's commands, run as the runbook gives them, by bash and the real
kubectl against a real API server: an admin who turns injection off or uninstalls epguard
releases the gates the controller can no longer remove, and nothing else.

The API server is this module's own: the command works across all namespaces (it would
release other tests' gates), and a cluster that still has epguard's policies refuses a
preflight pod made by anyone but its controller (the one the command deletes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster import ControlPlane, binaries
from tests.control_plane import running_control_plane

pytestmark = pytest.mark.e2e

RUNBOOK = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"
GATE = "epguard.io/preflight"


def _block_after(marker: str) -> str:
    """The fenced bash block right after the line holding ``marker``."""
    text = RUNBOOK.read_text()
    m = re.search(re.escape(marker) + r"[^\n]*\n```bash\n(.*?)\n```", text, re.S)
    assert m is not None, f"no bash block after {marker!r} in {RUNBOOK}"
    return m.group(1)


def _pod(name: str, gates: list[str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "schedulingGates": [{"name": g} for g in gates],
            "containers": [{"name": "c", "image": "busybox", "command": ["sleep", "1"]}],
        },
    }


@pytest.fixture(scope="module")
def own_api_server() -> Iterator[ControlPlane]:
    with running_control_plane() as cp:
        yield cp


def _gates(cp: ControlPlane, namespace: str, name: str) -> list[str]:
    out = cp.kubectl("get", "pod", "-n", namespace, name, "-o", "json", check=True).stdout
    return [g["name"] for g in json.loads(out)["spec"].get("schedulingGates", [])]


def _release(env: dict[str, str]) -> None:
    """The runbook's release command, as an admin's shell runs it."""
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _block_after("tests/e2e/test_runbook.py")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_release_command_removes_only_epguards_gate(
    own_api_server: ControlPlane, tmp_path: Path
) -> None:
    control_plane, namespace = own_api_server, "ml-team"
    control_plane.kubectl("create", "namespace", namespace, check=True)
    pods = [
        _pod("behind-another-gate", ["example.com/quota", GATE]),
        _pod("epguard-only", [GATE]),
        _pod("not-epguards", ["example.com/quota"]),
        _pod("preflight", [], labels={"epguard.io/preflight-pod": "true"}),
    ]
    for p in pods:
        made = control_plane.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(p))
        assert made.returncode == 0, made.stderr
    kubectl = binaries.find("kubectl")
    env = {
        "PATH": f"{kubectl.parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "KUBECONFIG": str(control_plane.kubeconfig),
        "HOME": str(tmp_path),  # kubectl's cache: not the working directory's .kube
    }
    _release(env)
    assert _gates(control_plane, namespace, "behind-another-gate") == ["example.com/quota"]
    assert _gates(control_plane, namespace, "epguard-only") == []
    assert _gates(control_plane, namespace, "not-epguards") == ["example.com/quota"]
    left = control_plane.kubectl("get", "pods", "-n", namespace, "-o", "name", check=True)
    assert "pod/preflight" not in left.stdout.split()
    # Run again (nothing left to release): it changes nothing and fails nothing.
    _release(env)
    assert _gates(control_plane, namespace, "behind-another-gate") == ["example.com/quota"]
