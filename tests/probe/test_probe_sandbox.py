"""The child's whole run is bounded, whatever it announces."""

from __future__ import annotations

import time

import pytest

from epguard.probe import sandbox

# Hostile code in a tenant's image can write to the probe's event pipe (an inherited
# fd): fake step announcements, each of which renews the per-step timeout.
SPAMMER = """
import os, sys, time
fd = int(sys.argv[1])
while True:
    os.write(fd, b'{"event": "step", "step": "import mooncake.pg"}\\n')
    time.sleep(0.05)
"""


def test_a_child_that_announces_steps_forever_is_killed_at_the_overall_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sandbox, "_CHILD_SOURCE", SPAMMER)
    step = 0.25
    child = sandbox.Child(step)
    child.send_plan({})
    started = time.monotonic()
    run = child.collect()
    took = time.monotonic() - started
    assert run.timed_out and not run.finished
    assert len(run.events) > sandbox.MAX_STEPS  # it kept renewing the step timeout
    assert step * sandbox.MAX_STEPS <= took < step * sandbox.MAX_STEPS + 2


def test_a_child_that_goes_silent_is_killed_after_one_step_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sandbox, "_CHILD_SOURCE", "import time; time.sleep(60)")
    child = sandbox.Child(0.5)
    child.send_plan({})
    started = time.monotonic()
    run = child.collect()
    assert run.timed_out and time.monotonic() - started < 2.5
