"""Probe runs and kubelet-style pod status for the probe → verdict → admission loop tests
(shared with the e2e tests; kept out of conftest so importing it is plain)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_ARGV = ["python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "mooncake"]


def run_real_probe(
    tmp_path: Path,
    argv: list[str] = WORKER_ARGV,
    *,
    opts: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """Run the real probe in this interpreter (no torch, no mooncake here, unless ``env``
    puts a root on PYTHONPATH) with ``opts`` and return its exit code and the termination
    message it wrote, as the kubelet would read it."""
    log = tmp_path / "termination-log"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "probe"),
            "--termination-log",
            str(log),
            *opts,
            "--",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=None if env is None else dict(env),
    )
    return proc.returncode, log.read_text() if log.exists() else ""


def pod_with_probe_status(
    message: str,
    exit_code: int,
    *,
    image: str = "docker.io/lmsysorg/sglang:v0.5.18-cu130",
    image_id: str = "docker.io/lmsysorg/sglang@sha256:" + "ab" * 32,
    section: str = "state",
    restart_count: int = 0,
    pull_policy: str = "Always",
    started_at: str = "2026-11-30T20:00:00Z",
    finished_at: str = "2026-11-30T20:00:07Z",
) -> dict[str, Any]:
    """A pod as the API returns it after the kubelet wrote the probe's termination.
    ``pull_policy``: the probe's (the worker's) imagePullPolicy; Always resolved the tag."""
    ended = "containerd://" + "c1" * 32
    terminated = {
        "exitCode": exit_code,
        "reason": "Error" if exit_code else "Completed",
        "message": message,
        "startedAt": started_at,
        "finishedAt": finished_at,
        "containerID": ended,
    }
    status: dict[str, Any] = {
        "name": "epguard-probe",
        "image": image,
        "imageID": image_id,
        "containerID": ended,
        "ready": False,
        "restartCount": restart_count,
        "state": {"terminated": terminated},
    }
    if section == "lastState":  # waiting to restart: the status is still the ended run's
        status["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
        status["lastState"] = {"terminated": terminated}
    elif section == "running again":  # the next run started: containerID, imageID its own
        status["state"] = {"running": {"startedAt": finished_at}}
        status["lastState"] = {"terminated": terminated}
        status["containerID"] = "containerd://" + "c2" * 32
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "worker-0", "namespace": "llm", "uid": "u-1"},
        "spec": {
            "initContainers": [
                {"name": "epguard-copy-probe", "image": "epguard:dev"},
                {
                    "name": "epguard-probe",
                    "image": image,
                    "imagePullPolicy": pull_policy,
                    "command": [
                        "python3",
                        "/epguard/probe",
                        "--termination-log",
                        "/dev/termination-log",
                        "--",
                        *WORKER_ARGV,
                    ],
                },
            ],
            "containers": [{"name": "worker", "image": image}],
        },
        "status": {"phase": "Pending", "initContainerStatuses": [status]},
    }
