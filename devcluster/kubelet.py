"""Play the kubelet's part for the epguard probe: run the real probe, write its outcome
into a pod's status the way the kubelet does.

There is no kubelet in devcluster, so nothing runs the probe init container. What the
controller and ``kubectl describe pod`` read is the pod's *status*, and the status is
an API object like any other: this module runs the real probe (``probe/``) in a local
Python environment standing in for the worker's image, and builds the status patch
(``kubectl patch pod … --subresource=status --type=merge -p …``) that a kubelet writes
after the container exits: ``initContainerStatuses[].state.terminated`` with the exit
code, ``reason: Error`` and the termination message the probe wrote.

The stand-in image: when the real-package environments that ``make tools`` builds
(``~/.cache/epguard/realpkgs/``: torch 2.13.0 + published mooncake and SGLang wheels)
exist, the probe runs there with the CUDA 12 mooncake wheel over CUDA 13 torch, a
genuine failure (``libcudart.so.12: cannot open shared object file``). Otherwise it
runs under this interpreter, where mooncake is simply absent (also a real failure).

``python -m devcluster.kubelet probe-status --image IMG --image-id ID -- ARGV...``
prints ``{"exitCode": …, "python": …, "message": …, "patch": {…}}`` as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devcluster.binaries import cache_dir
from webhook.outcome import PROBE_CONTAINER

REPO_ROOT = Path(__file__).resolve().parent.parent
PROBE_DIR = REPO_ROOT / "probe"
REALPKGS = cache_dir() / "realpkgs"
TORCH_ENV = REALPKGS / "torch-2.13.0"
# CUDA 12 mooncake wheel + an SGLang that imports mooncake.pg, over CUDA 13 torch.
OVERLAYS = ("mte-0.3.13.post1", "sglang-0.5.23")
WORKER_ARGV = ("python3", "-m", "sglang.launch_server", "--model-path", "/models/m",
               "--elastic-ep-backend", "mooncake")  # fmt: skip
MAX_TERMINATION_MESSAGE = 4096  # what the kubelet keeps of one container's message


@dataclass(frozen=True, slots=True)
class ProbeRun:
    exit_code: int
    message: str
    python: str  # which environment stood in for the image, in words
    started: dt.datetime
    finished: dt.datetime


def stand_in_image() -> tuple[list[str], dict[str, str], str]:
    """The interpreter, environment and a description of the stand-in for the image."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    env.pop("VIRTUAL_ENV", None)
    overlays = [REALPKGS / "overlays" / name for name in OVERLAYS]
    python = TORCH_ENV / "bin" / "python"
    if (TORCH_ENV / ".done").exists() and all((o / ".done").exists() for o in overlays):
        env["PYTHONPATH"] = os.pathsep.join(str(o) for o in overlays)
        return (
            [str(python)],
            env,
            "torch 2.13.0 (cu130) + mooncake-transfer-engine 0.3.13.post1 + sglang 0.5.23",
        )
    return [sys.executable], env, f"{sys.executable} (no mooncake installed)"


