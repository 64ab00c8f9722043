"""Child processes that never outlive the control plane that started them.

Every server runs in its own session (so its process group can be signalled as
a whole, children included, and a Ctrl-C in the terminal does not reach it
half-way through a shutdown). Attached processes also get ``PR_SET_PDEATHSIG``:
if the Python process that started them dies, even by SIGKILL, the kernel
kills them too. Detached processes (``python -m devcluster up``) are meant to
outlive the CLI; their pid and start time are recorded so that ``down`` can
stop them later without ever signalling a recycled pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    There is a window between closing this socket and the server binding the
    port; callers detect the (rare) loss of that race by the server exiting.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def running(pid: int) -> bool:
    """Does ``pid`` exist and still run? A zombie has exited; it only waits for its
    parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def _die_with_parent() -> None:
    # Runs in the child between fork and exec.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _start_time(pid: int) -> int | None:
    """The process start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


@dataclass
class ManagedProcess:
    """A server process in its own process group, with its log file."""

    name: str
    pid: int
    argv: list[str]
    log: str
    start_time: int | None

    @classmethod
    def spawn(
        cls,
        name: str,
        argv: Sequence[str],
        log: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        detached: bool = False,
    ) -> ManagedProcess:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=None if detached else _die_with_parent,
            )
        # The Popen object is dropped on purpose: liveness and exit are read from
        # /proc and waitpid so that a process restored from .run/ state behaves the
        # same as one started here. Popen's destructor does not kill or reap.
        return cls(
            name=name,
            pid=proc.pid,
            argv=list(argv),
            log=str(log),
            start_time=_start_time(proc.pid),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ManagedProcess:
        return cls(
            name=str(data["name"]),
            pid=int(data["pid"]),
            argv=[str(a) for a in data["argv"]],
            log=str(data["log"]),
            start_time=None if data.get("start_time") is None else int(data["start_time"]),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _reap(self) -> None:
        # Only our own children can be reaped; for a process started by an
        # earlier `up` this raises ChildProcessError, which is fine.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, os.WNOHANG)

    def alive(self) -> bool:
        """True while the process exists and is the one we started (not a recycled pid)."""
        self._reap()
        start = _start_time(self.pid)
        if start is None or (self.start_time is not None and start != self.start_time):
            return False
        return running(self.pid)

    def log_tail(self, lines: int = 40, since: int = 0) -> str:
        """The log's last ``lines`` lines among those written from byte ``since`` on."""
        try:
            with open(self.log, "rb") as log:
                log.seek(since)
                text = log.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _signal_group(self, sig: signal.Signals) -> bool:
        """Whether the signal reached the group: pgid == pid because the process leads
        its own session; a process that left it, or one not ours to signal, is not
        reached, and waiting for it to exit would be waiting for nothing."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def _group_is_ours(self) -> bool:
        # Linux never hands out a pid that is still in use as a process-group id,
        # so if the leader's pid is free, only our leftovers can be in the group;
        # if it is taken by a process with another start time, the pid was recycled.
        start = _start_time(self.pid)
        return start is None or self.start_time is None or start == self.start_time

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the whole group, then SIGKILL what is left after ``grace`` seconds."""
        self._reap()
        if not self._group_is_ours():
            return
        if self.alive() and self._signal_group(signal.SIGTERM):
            deadline = time.monotonic() + grace
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        # Also catches children that outlived their leader.
        if self._group_is_ours() and self._signal_group(signal.SIGKILL):
            deadline = time.monotonic() + 5.0
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
