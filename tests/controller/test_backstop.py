"""The backstop's read of the ImageVerdicts (webhook/controller/backstop.py
``read_verdicts``): every verdict, a page at a time, past the webhook's own cap.

The API here is a test double: an in-memory list that pages as the API server does
(``limit``/``continue``, raw JSON bodies). The real API server reads 1,000 real
ImageVerdicts through the same code in tests/e2e/test_backstop_scale.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
from typing import Any

import pytest

from epguard.webhook.controller import backstop
from epguard.webhook.controller.compiler import BackstopConfig, compile_params
from epguard.webhook.engine.verdicts import MAX_VERDICTS, VerdictStore

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
TTL = dt.timedelta(hours=24)


def verdict(i: int) -> dict[str, Any]:
    digest = "sha256:" + f"{i:016x}" * 4
    return {
        "metadata": {"name": digest.replace(":", "-"), "resourceVersion": str(1000 + i)},
        "spec": {
            "image": f"registry.example.com/team-{i % 100}/sglang:b{i}",
            "digest": digest,
            "verdict": "Unusable",
            "reason": f"libcudart.so.12 is missing (build {i % 7})",
            "pod": "ml/sglang-0",
            "lastSeen": (NOW - dt.timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    }


class _Response:
    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()


class PagedList:
    """``list_cluster_custom_object`` over ``objects``, in pages as the API server
    serves them; counts the pages asked for."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = objects
        self.pages = 0

    def __call__(self, _api: Any) -> PagedList:  # stands in for client.CustomObjectsApi
        return self

    def list_cluster_custom_object(self, *_: Any, **kw: Any) -> _Response:
        self.pages += 1
        start = int(kw.get("_continue") or 0)
        end = start + int(kw["limit"])
        more = end < len(self.objects)
        meta = {"resourceVersion": "77", **({"continue": str(end)} if more else {})}
        return _Response({"items": self.objects[start:end], "metadata": meta})


def test_every_verdict_past_the_webhooks_cap_is_read_and_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = MAX_VERDICTS + 10_000
    listing = PagedList([verdict(i) for i in range(n)])
    monkeypatch.setattr(backstop.client, "CustomObjectsApi", listing)
    index, fingerprint = backstop.read_verdicts(object(), TTL, NOW)  # type: ignore[arg-type]
    assert index.verdicts == n
    params = compile_params(index, NOW)
    # One digest and one tag entry per verdict, none dropped.
    assert (params.kept, params.dropped) == (2 * n, 0)
    held = sum(len(s["d"]) + sum(len(t) for t in s["t"].values()) for s in params.shards)
    assert held == 2 * n
    # The same objects give the same fingerprint; a changed resourceVersion another.
    _, same = backstop.read_verdicts(object(), TTL, NOW)  # type: ignore[arg-type]
    assert same == fingerprint
    listing.objects[-1]["metadata"]["resourceVersion"] = "changed"
    assert backstop.read_verdicts(object(), TTL, NOW)[1] != fingerprint  # type: ignore[arg-type]


def test_past_its_own_cap_the_backstop_stops_reading_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    listing = PagedList([verdict(i) for i in range(2_600)])
    monkeypatch.setattr(backstop.client, "CustomObjectsApi", listing)
    monkeypatch.setattr(backstop, "MAX_BACKSTOP_VERDICTS", 1_000)
    with caplog.at_level(logging.WARNING, logger="epguard.controller.backstop"):
        index, _ = backstop.read_verdicts(object(), TTL, NOW)  # type: ignore[arg-type]
    assert index.verdicts == 1_000 and listing.pages == 2  # pages of 500: no third page read
    assert "more than 1000 ImageVerdicts" in caplog.text


def _writer_state() -> backstop.BackstopState:
    return backstop.BackstopState(
        config=BackstopConfig(params_namespace="epguard-system"),
        rules_configmap="epguard-rules",
        rules_key="rules.yaml",
        tag_ttl=dt.timedelta(days=1),
    )


