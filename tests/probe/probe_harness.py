"""Run the probe the way an init container does, against real or double packages.

Real packages come from scripts/tools.d/30-realpkgs.sh: one venv with torch 2.13.0
(PyPI's default CUDA 13 build) and overlays, each a mooncake wheel or an SGLang
release installed with ``pip install --no-deps --target``, put on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE_DIR = REPO / "probe"
CACHE = Path(os.environ.get("EPGUARD_CACHE", Path.home() / ".cache" / "epguard")) / "realpkgs"
TORCH_ENV = CACHE / "torch-2.13.0"
# A GPU machine brings its own torch (tests/probe/gpu-run.sh): its python3 replaces the
# cached venv's, and the overlays come from scripts/gpu-payload.sh.
OWN_TORCH = os.environ.get("EPGUARD_TORCH_PYTHON")
TORCH_PY = Path(OWN_TORCH) if OWN_TORCH else TORCH_ENV / "bin" / "python"

MTE_CUDA12 = "mte-0.3.13.post1"
MTE_CUDA13 = "mte-cuda13-0.3.13.post1"
MTE_CUDA13_OLD = "mte-cuda13-0.3.10"
MTE_NON_CUDA = "mte-non-cuda-0.3.13.post1"
MTE_JIT = "mte-cuda13-0.3.14"
# Three real releases on each side of 0.5.17, where SGLang moved from mooncake.ep to
# mooncake.pg. Tests that need one pick [0] or [1]; the third only widens the matrix.
SGLANG_EP = ("sglang-0.5.10.post1", "sglang-0.5.16", "sglang-0.5.13")  # import mooncake.ep
SGLANG_PG = ("sglang-0.5.18", "sglang-0.5.23", "sglang-0.5.20")  # import mooncake.pg

WORKER = [
    "python3",
    "-m",
    "sglang.launch_server",
    "--model-path",
    "m",
    "--elastic-ep-backend",
    "mooncake",
]


def overlay(name: str) -> Path:
    path = CACHE / "overlays" / name
    if not (path / ".done").exists() or not (OWN_TORCH or (TORCH_ENV / ".done").exists()):
        pytest.fail(
            f"real-package env {path} missing: run `make tools` (scripts/tools.d/30-realpkgs.sh)"
        )
    return path


def torch_python() -> Path:
    if not OWN_TORCH and not (TORCH_ENV / ".done").exists():
        pytest.fail("torch 2.13.0 env missing: run `make tools` (scripts/tools.d/30-realpkgs.sh)")
    return TORCH_PY


@dataclass
class Result:
    rc: int
    message: str
    report: dict | None
    stderr: str

    @property
    def lines(self) -> list[str]:
        return self.message.splitlines()

    @property
    def classification(self) -> str | None:
        return (self.report or {}).get("classification")


def clean_env(pythonpath: list[Path] | None = None, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    env["PYTHONNOUSERSITE"] = "1"
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env.update(extra)
    return env


def run_probe(
    tmp_path: Path,
    *,
    python: Path | str | None = None,
    pythonpath: list[Path] | None = None,
    worker: list[str] | None = None,
    opts: list[str] | None = None,
    env: dict[str, str] | None = None,
    probe_dir: Path = PROBE_DIR,
    as_module: bool = False,
    timeout: float = 300,
    wrap: list[str] | None = None,
) -> Result:
    """``python probe --json --termination-log T [opts] -- worker``; parse what it wrote.
    ``wrap``: a command the probe runs under (``unshare …``), its argv appended."""
    python = str(python or torch_python())
    log = tmp_path / "termination-log"
    if log.exists():
        log.unlink()
    head = [python, "-m", "probe"] if as_module else [python, str(probe_dir)]
    cmd = [
        *(wrap or []),
        *head,
        "--json",
        "--termination-log",
        str(log),
        *(opts or []),
        "--",
        *(WORKER if worker is None else worker),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else clean_env(pythonpath),
        cwd=str(probe_dir.parent) if as_module else str(tmp_path),
    )
    report = json.loads(proc.stdout) if proc.stdout.strip() else None
    message = log.read_text() if log.exists() else ""
    return Result(proc.returncode, message, report, proc.stderr)


def write_double(
    root: Path,
    pg: str | None = None,
    ep: str | None = None,
    dist: str = "mooncake-transfer-engine-cuda13",
    version: str = "0.0.0.double",
) -> Path:
    """A fake ``mooncake`` package (with dist-info) whose modules run ``pg``/``ep`` code."""
    pkg = root / "mooncake"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""Test double of the mooncake package."""\n')
    if pg is not None:
        (pkg / "pg.py").write_text(textwrap.dedent(pg))
    if ep is not None:
        (pkg / "ep.py").write_text(textwrap.dedent(ep))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n\n")
    return root


# What a healthy mooncake.pg does on import (0.3.14 _pg_jit/pg_py.cpp and, by the
# same strings, the prebuilt pg_* modules): register both backends with torch.
REGISTER_BOTH = textwrap.dedent("""
    import torch.distributed as dist

    def _create(*args, **kwargs):
        raise RuntimeError("test double: no transport")

    dist.Backend.register_backend("mooncake", _create, extended_api=True, devices=["cuda"])
    dist.Backend.register_backend("mooncake-cpu", _create, extended_api=True, devices=["cpu"])
""")

PG_NAMES = textwrap.dedent("""
    class MooncakeBackendOptions:
        def __init__(self, active_ranks, *args):
            self.active_ranks = active_ranks

    def set_transfer_engine(*args):
        pass

    def get_peer_state(*args):
        return [True]

    def recover_ranks(*args):
        pass

    def join_group(*args):
        pass
""")


def copy_probe(dest: Path) -> Path:
    """The probe directory copied elsewhere, as the injected copy container does."""
    target = dest / "probe"
    shutil.copytree(PROBE_DIR, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target
