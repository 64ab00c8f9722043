"""The watch logic without a cluster: live rules keep the last good set, namespaces and
verdicts follow events, and the watch loop relists after a failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from webhook.metrics import Metrics
from webhook.namespaces import NamespaceIndex
from webhook.rules import RulesHolder, load_rules_text
from webhook.verdicts import VerdictStore
from webhook.watch import NamespaceSync, RulesConfigMapSync, Source, VerdictSync, run_watch

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


class FlakySource:
    """Lists, then fails its first watch; the second connection streams two events."""

    def __init__(self) -> None:
        self.lists = 0
        self.watches = 0
        self.done = asyncio.Event()

    async def list(self) -> AsyncIterator[Mapping[str, Any]]:
        self.lists += 1
        yield ns("a", **{"epguard.io/mode": "warn"})

    async def watch(self) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        self.watches += 1
        if self.watches == 1:
            raise ConnectionError("apiserver went away")
        yield "ADDED", ns("b", **{"epguard.io/mode": "audit"})
        yield "DELETED", ns("a")
        self.done.set()
        await asyncio.Event().wait()  # stay connected


async def test_watch_loop_relists_and_resumes_after_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_sleep = asyncio.sleep

    async def fast_sleep(delay: float) -> None:
        await real_sleep(0)

    monkeypatch.setattr("webhook.watch.asyncio.sleep", fast_sleep)
    index = NamespaceIndex()
    metrics = Metrics()
    src = FlakySource()
    task = asyncio.create_task(
        run_watch(NamespaceSync(index), Source(src.list, src.watch), metrics)
    )
    await asyncio.wait_for(src.done.wait(), timeout=10)
    assert src.lists == 2 and src.watches == 2
    assert index.get("a").mode is None and index.get("b").mode == "audit"
    assert sample(metrics, "epguard_watch_up", resource="namespace") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sample(metrics, "epguard_watch_up", resource="namespace") == 0
