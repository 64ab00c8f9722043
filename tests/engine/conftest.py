"""Fixtures for the probe → verdict → admission loop."""

from __future__ import annotations

import pytest

from tests.probe.probe_pods import run_real_probe


@pytest.fixture(scope="session")
def real_probe_failure(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str]:
    return run_real_probe(tmp_path_factory.mktemp("probe"))
