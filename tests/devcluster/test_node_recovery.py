"""A node whose owner died without stopping it (a test session killed with SIGKILL) is
cleaned up by the next node's start, from the record it left, not refused forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from devcluster import ControlPlane
from devcluster.node import Node, host_snapshot, node_ip

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.node, pytest.mark.usefixtures("machine_to_itself")]

_OWNER = """
import sys, time
from pathlib import Path
from devcluster import ControlPlane
from devcluster.node import Node, node_ip
cp = ControlPlane(node_ip=node_ip())
cp.start()
Node(cp, Path(sys.argv[1])).start()
print("ready", flush=True)
time.sleep(600)
"""


def test_the_next_start_cleans_up_a_node_whose_owner_was_killed(tmp_path: Path) -> None:
    before = host_snapshot()
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(tmp_path / "dead")],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "ready"
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()

    cp = ControlPlane(node_ip=node_ip())
    cp.start()
    node = Node(cp, tmp_path / "next")
    try:
        node.start()
        assert not (tmp_path / "dead").exists()
    finally:
        node.stop()
        cp.stop()
    assert host_snapshot() == before
