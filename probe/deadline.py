"""One deadline for the whole probe run, derived from ``--timeout``.

Each step of the child already has ``--timeout`` seconds (sandbox.py). Around that:

- the reading of the image's files (static.py) gets at most ``--timeout`` seconds of
  its own, checked on every file it touches (files.Live); past it the files decide
  nothing and the import decides, as with ``--no-static``;
- the whole run, from the reading of the worker's argv to the verdict, ends within
  RUN_STEPS x ``--timeout``: a SIGALRM timer kills the child's process groups and
  raises :class:`Expired` wherever the probe is (even in a system call that blocks,
  which a check between calls cannot end). The probe then says "timed out" (an
  environment cause, exit 1), as for a step that hangs.

Standard library only; Python 3.8 syntax.
"""

import contextlib
import os
import signal
import threading
import time

# A real run has at most ~7 steps per check (import torch, two modules, one alternate,
# CUDA, two smoke groups) and the probe may check twice (the image's own environment,
# then the pod's variables): 16 step timeouts is past any real run.
RUN_STEPS = 16
# After the first alarm, it fires again this often until the run has ended (the first
# one may land where the exception is swallowed, or before a child was started).
REPEAT_S = 1.0

_state = {"until": None, "expired": False}


class Expired(BaseException):
    """The whole run passed its deadline. A BaseException, so that no ``except
    Exception`` on the way (a probe bug handler, a static-path fallback) swallows it."""


def run_until():
    """The monotonic time the whole run must end by; None outside :func:`whole_run`."""
    return _state["until"]


def static_until(timeout, now=None):
    """When the reading of the image's files must stop: ``timeout`` from now, and no
    later than the whole run."""
    now = time.monotonic() if now is None else now
    until = now + timeout
    whole = _state["until"]
    return until if whole is None else min(until, whole)


def _children():
    """Our children that lead their own process group (the child interpreters)."""
    me = os.getpid()
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read(4096).rsplit(b")", 1)[-1].split()
        except OSError:
            continue
        # After the command: state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[1]) == me and int(fields[2]) == int(name):
            out.append(int(name))
    return out


def _on_alarm(signum, frame):
    for pgid in _children():
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    _state["expired"] = True
    raise Expired()


@contextlib.contextmanager
def whole_run(timeout):
    """Arm the deadline of the whole run (RUN_STEPS x ``timeout`` from now).

    Where no interval timer can be set (not the main thread, no setitimer), only the
    static path's own deadline and the child's step timeouts bound the run.
    """
    seconds = RUN_STEPS * timeout
    _state["until"] = time.monotonic() + seconds
    _state["expired"] = False
    armed = (hasattr(signal, "setitimer") and
             threading.current_thread() is threading.main_thread())
    old = None
    if armed:
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds, REPEAT_S)
    try:
        yield seconds
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old if old is not None else signal.SIG_DFL)
        _state["until"] = None
