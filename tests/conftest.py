"""Suite-wide fixtures and markers.

``state`` (the engine's in-memory state with the test rules) and ``server`` (a real
webhook on loopback TLS, one per module) serve the engine and admission tests.

Tests marked ``gpu`` need an NVIDIA driver (``libcuda.so.1``) and a visible GPU;
they are skipped on machines without one and run where one exists.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pytest

from epguard.webhook.engine.policy import PolicyState
from tests.factory import TEST_RULES, make_state
from tests.servers import RunningServer, running_server


def _has_gpu() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver (libcuda.so.1)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def state() -> PolicyState:
    return make_state()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tmp_path_factory.mktemp("server"), TEST_RULES) as s:
        yield s
