"""``make down`` (``devcluster.stack.down``) says when it could not stop what ``up``
started, keeps the state so that it can be run again, and exits 1: a caller that trusted
it would start a second node on ports and a containerd still taken. Real processes, no
cluster: the stack holds only them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from devcluster.process import ManagedProcess, _start_time, running
from devcluster.stack import Stack, down, up


def _stack(run_dir: Path, *extras: ManagedProcess) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    Stack(run_dir=run_dir, extras=list(extras)).save()


def _sleeper(tmp_path: Path, name: str) -> ManagedProcess:
    """A process in its own group, as ``up`` starts every server."""
    return ManagedProcess.spawn(name, ["sleep", "600"], tmp_path / f"{name}.log", detached=True)


def _stray(tmp_path: Path) -> tuple[subprocess.Popen[bytes], ManagedProcess]:
    """A process the stack records but whose group it does not lead (it is in this test's
    group), so that stopping the group cannot reach it: it outlives ``down``."""
    proc = subprocess.Popen(["sleep", "600"])
    return proc, ManagedProcess(
        name="stray", pid=proc.pid, argv=["sleep", "600"], log=str(tmp_path / "stray.log"),
        start_time=_start_time(proc.pid),
    )  # fmt: skip


def test_down_stops_what_up_started_and_removes_the_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    server = _sleeper(tmp_path, "server")
    _stack(run_dir, server)

    assert down(run_dir) == 0
    assert not running(server.pid)
    assert not run_dir.exists()
    assert f"stopped server (pid {server.pid})" in capsys.readouterr().err


def test_down_reports_a_process_it_could_not_stop_and_keeps_the_state(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    server = _sleeper(tmp_path, "server")
    proc, stray = _stray(tmp_path)
    try:
        _stack(run_dir, server, stray)

        r = subprocess.run(
            [sys.executable, "-m", "devcluster", "--run-dir", str(run_dir), "down"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 1, r.stderr
        assert f"still running after stop: stray (pid {proc.pid})" in r.stderr, r.stderr
        assert "server" not in r.stderr.split("still running after stop:")[1]
        assert not running(server.pid)
        assert running(proc.pid)
        assert (run_dir / "state.json").is_file()
        # `make up` on that run directory does not start a second stack beside it.
        assert up(run_dir, chart=tmp_path / "no-chart") == 1
        assert (run_dir / "state.json").is_file()
    finally:
        proc.kill()
        proc.wait()
    # Once it is gone, `make down` again finishes the job.
    assert down(run_dir) == 0
    assert not run_dir.exists()
