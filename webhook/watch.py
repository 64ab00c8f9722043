"""Background watches that keep the in-memory state current: the rules
ConfigMap, Namespace labels, and learned ImageVerdicts.

Each watch is list-then-watch in a loop: a (re)connect first lists and
*replaces* the state (so deletions missed while disconnected are not kept),
then applies events; any error backs off (1 s doubling to 30 s, with jitter)
and starts over. The ``*Sync`` classes hold the parsing and updating logic and
do no I/O, so they are unit-tested without a cluster; ``run_watch`` is the only
part that needs an API server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from webhook.metrics import Metrics
from webhook.namespaces import MODE_LABEL, NamespaceIndex
from webhook.rules import RulesError, RulesHolder, load_rules_text
from webhook.verdicts import VerdictStore, image_verdict_resource, verdict_from_object

log = logging.getLogger("epguard.watch")


def _meta_name(obj: Any) -> str | None:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else None


class Sync(Protocol):
    resource: str

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> None: ...

    def event(self, kind: str, obj: Mapping[str, Any]) -> None: ...


class RulesConfigMapSync:
    """The live rules: ``data[key]`` of one ConfigMap. A bad edit keeps the last good rules."""

    resource = "configmap"

    def __init__(
        self, holder: RulesHolder, namespace: str, name: str, key: str, metrics: Metrics
    ) -> None:
        self.holder = holder
        self.namespace = namespace
        self.name = name
        self.key = key
        self.metrics = metrics
        self.last_error: str | None = None

    @property
    def source(self) -> str:
        return f"configmap {self.namespace}/{self.name} key {self.key}"

    def _apply(self, obj: Mapping[str, Any] | None) -> None:
        if obj is None:
            if self.holder.live_rules is not None:
                log.warning(
                    "%s is gone: back to the rules file %s",
                    self.source,
                    self.holder.file_rules.source,
                )
            self.holder.set_live(None)
            self.metrics.rules_loaded.labels("configmap").set(0)
            return
        data = obj.get("data")
        text = data.get(self.key) if isinstance(data, Mapping) else None
        if not isinstance(text, str):
            log.warning(
                "%s has no key %r: using the rules file %s",
                self.source,
                self.key,
                self.holder.file_rules.source,
            )
            self.holder.set_live(None)
            self.metrics.rules_loaded.labels("configmap").set(0)
            return
        try:
            rules = load_rules_text(text, self.source)
        except RulesError as exc:
            self.last_error = str(exc)
            self.metrics.rules_reloads.labels("configmap", "rejected").inc()
            kept = self.holder.current
            log.error(
                "rejected a rules edit, keeping the last good rules (%d from %s): %s",
                len(kept),
                kept.source,
                exc,
            )
            return
        self.last_error = None
        self.holder.set_live(rules)
        self.metrics.rules_reloads.labels("configmap", "ok").inc()
        self.metrics.rules_loaded.labels("configmap").set(len(rules))
        log.info("rules loaded from %s: %d rule(s)", self.source, len(rules))

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> None:
        ours = [o for o in objects if _meta_name(o) == self.name]
        self._apply(ours[0] if ours else None)

    def event(self, kind: str, obj: Mapping[str, Any]) -> None:
        if _meta_name(obj) != self.name:
            return
        self._apply(None if kind == "DELETED" else obj)


class NamespaceSync:
    resource = "namespace"

    def __init__(self, index: NamespaceIndex) -> None:
        self.index = index

    @staticmethod
    def _labels(obj: Mapping[str, Any]) -> Any:
        meta = obj.get("metadata")
        return meta.get("labels") if isinstance(meta, Mapping) else None

    def _note(self, name: str, labels: Any) -> None:
        s = self.index.upsert(name, labels)
        if s.bad_mode is not None:
            log.warning(
                "namespace %s: label %s=%r is not enforce|warn|audit; ignored",
                name,
                MODE_LABEL,
                s.bad_mode,
            )

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> None:
        objs = [(n, self._labels(o)) for o in objects if (n := _meta_name(o)) is not None]
        self.index.replace(dict(objs))
        for name, labels in objs:
            self._note(name, labels)

    def event(self, kind: str, obj: Mapping[str, Any]) -> None:
        name = _meta_name(obj)
        if name is None:
            return
        if kind == "DELETED":
            self.index.delete(name)
        else:
            self._note(name, self._labels(obj))


class VerdictSync:
    resource = "imageverdict"

    def __init__(self, store: VerdictStore, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> None:
        self.store.replace(v for o in objects if (v := verdict_from_object(o)) is not None)
        self._count()

    def event(self, kind: str, obj: Mapping[str, Any]) -> None:
        name = _meta_name(obj)
        if name is None:
            return
        verdict = None if kind == "DELETED" else verdict_from_object(obj)
        if verdict is None:
            self.store.delete(name)
        elif not self.store.upsert(verdict):
            log.warning(
                "ImageVerdict %s not held: the store is full (%d); see epguard_verdicts_dropped",
                name,
                self.store.cap,
            )
        self._count()

    def _count(self) -> None:
        self.metrics.verdicts_loaded.set(len(self.store))
        self.metrics.verdicts_dropped.set(self.store.dropped)


@dataclass
class Source:
    """How to list and watch one resource; returns plain dicts."""

    list: Callable[[], AsyncIterator[Mapping[str, Any]]]
    watch: Callable[[], AsyncIterator[tuple[str, Mapping[str, Any]]]]


def _as_dict(obj: Any) -> Mapping[str, Any]:
    to_dict = getattr(obj, "to_dict", None)
    result = to_dict() if callable(to_dict) else obj
    return result if isinstance(result, Mapping) else {}


async def run_watch(
    sync: Sync, source: Source, metrics: Metrics, max_backoff: float = 30.0
) -> None:
    delay = 1.0
    while True:
        try:
            objects = [o async for o in source.list()]
            sync.replace(objects)
            metrics.watch_up.labels(sync.resource).set(1)
            log.info("watching %s (%d listed)", sync.resource, len(objects))
            delay = 1.0
            async for kind, obj in source.watch():
                sync.event(kind, obj)
                metrics.watch_events.labels(sync.resource).inc()
            log.info("watch on %s ended; reconnecting", sync.resource)
        except asyncio.CancelledError:
            metrics.watch_up.labels(sync.resource).set(0)
            raise
        except Exception as exc:
            log.warning(
                "watch on %s failed (%s: %s); retrying in %.0fs",
                sync.resource,
                type(exc).__name__,
                exc,
                delay,
            )
        metrics.watch_up.labels(sync.resource).set(0)
        await asyncio.sleep(delay * (1 + random.random() / 4))
        delay = min(delay * 2, max_backoff)


def kube_config(explicit: str | None) -> Any | None:
    """A lightkube KubeConfig from EPGUARD_KUBECONFIG, the pod's service account, or
    $KUBECONFIG, in that order; None when there are no credentials (not ~/.kube/config:
    a webhook run by hand must not silently watch whatever cluster that points at)."""
    from lightkube import ConfigError, KubeConfig

    if explicit:
        return KubeConfig.from_file(explicit)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            return KubeConfig.from_service_account()
        except ConfigError:
            pass
    env_path = os.environ.get("KUBECONFIG")
    if env_path and os.path.exists(env_path.split(os.pathsep)[0]):
        return KubeConfig.from_file(env_path.split(os.pathsep)[0])
    return None


def lightkube_sources(config: Any, namespace: str, configmap: str) -> dict[str, Source]:
    """The three sources, over one lightkube AsyncClient."""
    from lightkube import AsyncClient
    from lightkube.resources.core_v1 import ConfigMap, Namespace

    client = AsyncClient(config=config, field_manager="epguard-webhook")
    ImageVerdict = image_verdict_resource()
    cm_fields = {"metadata.name": configmap}

    def listing(res: Any, **kw: Any) -> Callable[[], AsyncIterator[Mapping[str, Any]]]:
        async def gen() -> AsyncIterator[Mapping[str, Any]]:
            async for o in client.list(res, **kw):
                yield _as_dict(o)

        return gen

    def watching(res: Any, **kw: Any) -> Callable[[], AsyncIterator[tuple[str, Mapping[str, Any]]]]:
        async def gen() -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
            async for kind, o in client.watch(res, **kw):
                yield kind, _as_dict(o)

        return gen

    return {
        "configmap": Source(
            listing(ConfigMap, namespace=namespace, fields=cm_fields),
            watching(ConfigMap, namespace=namespace, fields=cm_fields),
        ),
        "namespace": Source(listing(Namespace), watching(Namespace)),
        "imageverdict": Source(listing(ImageVerdict), watching(ImageVerdict)),
    }