def _no_verdicts(*_: Any) -> tuple[Any, str]:
    """read_verdicts' answer for an API server that holds no ImageVerdict."""
    return backstop.EntryIndex(dt.timedelta(days=1), dt.datetime.now(dt.UTC)), "-"


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_the_writer_polls_and_rests_at_least_twice_as_long_as_a_sync_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer's pace: a sync every POLL seconds, but never sooner than PACE times the
    last sync's list of the ImageVerdicts took after it (100,000 verdicts take seconds
    of the API server's time). sync_once is replaced: the writer's loop is what is
    tested; the fake says how long its list took, as the real one does."""
    monkeypatch.setattr(backstop, "POLL", 0.2)
    calls: list[float] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        third = asyncio.Event()

        def sync(api: Any, st: backstop.BackstopState, now: dt.datetime) -> Any:
            calls.append(time.monotonic())
            st.list_seconds = 0.0
            if len(calls) == 1:
                time.sleep(1.0)  # a slow list: the next sync no sooner than 2 s after it
                st.list_seconds = 1.0
            elif len(calls) == 3:
                loop.call_soon_threadsafe(third.set)
            return compile_params(VerdictStore(), now)

        monkeypatch.setattr(backstop, "sync_once", sync)
        task = asyncio.create_task(backstop.run_writer(None, _writer_state()))  # type: ignore[arg-type]
        await asyncio.wait_for(third.wait(), 20)
        await _cancelled(task)

    asyncio.run(scenario())
    assert calls[1] - calls[0] >= 1.0 + backstop.PACE * 1.0 - 0.1, calls
    assert calls[2] - calls[1] < 1.5, calls  # a quick sync: the next at the poll


def test_a_slow_install_or_write_does_not_hold_the_next_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pace is the list's, not the whole sync's: a first sync that spent 1.5 s
    installing the policy (12 s on the loaded node, then a rules change made meanwhile
    waited 30 s for the next sync) with a quick list is followed at the poll. The real
    sync_once runs, on a fake API whose policy install is slow."""
    monkeypatch.setattr(backstop, "POLL", 0.2)
    calls: list[float] = []
    installs: list[float] = []

    def slow_install(
        api: Any, config: BackstopConfig, owner: Any, rules: Any = None
    ) -> list[dict[str, Any]]:
        installs.append(time.monotonic())
        if len(installs) == 1:
            time.sleep(1.5)
        return backstop.policies(config, rules)

    def read_verdicts(*_: Any) -> tuple[Any, str]:
        calls.append(time.monotonic())
        return _no_verdicts()

    monkeypatch.setattr(backstop, "install", slow_install)
    monkeypatch.setattr(backstop, "read_verdicts", read_verdicts)
    monkeypatch.setattr(backstop, "read_rules", lambda api, st: st.rules)
    monkeypatch.setattr(backstop, "write_params", lambda *a: {})

    async def scenario() -> None:
        task = asyncio.create_task(backstop.run_writer(None, _writer_state()))  # type: ignore[arg-type]
        while len(calls) < 2:
            await asyncio.sleep(0.05)
        await _cancelled(task)

    asyncio.run(asyncio.wait_for(scenario(), 20))
    # The sync with the 1.5 s install ended at calls[0]; the next came at the poll, not
    # PACE x 1.5 s = 3 s later.
    assert calls[1] - calls[0] < 1.5, calls


def test_a_verdict_change_wakes_the_writer_before_the_poll_but_never_before_its_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``changed`` (set by the ImageVerdict watch) brings the next sync as soon as the pace
    allows, instead of at the poll; a change during a sync brings one more."""
    monkeypatch.setattr(backstop, "POLL", 30.0)
    calls: list[float] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        done = asyncio.Event()

        def sync(api: Any, st: backstop.BackstopState, now: dt.datetime) -> Any:
            calls.append(time.monotonic())
            st.list_seconds = 0.0
            if len(calls) == 1:
                time.sleep(0.5)  # a slow list, and a change while it runs
                st.list_seconds = 0.5
                loop.call_soon_threadsafe(changed.set)
            elif len(calls) == 3:
                loop.call_soon_threadsafe(done.set)
            return compile_params(VerdictStore(), now)

        monkeypatch.setattr(backstop, "sync_once", sync)
        task = asyncio.create_task(
            backstop.run_writer(None, _writer_state(), changed=changed)  # type: ignore[arg-type]
        )
        await asyncio.sleep(2.0)
        assert len(calls) == 2, calls  # the change during sync 1; nothing since
        changed.set()
        await asyncio.wait_for(done.wait(), 5)
        await _cancelled(task)

    asyncio.run(scenario())
    # Woken during the slow sync: the next after its rest (PACE x 0.5 s), not at the poll.
    assert 0.5 + backstop.PACE * 0.5 - 0.1 <= calls[1] - calls[0] < 3.0, calls
    assert calls[2] - calls[0] < 4.0, calls  # woken again: far sooner than POLL (30 s)


def test_a_replace_that_loses_to_a_status_write_is_read_again_and_retried() -> None:
    """The kube-controller-manager writes a new generation's status ~12 s after it: a
    rules change's replace read before that write got a 409, and the backstop followed
    the rule a whole sync later (CI, bb66800)."""
    from types import SimpleNamespace

    from kubernetes.client.exceptions import ApiException

    reads: list[str] = []
    replaced: list[str] = []
    conflicts = [2]

    def read(name: str) -> Any:
        reads.append(str(len(reads) + 1))
        return SimpleNamespace(metadata=SimpleNamespace(resource_version=reads[-1]))

    def replace(name: str, obj: dict[str, Any]) -> None:
        replaced.append(obj["metadata"]["resourceVersion"])
        if conflicts[0] > 0:
            conflicts[0] -= 1
            raise ApiException(status=409, reason="Conflict")

    def create(obj: dict[str, Any]) -> None:
        raise AssertionError("it exists")

    backstop._put(read, create, replace, {"metadata": {"name": "epguard-backstop"}})
    assert replaced == ["1", "2", "3"]  # each replace at the version read just before
    # A conflict every time still reaches the sync's own retry, after PUT_ATTEMPTS.
    conflicts[0] = 1_000
    replaced.clear()
    with pytest.raises(ApiException):
        backstop._put(read, create, replace, {"metadata": {"name": "x"}})
    assert len(replaced) == backstop.PUT_ATTEMPTS


def test_the_start_installs_the_live_rules_so_the_first_sync_installs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each write of the policy has the API server compile its CEL (seconds of a core on
    the loaded node): installed first without the rules, the policy was written again by
    the first sync. The real start and sync_once run on fakes of the API's reads."""
    from types import SimpleNamespace

    from epguard.webhook.engine.rules import load_rules_text

    rules = load_rules_text(
        "rules:\n- {id: bad-0516, image: 'lmsysorg/sglang:v0.5.16*', action: deny,\n"
        "   reason: no ep_2_11_0 extension, remedy: use v0.5.18}\n",
        "configmap epguard-system/epguard-rules",
    )
    installed: list[Any] = []

    def install(api: Any, config: BackstopConfig, owner: Any, rules: Any = None) -> Any:
        installed.append(rules)
        return backstop.policies(config, rules)

    monkeypatch.setattr(backstop, "server_supported", lambda api: (True, "v1.35.4"))
    monkeypatch.setattr(backstop, "owner_of", lambda api, name: None)
    monkeypatch.setattr(backstop, "read_rules", lambda api, st: rules)
    monkeypatch.setattr(backstop, "install", install)
    monkeypatch.setattr(backstop, "read_verdicts", _no_verdicts)
    monkeypatch.setattr(backstop, "write_params", lambda *a: {})
    config = SimpleNamespace(
        backstop=BackstopConfig(params_namespace="epguard-system"),
        namespace="epguard-system",
        backstop_name="epguard-backstop",
        validating_webhook="epguard",
        rules_configmap="epguard-rules",
        rules_key="rules.yaml",
        tag_ttl=dt.timedelta(days=1),
    )
    state = asyncio.run(backstop.start(None, config))  # type: ignore[arg-type]
    assert state is not None and installed == [rules]
    backstop.sync_once(None, state, dt.datetime.now(dt.UTC))  # type: ignore[arg-type]
    assert installed == [rules]


