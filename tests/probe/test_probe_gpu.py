"""On a machine with an NVIDIA GPU and driver: a real, healthy mooncake.

Skipped elsewhere (tests/conftest.py). Uses the real-package env: torch 2.13.0
(CUDA 13) with mooncake-transfer-engine-cuda13 0.3.13.post1, which ships pg_2_13_0,
under SGLang 0.5.18. The wheel also needs rdma-core userspace from the OS.
"""

from __future__ import annotations

import ctypes

import pytest

from tests.probe.probe_harness import MTE_CUDA13, SGLANG_PG, overlay, run_probe

pytestmark = [pytest.mark.gpu, pytest.mark.realpkg]


def _loads(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


@pytest.fixture
def healthy_image():
    absent = [lib for lib in ("libibverbs.so.1", "libmlx5.so.1", "libnuma.so.1") if not _loads(lib)]
    if absent:
        pytest.skip(f"the OS lacks rdma-core userspace: {', '.join(absent)}")
    return [overlay(MTE_CUDA13), overlay(SGLANG_PG[0])]


def test_a_healthy_wheel_on_a_gpu_is_usable(tmp_path, healthy_image):
    r = run_probe(tmp_path, pythonpath=healthy_image)
    assert r.rc == 0, r.message
    assert r.lines[0].startswith("epguard: mooncake elastic EP is usable: mooncake.pg imports")
    checks = {c["name"]: c for c in r.report["checks"]}
    assert checks["backends"]["detail"] == "mooncake=cuda mooncake-cpu=cpu"
    assert checks["cuda"]["detail"].startswith("available=yes")


def test_smoke_runs_one_rank_groups_on_both_backends(tmp_path, healthy_image):
    r = run_probe(tmp_path, pythonpath=healthy_image, opts=["--level", "smoke"])
    assert r.rc == 0, r.message
    smoke = {c["name"]: c["ok"] for c in r.report["checks"] if c["name"].startswith("smoke")}
    assert smoke == {"smoke mooncake": True, "smoke mooncake-cpu": True}
