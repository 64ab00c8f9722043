"""Run child.py in a child interpreter and collect its step reports.

A library that segfaults or hangs on import must yield a verdict, not a silent
death of the probe: each step the child announces gets ``timeout`` seconds, the
child runs in its own session so a hang is killed with everything it spawned, and
a death by signal is reported with the step it interrupted.
"""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time

try:
    from . import message
except ImportError:  # run as `python3 probe`: the directory itself is on sys.path
    import message

_CHILD_SOURCE = None
# The whole child run is bounded by this many step timeouts (see Child.collect).
MAX_STEPS = 8

# Interpreter-level variables that change how Python or torch behave, not which files
# the image holds: the worker's env is copied into the probe, and PYTHONWARNINGS=error
# or TORCH_LOGS=<bad> made torch "not import" in a good image. The child runs without
# them (the ones an image needs to find its packages are kept) and the probe says so.
_KEEP_PYTHON = frozenset({"PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONNOUSERSITE",
                          "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONUNBUFFERED",
                          "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED"})
_DROP = frozenset({"TORCH_LOGS", "TORCH_COMPILE_DEBUG", "TORCHDYNAMO_VERBOSE",
                   "TORCH_SHOW_CPP_STACKTRACES", "TORCH_DISABLE_ADDR2LINE"})


# The pod's own variables reach the probe under POD_PREFIX (message.py), so the probe, its
# interpreter (``python3`` through the image's own PATH) and its verdict about the image
# depend only on the image. The worker's environment is the image's with these restored.
POD_PREFIX = message.POD_PREFIX
# How many of the pod's variable names a message lists before "and N more".
MAX_NAMES_SAID = 12


def image_environment(environ=None):
    """The environment the image itself gives (and the node: the device plugin's
    variables), without anything the pod set."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith(POD_PREFIX)}


def worker_environment(environ=None):
    """The worker container's environment: the image's, then the pod's variables (the
    kubelet already resolved env over envFrom among the prefixed names)."""
    environ = os.environ if environ is None else environ
    out = image_environment(environ)
    for k, v in environ.items():
        if k.startswith(POD_PREFIX) and len(k) > len(POD_PREFIX):
            out[k[len(POD_PREFIX):]] = v
    return out


def pod_variables(environ=None):
    """The names the pod set (env and envFrom), sorted."""
    environ = os.environ if environ is None else environ
    return sorted(k[len(POD_PREFIX):] for k in environ
                  if k.startswith(POD_PREFIX) and len(k) > len(POD_PREFIX))


def said_count(names):
    """The pod's variables in a message that may become a verdict about the image: how
    many, never their names (the tenant's text; their names are in --json's
    ``pod_variables``)."""
    n = len(names)
    return f"{n} variable" + ("" if n == 1 else "s")


def said_names(names):
    """Names for a message about this pod only: the first MAX_NAMES_SAID, then how many
    more."""
    names = list(names)
    head = ", ".join(names[:MAX_NAMES_SAID])
    more = len(names) - MAX_NAMES_SAID
    return head + (f" and {more} more" if more > 0 else "")


def interpreter_for(environ):
    """The ``python3`` the worker's PATH finds: this interpreter (the one the image's PATH
    found) unless the pod set another PATH, and then the first ``python3`` on it."""
    path = environ.get("PATH")
    if path is None or path == image_environment().get("PATH") or len(path) > 64 * 1024:
        return sys.executable
    for entry in path.split(os.pathsep)[:256]:
        candidate = os.path.join(entry or ".", "python3")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


def interpreter_variables(environ=None):
    """The names in ``environ`` the child runs without, sorted."""
    environ = os.environ if environ is None else environ
    return sorted(n for n in environ
                  if (n.startswith("PYTHON") and n not in _KEEP_PYTHON) or n in _DROP)


def child_environment(environ=None):
    environ = os.environ if environ is None else environ
    dropped = set(interpreter_variables(environ))
    return {k: v for k, v in environ.items() if k not in dropped}


def _child_source():
    global _CHILD_SOURCE
    if _CHILD_SOURCE is None:
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "child.py")) as f:
            _CHILD_SOURCE = f.read()
    return _CHILD_SOURCE


class Run:
    """What one child reported, and how it ended."""

    def __init__(self):
        self.events = []
        self.last_step = None
        self.returncode = None
        self.signal = None  # e.g. "SIGSEGV"
        self.timed_out = False
        self.output_tail = ""
        self.finished = False  # the child reported "done"


class Child:
    """A started child; ``send_plan`` then ``collect``."""

    def __init__(self, timeout, environ=None, executable=None):
        """``environ``: the environment to check in (default: the image's own);
        ``executable``: the interpreter (default: this one, the image's ``python3``)."""
        self.timeout = timeout
        environ = image_environment() if environ is None else environ
        read_fd, write_fd = os.pipe()
        self._read_fd = read_fd
        try:
            self.proc = subprocess.Popen(
                [executable or sys.executable, "-c", _child_source(), str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                start_new_session=True,
                env=child_environment(environ),
            )
        finally:
            os.close(write_fd)

    def send_plan(self, plan):
        try:
            self.proc.stdin.write((json.dumps(plan) + "\n").encode())
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def _kill(self):
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self):
        """End the child and everything it started, unheard (the files already told)."""
        self._kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        with contextlib.suppress(OSError):
            os.close(self._read_fd)
        self.proc.wait()

    def collect(self):
        run = Run()
        out_fd = self.proc.stdout.fileno()
        open_fds = {self._read_fd: b"", out_fd: b""}
        tail = b""
        deadline = time.monotonic() + self.timeout
        # Each step's announcement renews ``deadline``; this one is never renewed, so a
        # child that announces steps forever (code in a tenant's image can write to any
        # inherited fd) still ends. A real plan has at most a handful of steps.
        overall = time.monotonic() + self.timeout * MAX_STEPS
        try:
            while open_fds and not run.finished:
                remaining = min(deadline, overall) - time.monotonic()
                if remaining <= 0:
                    run.timed_out = True
                    self._kill()
                    break
                ready, _, _ = select.select(list(open_fds), [], [], remaining)
                for fd in ready:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        del open_fds[fd]
                        continue
                    if fd == out_fd:
                        tail = (tail + chunk)[-4096:]
                        continue
                    buf = open_fds[fd] + chunk
                    *lines, rest = buf.split(b"\n")
                    open_fds[fd] = rest
                    for line in lines:
                        try:
                            event = json.loads(line.decode("utf-8", "replace"))
                        except ValueError:
                            continue
                        run.events.append(event)
                        if event.get("event") == "step":
                            run.last_step = event.get("step")
                            deadline = time.monotonic() + self.timeout
                        elif event.get("event") == "done":
                            run.finished = True
        finally:
            if run.finished:
                # Everything is reported. Interpreter shutdown (torch's teardown, or
                # a daemon mooncake spawned holding our pipes) is not the worker's
                # problem at start-up and must not delay the verdict.
                self._kill()
            os.close(self._read_fd)
            self.proc.stdout.close()
            run.returncode = self.proc.wait()
        if run.returncode is not None and run.returncode < 0 and not (
                run.timed_out or run.finished):
            try:
                run.signal = signal.Signals(-run.returncode).name
            except ValueError:
                run.signal = f"signal {-run.returncode}"
        run.output_tail = tail.decode("utf-8", "replace")
        return run
