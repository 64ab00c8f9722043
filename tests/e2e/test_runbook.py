"""docs/runbook.md's commands, run as the runbook gives them, by bash and the real
kubectl against a real API server: an admin who turns injection off or uninstalls epguard
releases the gates the controller can no longer remove, and nothing else."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from devcluster import ControlPlane, binaries

pytestmark = pytest.mark.e2e

RUNBOOK = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"
GATE = "epguard.io/preflight"


def _block_after(marker: str) -> str:
    """The fenced bash block right after the line holding ``marker``."""
    text = RUNBOOK.read_text()
    m = re.search(re.escape(marker) + r"[^\n]*\n```bash\n(.*?)\n```", text, re.S)
    assert m is not None, f"no bash block after {marker!r} in {RUNBOOK}"
    return m.group(1)


def _pod(name: str, gates: list[str], labels: dict[str, str] | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "schedulingGates": [{"name": g} for g in gates],
            "containers": [{"name": "c", "image": "busybox", "command": ["sleep", "1"]}],
        },
    }


def _gates(cp: ControlPlane, namespace: str, name: str) -> list[str]:
    out = cp.kubectl("get", "pod", "-n", namespace, name, "-o", "json", check=True).stdout
    return [g["name"] for g in json.loads(out)["spec"].get("schedulingGates", [])]


def test_the_release_command_removes_only_epguards_gate(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    pods = [
        _pod("behind-another-gate", ["example.com/quota", GATE]),
        _pod("epguard-only", [GATE]),
        _pod("not-epguards", ["example.com/quota"]),
        _pod("preflight", [], labels={"epguard.io/preflight-pod": "true"}),
    ]
    for p in pods:
        control_plane.kubectl(
            "create", "-n", namespace, "-f", "-", input=json.dumps(p), check=True
        )
    kubectl = binaries.find("kubectl")
    env = {
        "PATH": f"{kubectl.parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "KUBECONFIG": str(control_plane.kubeconfig),
        "HOME": str(tmp_path),  # kubectl's cache: not the working directory's .kube
    }
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _block_after("tests/e2e/test_runbook.py")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert _gates(control_plane, namespace, "behind-another-gate") == ["example.com/quota"]
    assert _gates(control_plane, namespace, "epguard-only") == []
    assert _gates(control_plane, namespace, "not-epguards") == ["example.com/quota"]
    left = control_plane.kubectl("get", "pods", "-n", namespace, "-o", "name", check=True)
    assert "pod/preflight" not in left.stdout.split()
    # Run again (nothing left to release): it changes nothing and fails nothing.
    again = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _block_after("tests/e2e/test_runbook.py")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert _gates(control_plane, namespace, "behind-another-gate") == ["example.com/quota"]
