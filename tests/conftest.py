"""Suite-wide fixtures and markers.

Tests marked ``gpu`` need an NVIDIA driver (``libcuda.so.1``) and a visible GPU;
they are skipped on machines without one and run where one exists.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest


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
