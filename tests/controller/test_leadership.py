"""Which controller replica runs the loops kopf does not pause (the preflight passes,
the backstop's writer): kopf's own rule, read from the peering object's status.

The rule is checked here against kopf's own code (``process_peering_event`` given the
same status decides whether it pauses), and the loops against a Leadership whose
peering API is an in-memory status. Two real replicas with real kopf peering:
tests/e2e/test_controller_resilience.py."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Mapping
from typing import Any

import kopf
import pytest
from kopf._cogs.aiokits import aiotoggles
from kopf._core.engines import peering as kopf_peering

from epguard.webhook.controller import backstop, gatekeeper
from epguard.webhook.controller.compiler import BackstopConfig
from epguard.webhook.controller.leadership import REFRESH_SECONDS, Leadership, leads

ME = "controller-0/aa"
OTHER = "controller-1/bb"


def entry(priority: Any, seen: dt.datetime | None = None, lifetime: Any = 60) -> dict[str, Any]:
    out: dict[str, Any] = {"priority": priority, "lifetime": lifetime}
    if seen is not None:
        out["lastseen"] = seen.isoformat()
    return out


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def kopf_pauses(status: Mapping[str, Any], identity: str, priority: int) -> bool:
    """What kopf itself decides for this status: whether it pauses the replica."""

    async def decide() -> bool:
        settings = kopf.OperatorSettings()
        settings.peering.name = "p"
        settings.peering.priority = priority
        conflicts = aiotoggles.Toggle(False)
        pressure = asyncio.Event()
        pressure.set()  # do not sleep until a peer's deadline
        event: Any = {"type": "MODIFIED", "object": {"metadata": {"name": "p"}, "status": status}}
        await kopf_peering.process_peering_event(
            raw_event=event,
            namespace=None,  # type: ignore[arg-type]
            resource=None,  # type: ignore[arg-type]
            identity=kopf_peering.Identity(identity),
            settings=settings,
            autoclean=False,
            stream_pressure=pressure,
            conflicts_found=conflicts,
        )
        return conflicts.is_on()

    return asyncio.run(decide())


def cases() -> dict[str, tuple[dict[str, Any], bool]]:
    """Built when a test runs, not at import: a peer's lastseen is only 60 s alive."""
    return {
        "alone": ({ME: entry(5, now())}, True),
        "not written yet, nobody else": ({}, True),
        "a live peer above": ({ME: entry(5, now()), OTHER: entry(9, now())}, False),
        "a live peer below": ({ME: entry(9, now()), OTHER: entry(5, now())}, True),
        "a tie pauses both": ({ME: entry(5, now()), OTHER: entry(5, now())}, False),
        "a dead peer above": (
            {ME: entry(5, now()), OTHER: entry(9, now() - dt.timedelta(seconds=61))},
            True,
        ),
        "a peer above with a short lifetime, dead": (
            {OTHER: entry(9, now() - dt.timedelta(seconds=11), lifetime=10)},
            True,
        ),
        "a peer above that wrote no time is live": ({OTHER: entry(9)}, False),
        "a naive time is UTC": (
            {OTHER: {"priority": 9, "lastseen": now().replace(tzinfo=None).isoformat()}},
            False,
        ),
    }


@pytest.mark.parametrize("name", list(cases()))
def test_the_rule_is_kopfs(name: str) -> None:
    status, expected = cases()[name]
    priority = status.get(ME, {}).get("priority", 5)
    assert leads(status, ME, priority, now()) is expected
    assert kopf_pauses(status, ME, priority) is (not expected)


@pytest.mark.parametrize(
    "bad",
    [
        "not a map",
        {"priority": "high", "lastseen": now().isoformat()},
        {"priority": 9, "lastseen": "yesterday"},
        {"priority": 9, "lifetime": "forever", "lastseen": now().isoformat()},
        {"priority": 9, "lifetime": 10**30, "lastseen": now().isoformat()},
        {"priority": 9, "lastseen": 12345},
    ],
)
def test_an_entry_that_does_not_parse_is_no_replica(bad: Any) -> None:
    assert leads({ME: entry(5, now()), OTHER: bad}, ME, 5, now())
    assert not leads({ME: entry(5, now()), OTHER: bad, "c/3": entry(6, now())}, ME, 5, now())


