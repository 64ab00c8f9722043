"""The watch logic without a cluster: live rules keep the last good set, namespaces and
verdicts follow events, and the watch loop lists once, resumes from the last
resourceVersion after a drop and lists again only on 410 Gone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from epguard.webhook.cluster.watch import (
    NamespaceSync,
    RulesConfigMapSync,
    Source,
    VerdictSync,
    run_watch,
)
from epguard.webhook.engine.namespaces import NamespaceIndex
from epguard.webhook.engine.rules import RulesHolder, load_rules_text
from epguard.webhook.engine.verdicts import VerdictStore
from epguard.webhook.metrics import Metrics

FILE_RULES = "rules:\n  - {id: from-file, image: 'x/y:*', reason: r, remedy: m}\n"
CM_RULES = "rules:\n  - {id: from-cm, image: 'x/z:*', reason: r, remedy: m}\n"


def configmap(text: str | None, name: str = "epguard-rules") -> dict[str, Any]:
    data = {} if text is None else {"rules.yaml": text}
    return {"metadata": {"name": name, "namespace": "epguard-system"}, "data": data}


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


@pytest.fixture
def rules_sync() -> RulesConfigMapSync:
    holder = RulesHolder(load_rules_text(FILE_RULES, "file"))
    return RulesConfigMapSync(holder, "epguard-system", "epguard-rules", "rules.yaml", Metrics())


def ids(sync: RulesConfigMapSync) -> list[str]:
    return [r.id for r in sync.holder.current.rules]


def test_configmap_rules_replace_the_file_rules(rules_sync: RulesConfigMapSync) -> None:
    rules_sync.replace([configmap(CM_RULES)])
    assert ids(rules_sync) == ["from-cm"]
    assert sample(rules_sync.metrics, "epguard_rules_loaded", source="configmap") == 1


def test_a_bad_edit_keeps_the_last_good_rules_and_is_counted(
    rules_sync: RulesConfigMapSync,
) -> None:
    rules_sync.event("ADDED", configmap(CM_RULES))
    rules_sync.event(
        "MODIFIED", configmap(CM_RULES + "  - {id: from-cm, image: a, reason: r, remedy: m}\n")
    )
    assert ids(rules_sync) == ["from-cm"]
    assert "duplicate rule id 'from-cm'" in (rules_sync.last_error or "")
    assert (
        sample(
            rules_sync.metrics, "epguard_rules_reloads_total", source="configmap", result="rejected"
        )
        == 1
    )
    rules_sync.event("MODIFIED", configmap("rules: [\n"))
    assert ids(rules_sync) == ["from-cm"]
    rules_sync.event("MODIFIED", configmap("rules: []"))
    assert ids(rules_sync) == [] and rules_sync.last_error is None


def test_deleting_the_configmap_falls_back_to_the_file(rules_sync: RulesConfigMapSync) -> None:
    rules_sync.event("ADDED", configmap(CM_RULES))
    rules_sync.event("DELETED", configmap(CM_RULES))
    assert ids(rules_sync) == ["from-file"]


def test_a_configmap_without_the_key_falls_back_to_the_file(rules_sync: RulesConfigMapSync) -> None:
    rules_sync.replace([configmap(CM_RULES)])
    rules_sync.event("MODIFIED", configmap(None))
    assert ids(rules_sync) == ["from-file"]


def test_other_configmaps_are_ignored(rules_sync: RulesConfigMapSync) -> None:
    rules_sync.event("ADDED", configmap(CM_RULES, name="something-else"))
    assert ids(rules_sync) == ["from-file"]
    rules_sync.replace([configmap(CM_RULES, name="something-else")])
    assert ids(rules_sync) == ["from-file"]


def ns(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


def test_namespace_labels_follow_events() -> None:
    index = NamespaceIndex()
    sync = NamespaceSync(index)
    sync.replace([ns("a", **{"epguard.io/mode": "warn"}), ns("b"), {"metadata": None}])
    assert index.get("a").mode == "warn" and index.get("b").mode is None
    sync.event("MODIFIED", ns("a", **{"epguard.io/mode": "audit", "epguard.io/inject": "enabled"}))
    assert index.get("a").mode == "audit" and index.get("a").inject
    sync.event("MODIFIED", ns("a"))
    assert index.get("a").mode is None and len(index) == 0
    sync.event("ADDED", ns("c", **{"epguard.io/mode": "warn"}))
    sync.event("DELETED", ns("c"))
    assert index.get("c").mode is None


def test_relisting_forgets_namespaces_deleted_while_disconnected() -> None:
    index = NamespaceIndex()
    sync = NamespaceSync(index)
    sync.replace([ns("gone", **{"epguard.io/mode": "warn"})])
    sync.replace([])
    assert index.get("gone").mode is None


def verdict(name: str, verdict: str = "Unusable") -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "image": f"r.io/{name}:v1",
            "verdict": verdict,
            "reason": "x",
            "lastSeen": "2026-11-30T00:00:00Z",
        },
    }


def test_verdicts_follow_events() -> None:
    metrics = Metrics()
    store = VerdictStore()
    sync = VerdictSync(store, metrics)
    sync.replace([verdict("a"), verdict("b"), {"junk": 1}])
    assert len(store) == 2 and sample(metrics, "epguard_verdicts_loaded") == 2
    sync.event("DELETED", verdict("a"))
    sync.event("MODIFIED", verdict("b", verdict="nonsense"))  # unusable now: dropped
    assert len(store) == 0


def ns_at(name: str, rv: str, **labels: str) -> dict[str, Any]:
    obj = ns(name, **labels)
    obj["metadata"]["resourceVersion"] = rv
    return obj


class ScriptedSource:
    """A Source whose watch calls follow a script: each entry is what one call does, a
    list of events to stream or an exception to raise. Records every call, so a test
    sees what the loop listed and from which resourceVersion it watched. Blocking, like
    the real client's: run_watch runs it on a thread."""

    def __init__(self, listing: list[dict[str, Any]], rv: str, script: list[Any]) -> None:
        self.listing, self.rv, self.script = listing, rv, list(script)
        self.lists = 0
        self.watched_from: list[str] = []
        self.done = threading.Event()

    def list(self) -> tuple[list[Mapping[str, Any]], str]:
        self.lists += 1
        return list(self.listing), self.rv

    def watch(self, rv: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        self.watched_from.append(rv)
        if not self.script:
            self.done.set()
            threading.Event().wait(5)  # stay connected, quietly
            return
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        yield from step


async def _run_until_done(src: ScriptedSource, sync: Any, metrics: Metrics) -> None:
    task = asyncio.create_task(run_watch(sync, Source(src.list, src.watch), metrics))
    try:
        await asyncio.wait_for(asyncio.to_thread(src.done.wait, 10), timeout=15)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    real_sleep = asyncio.sleep

    async def fast_sleep(delay: float) -> None:
        await real_sleep(0)

    monkeypatch.setattr("epguard.webhook.cluster.watch.asyncio.sleep", fast_sleep)


async def test_a_dropped_watch_resumes_from_the_last_resource_version_without_listing_again() -> (
    None
):
    index = NamespaceIndex()
    src = ScriptedSource(
        [ns_at("a", "10", **{"epguard.io/mode": "warn"})],
        "10",
        [
            [("ADDED", ns_at("b", "11", **{"epguard.io/mode": "audit"}))],  # then ends
            ConnectionError("apiserver went away"),
            [("BOOKMARK", {"metadata": {"resourceVersion": "15"}}), ("DELETED", ns_at("a", "16"))],
        ],
    )
    await _run_until_done(src, NamespaceSync(index), Metrics())
    assert src.lists == 1
    assert src.watched_from == ["10", "11", "11", "16"]
    assert index.get("a").mode is None and index.get("b").mode == "audit"


async def test_a_gone_resource_version_lists_and_replaces_again() -> None:
    index = NamespaceIndex()
    src = ScriptedSource(
        [ns_at("a", "10", **{"epguard.io/mode": "warn"})],
        "10",
        [[("ADDED", ns_at("b", "11", **{"epguard.io/mode": "audit"}))], ApiException(status=410)],
    )

    # After the 410 the list no longer holds "a": the replace forgets it, though no
    # DELETED event for it was ever seen.
    def relist() -> tuple[list[Mapping[str, Any]], str]:
        src.lists += 1
        if src.lists == 1:
            return [ns_at("a", "10", **{"epguard.io/mode": "warn"})], "10"
        return [ns_at("b", "30", **{"epguard.io/mode": "audit"})], "30"

    src.list = relist  # type: ignore[method-assign]
    metrics = Metrics()
    await _run_until_done(src, NamespaceSync(index), metrics)
    assert src.lists == 2
    assert src.watched_from == ["10", "11", "30"]
    assert index.get("a").mode is None and index.get("b").mode == "audit"


async def test_a_failing_list_backs_off_and_reports_the_watch_down() -> None:
    metrics = Metrics()
    calls = 0

    def failing() -> tuple[list[Mapping[str, Any]], str]:
        nonlocal calls
        calls += 1
        raise ConnectionError("refused")

    def never(rv: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        raise AssertionError("watched without a list")

    task = asyncio.create_task(
        run_watch(NamespaceSync(NamespaceIndex()), Source(failing, never), metrics)
    )
    for _ in range(200):
        await asyncio.sleep(0.01)
        if calls >= 3:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls >= 3
    assert sample(metrics, "epguard_watch_up", resource="namespace") == 0


async def test_a_listing_whose_replace_failed_is_listed_again_not_watched_from() -> None:
    # Its resourceVersion was kept before the replace: the next round watched from it and
    # the listing's objects were never applied.
    index = NamespaceIndex()
    src = ScriptedSource([ns_at("a", "10", **{"epguard.io/mode": "warn"})], "10", [])

    class Flaky(NamespaceSync):
        failed = False

        def replace(self, objects: Any) -> None:
            if not self.failed:
                self.failed = True
                raise RuntimeError("a bug while applying")
            super().replace(objects)

    await _run_until_done(src, Flaky(index), Metrics())
    assert src.lists == 2 and src.watched_from == ["10"]
    assert index.get("a").mode == "warn"