def test_a_create_that_loses_to_another_replicas_create_replaces_it() -> None:
    """Both controller replicas install the backstop at start: the create that lost got a
    409 and failed the whole start, which began again 2 s later (one more install, ~12 s
    of the loaded node's API server)."""
    from types import SimpleNamespace

    from kubernetes.client.exceptions import ApiException

    stored: dict[str, Any] = {}
    calls: list[str] = []

    def read(name: str) -> Any:
        calls.append("read")
        if name not in stored:
            raise ApiException(status=404, reason="Not Found")
        return SimpleNamespace(metadata=SimpleNamespace(resource_version="7"))

    def create(obj: dict[str, Any]) -> None:
        calls.append("create")
        stored[obj["metadata"]["name"]] = {"by": "the other replica"}
        raise ApiException(status=409, reason="AlreadyExists")

    def replace(name: str, obj: dict[str, Any]) -> None:
        calls.append("replace")
        stored[name] = obj

    obj: dict[str, Any] = {"metadata": {"name": "epguard-backstop"}, "spec": {}}
    backstop._put(read, create, replace, obj)
    assert calls == ["read", "create", "read", "replace"]
    assert stored["epguard-backstop"] is obj and obj["metadata"]["resourceVersion"] == "7"


def test_a_replica_that_takes_over_installs_what_the_rules_say_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a replica installed at its own start may have been replaced by the leader
    since (rules B, then back to A, the leader gone before its sync): on taking over it
    installs again instead of trusting its start's write."""
    from types import SimpleNamespace

    monkeypatch.setattr(backstop, "POLL", 0.05)
    monkeypatch.setattr(backstop, "FOLLOWER_POLL", 0.05)
    installs: list[Any] = []

    def install(api: Any, config: BackstopConfig, owner: Any, rules: Any = None) -> Any:
        installs.append(rules)
        return backstop.policies(config, rules)

    monkeypatch.setattr(backstop, "install", install)
    monkeypatch.setattr(backstop, "read_rules", lambda api, st: st.rules)
    monkeypatch.setattr(backstop, "read_verdicts", _no_verdicts)
    monkeypatch.setattr(backstop, "write_params", lambda *a: {})
    state = _writer_state()
    state.installed = backstop.policies(state.config, state.rules)  # its start's write
    asks = iter([False, False, True, True, True])
    leadership = SimpleNamespace(leads=lambda: next(asks, True))

    async def scenario() -> None:
        task = asyncio.create_task(backstop.run_writer(None, state, leadership))  # type: ignore[arg-type]
        for _ in range(100):
            if state.written is not None:
                break
            await asyncio.sleep(0.05)
        await _cancelled(task)

    asyncio.run(scenario())
    assert len(installs) == 1, installs