class Status:
    """The peering API: an in-memory status, or an error."""

    def __init__(self, status: Mapping[str, Any] | None = None) -> None:
        self.status: Mapping[str, Any] = status or {}
        self.error: Exception | None = None
        self.reads = 0

    def exists(self, name: str) -> bool:
        return True

    def create(self, name: str) -> None:
        raise FileExistsError(name)

    def peers(self, name: str) -> Mapping[str, Any]:
        self.reads += 1
        if self.error is not None:
            raise self.error
        return self.status


class Ticks:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_standalone_always_leads_and_reads_nothing() -> None:
    api = Status({OTHER: entry(9, now())})
    assert Leadership(api, "", ME, 5).leads()
    assert Leadership(None, "epguard").leads()
    assert api.reads == 0


def test_an_answer_is_reused_for_a_second_then_read_again(caplog: pytest.LogCaptureFixture) -> None:
    api, clock = Status({ME: entry(5, now())}), Ticks()
    leadership = Leadership(api, "epguard", ME, 5, clock=clock)
    with caplog.at_level("INFO", logger="epguard.controller.leadership"):
        assert leadership.leads() and leadership.leads()
        assert api.reads == 1
        api.status = {ME: entry(5, now()), OTHER: entry(9, now())}
        clock.t += REFRESH_SECONDS
        assert not leadership.leads()
        assert api.reads == 2
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("this replica leads") and said[1].startswith("another replica leads")
    assert len(said) == 2  # a transition is said once


def test_an_unreadable_peering_object_runs_the_loops_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api, clock = Status({ME: entry(5, now()), OTHER: entry(9, now())}), Ticks()
    leadership = Leadership(api, "epguard", ME, 5, clock=clock)
    assert not leadership.leads()
    api.error = ConnectionError("the API server is down")
    with caplog.at_level("WARNING", logger="epguard.controller.leadership"):
        for _ in range(3):
            clock.t += REFRESH_SECONDS
            assert leadership.leads()  # never a loop that never runs: pods would stay gated
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "the API server is down" in warnings[0].getMessage()


class CountingPreflights:
    def __init__(self) -> None:
        self.passes = 0

    def run_once(self) -> gatekeeper.Pass:
        self.passes += 1
        return gatekeeper.Pass()


def run_loop_for(memo: kopf.Memo, preflights: CountingPreflights, seconds: float) -> None:
    async def scenario() -> None:
        memo[f"{gatekeeper.NAME}_wake"] = gatekeeper._Wake()
        stop = asyncio.Event()
        task = asyncio.create_task(gatekeeper._loop(memo, preflights, stop))  # type: ignore[arg-type]
        for _ in range(int(seconds / 0.05)):
            memo[f"{gatekeeper.NAME}_wake"].set()  # pod events: a pass each, if it leads
            await asyncio.sleep(0.05)
        stop.set()
        await task

    asyncio.run(scenario())


def test_the_preflight_passes_run_only_where_the_replica_leads() -> None:
    api = Status({ME: entry(5, now()), OTHER: entry(9, now())})
    follower, preflights = CountingPreflights(), CountingPreflights()
    run_loop_for(kopf.Memo(leadership=Leadership(api, "epguard", ME, 5)), follower, 0.5)
    assert follower.passes == 0 and api.reads >= 1
    run_loop_for(kopf.Memo(leadership=Leadership(api, "epguard", OTHER, 9)), preflights, 0.5)
    assert preflights.passes >= 2


def test_the_backstop_writer_syncs_only_where_the_replica_leads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    syncs: list[str] = []

    def sync(api: Any, state: backstop.BackstopState, at: dt.datetime) -> Any:
        syncs.append("sync")
        raise ConnectionError("not needed here")

    monkeypatch.setattr(backstop, "sync_once", sync)
    monkeypatch.setattr(backstop, "FOLLOWER_POLL", 0.05)
    api, clock = Status({ME: entry(5, now()), OTHER: entry(9, now())}), Ticks()
    leadership = Leadership(api, "epguard", ME, 5, clock=clock)

    async def scenario() -> None:
        state = backstop.BackstopState(
            config=BackstopConfig(params_namespace="epguard-system"),
            rules_configmap="epguard-rules",
            rules_key="rules.yaml",
            tag_ttl=dt.timedelta(days=1),
        )
        task = asyncio.create_task(backstop.run_writer(None, state, leadership))  # type: ignore[arg-type]
        await asyncio.sleep(0.3)
        assert syncs == [] and api.reads == 1  # asked, cached, never synced
        api.status = {ME: entry(5, now())}  # the other replica is gone
        clock.t += REFRESH_SECONDS
        for _ in range(40):
            await asyncio.sleep(0.05)
            if syncs:
                break
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert syncs, "the writer did not sync once it led"
