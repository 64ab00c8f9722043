"""On a machine with an NVIDIA GPU and driver: a real, healthy mooncake.

Skipped elsewhere (tests/conftest.py). Here the real-package env serves: torch 2.13.0
(CUDA 13) with mooncake-transfer-engine-cuda13 0.3.13.post1, which ships pg_2_13_0,
under SGLang 0.5.18. A GPU machine that brings its own torch and cannot reach PyPI
runs them through tests/probe/gpu-run.sh with scripts/gpu-payload.sh's wheels (torch
2.11.0 there: the same mooncake wheel's pg_2_11_0, under SGLang 0.5.17, the release
that pins torch 2.11.0). The wheel also needs rdma-core userspace from the OS.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.probe.probe_harness import (
    MTE_CUDA13,
    MTE_JIT,
    clean_env,
    overlay,
    run_probe,
    torch_python,
)

pytestmark = [pytest.mark.gpu, pytest.mark.realpkg]

# The SGLang release whose pin is this torch, and so imports mooncake the way a worker
# on that torch does (both from 0.5.17 on: mooncake.pg).
SGLANG_FOR_TORCH = {"2.11.0": "sglang-0.5.17", "2.13.0": "sglang-0.5.18"}


def _loads(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def sglang() -> Path:
    out = subprocess.run(
        [str(torch_python()), "-c", "import torch; print(torch.__version__.split('+')[0])"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.strip()
    if out not in SGLANG_FOR_TORCH:
        pytest.skip(f"torch {out}: no SGLang release here pins it ({sorted(SGLANG_FOR_TORCH)})")
    return overlay(SGLANG_FOR_TORCH[out])


@pytest.fixture(scope="module")
def rdma_core() -> None:
    absent = [lib for lib in ("libibverbs.so.1", "libmlx5.so.1", "libnuma.so.1") if not _loads(lib)]
    if absent:
        pytest.skip(f"the OS lacks rdma-core userspace: {', '.join(absent)}")


@pytest.fixture
def healthy_image(rdma_core: None, sglang: Path) -> list[Path]:
    return [overlay(MTE_CUDA13), sglang]


def test_a_healthy_wheel_on_a_gpu_is_usable(tmp_path, healthy_image):
    r = run_probe(tmp_path, pythonpath=healthy_image)
    assert r.rc == 0, r.message + r.stderr
    assert r.lines[0].startswith("epguard: mooncake elastic EP is usable: mooncake.pg imports")
    checks = {c["name"]: c for c in r.report["checks"]}
    assert checks["backends"]["detail"] == "mooncake=cuda mooncake-cpu=cpu"
    assert checks["cuda"]["detail"].startswith("available=yes")


def test_the_jit_wheel_builds_its_adapter_on_a_gpu_node_with_nvcc_and_ninja(
    tmp_path, rdma_core, sglang
):
    """cuda13 0.3.14 ships no pg_* module: its first import compiles one. With nvcc,
    ninja and a GPU in the image the build must succeed and the probe say usable; the
    seconds it took are printed, since the init container's per-step --timeout
    (default 120) has to cover them on a node's first start."""
    tools = {t: shutil.which(t) for t in ("nvcc", "ninja")}
    if not all(tools.values()):
        pytest.skip(f"no {' or '.join(t for t, w in tools.items() if not w)} on PATH")
    cache = tmp_path / "pg_jit"
    env = clean_env([overlay(MTE_JIT), sglang], MOONCAKE_PG_JIT_DIR=str(cache))
    start = time.monotonic()
    r = run_probe(tmp_path, env=env, opts=["--timeout", "300"], timeout=330)
    print(f"JIT build and probe: {time.monotonic() - start:.1f} s")
    assert r.rc == 0, r.message + r.stderr
    assert r.lines[0].startswith("epguard: mooncake elastic EP is usable"), r.message
    checks = {c["name"]: c for c in r.report["checks"]}
    assert checks["backends"]["detail"] == "mooncake=cuda mooncake-cpu=cpu"
    assert sorted(p.name for p in cache.rglob("*.so")), "the build left no adapter"


def test_smoke_runs_one_rank_groups_on_both_backends(tmp_path, healthy_image):
    r = run_probe(tmp_path, pythonpath=healthy_image, opts=["--level", "smoke", "--timeout", "45"])
    assert r.rc == 0, r.message + r.stderr
    smoke = {c["name"]: c["ok"] for c in r.report["checks"] if c["name"].startswith("smoke")}
    assert smoke == {"smoke mooncake": True, "smoke mooncake-cpu": True}, r.report
