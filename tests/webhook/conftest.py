"""Fixtures for the webhook tests: test rules, policy state, and a loopback TLS server."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from epguard.webhook.engine.policy import PolicyState
from webhook_factory import TEST_RULES, make_state
from webhook_server import RunningServer, running_server


@pytest.fixture
def state() -> PolicyState:
    return make_state()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tmp_path_factory.mktemp("server"), TEST_RULES) as s:
        yield s