def run_probe(argv: Sequence[str] = WORKER_ARGV, *, timeout: float = 300) -> ProbeRun:
    """Run the real probe as the init container would; its termination log is the message."""
    cmd, env, what = stand_in_image()
    with tempfile.TemporaryDirectory(prefix="epguard-probe-") as tmp:
        log = Path(tmp) / "termination-log"
        started = dt.datetime.now(dt.UTC)
        proc = subprocess.run(
            [*cmd, str(PROBE_DIR), "--termination-log", str(log), "--", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=tmp,
            check=False,
        )
        finished = dt.datetime.now(dt.UTC)
        message = log.read_text() if log.exists() else ""
    if not message:
        # terminationMessagePolicy FallbackToLogsOnError: the kubelet takes the log tail.
        message = (proc.stdout + proc.stderr)[-2048:]
    return ProbeRun(proc.returncode, message, what, started, finished)


def _stamp(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(
    kind: str, ok: bool, at: dt.datetime, reason: str | None = None, message: str | None = None
) -> dict[str, str]:
    cond = {"type": kind, "status": "True" if ok else "False", "lastTransitionTime": _stamp(at)}
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    return cond


def _completed(name: str, image: str, at: dt.datetime) -> dict[str, Any]:
    """An init container that ran before the probe and exited 0 (e.g. epguard-copy-probe)."""
    cid = "containerd://" + os.urandom(32).hex()
    return {
        "name": name,
        "image": image,
        "imageID": image.rsplit(":", 1)[0] + "@sha256:" + os.urandom(32).hex(),
        "containerID": cid,
        "ready": True,
        "started": False,
        "restartCount": 0,
        "state": {
            "terminated": {
                "exitCode": 0,
                "reason": "Completed",
                "startedAt": _stamp(at),
                "finishedAt": _stamp(at),
                "containerID": cid,
            }
        },
    }


def probe_status_patch(
    run: ProbeRun,
    *,
    image: str,
    image_id: str,
    container: str = PROBE_CONTAINER,
    worker: str = "worker",
    restart_count: int = 0,
    completed_before: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """A merge patch for ``pods/status``: what the kubelet writes once the probe exited.

    ``completed_before``: (name, image) of init containers that ran (and succeeded)
    before the probe, such as the injected ``epguard-copy-probe``."""
    message = run.message.encode()[:MAX_TERMINATION_MESSAGE].decode(errors="ignore")
    container_id = "containerd://" + os.urandom(32).hex()
    terminated = {
        "exitCode": run.exit_code,
        "reason": "Completed" if run.exit_code == 0 else "Error",
        "message": message,
        "startedAt": _stamp(run.started),
        "finishedAt": _stamp(run.finished),
        "containerID": container_id,
    }
    failed = run.exit_code != 0
    probe = {
        "name": container,
        "image": image,
        "imageID": image_id,
        "containerID": container_id,
        "ready": not failed,
        "started": False,
        "restartCount": restart_count,
        "state": {"terminated": terminated},
    }
    return {
        "status": {
            "phase": "Pending",
            "hostIP": "10.0.0.17",
            "podIP": "10.244.1.23",
            "startTime": _stamp(run.started),
            "conditions": [
                _condition(
                    "Initialized",
                    not failed,
                    run.finished,
                    "ContainersNotInitialized" if failed else None,
                    f"containers with incomplete status: [{container}]" if failed else None,
                ),
                _condition(
                    "Ready",
                    False,
                    run.started,
                    "ContainersNotReady",
                    f"containers with unready status: [{worker}]",
                ),
                _condition("PodScheduled", True, run.started),
            ],
            "initContainerStatuses": [
                *(_completed(n, i, run.started) for n, i in completed_before),
                probe,
            ],
            "containerStatuses": [
                {
                    "name": worker,
                    "image": image,
                    "imageID": "",
                    "ready": False,
                    "started": False,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": "PodInitializing"}},
                }
            ],
        }
    }


def _name_image(value: str) -> tuple[str, str]:
    name, sep, image = value.partition("=")
    if not sep or not name or not image:
        raise argparse.ArgumentTypeError(f"expected NAME=IMAGE, got {value!r}")
    return name, image


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devcluster.kubelet",
        description="Run the real epguard probe and write the pod status a kubelet would.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe-status", help="run the probe; write the pods/status merge patch")
    p.add_argument("--image", required=True, help="the image as written in the pod")
    p.add_argument("--image-id", required=True, help="what the runtime resolved: repo@sha256:…")
    p.add_argument("--container", default=PROBE_CONTAINER)
    p.add_argument("--worker", default="worker", help="the app container's name")
    p.add_argument(
        "--completed",
        type=_name_image,
        action="append",
        default=[],
        metavar="NAME=IMAGE",
        help="an init container that ran and exited 0 before the probe (repeatable)",
    )
    p.add_argument(
        "--patch-file",
        type=Path,
        help="write the patch here and print a one-line summary; else print JSON "
        "{exitCode, python, message, patch}",
    )
    p.add_argument("worker_argv", nargs="*", help="after --: the worker's command and args")
    args = parser.parse_args(argv)
    run = run_probe(args.worker_argv or WORKER_ARGV)
    patch = probe_status_patch(
        run,
        image=args.image,
        image_id=args.image_id,
        container=args.container,
        worker=args.worker,
        completed_before=args.completed,
    )
    if args.patch_file is not None:
        args.patch_file.write_text(json.dumps(patch, indent=2) + "\n")
        first = run.message.strip().splitlines()[0] if run.message.strip() else "(no message)"
        print(f"probe exited {run.exit_code} in [{run.python}]: {first}")
        return 0
    json.dump(
        {"exitCode": run.exit_code, "python": run.python, "message": run.message, "patch": patch},
        sys.stdout,
    )
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
