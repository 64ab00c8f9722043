"""Background watches that keep the in-memory state current: the rules
ConfigMap, the probe-signing key Secret, Namespace labels, and learned ImageVerdicts.

Each watch lists once and *replaces* the state, then watches from the list's
resourceVersion (a watch request of the official client, its lines read here), in a
thread feeding the event loop. A dropped watch resumes from the last resourceVersion seen, so a
reconnect replays nothing; only ``410 Gone`` (the version fell out of etcd's
window) lists and replaces again, so deletions missed meanwhile are not kept. Errors
back off (1 s doubling to 30 s, with jitter). The ``*Sync`` classes hold the parsing
and updating logic and do no I/O, so they are unit-tested without a cluster;
``run_watch`` and ``kube_sources`` are the only parts that need an API server.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol, TypeVar

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from epguard.webhook.cluster.kube import (
    REQUEST_TIMEOUT,
    list_all,
    meta,
    snapshot_version,
    status_of,
)
from epguard.webhook.engine.namespaces import MODE_LABEL, NamespaceIndex
from epguard.webhook.engine.rules import (
    RulesError,
    RuleSet,
    RulesHolder,
    load_rules_text,
    rule_warnings,
)
from epguard.webhook.engine.signing import KeyringError, KeyringHolder, keyring_from_secret
from epguard.webhook.engine.verdicts import (
    GROUP,
    PLURAL,
    VERSION,
    VerdictStore,
    slim_verdict_object,
    verdict_from_object,
)
from epguard.webhook.metrics import Metrics

log = logging.getLogger("epguard.watch")


def _meta_name(obj: Any) -> str | None:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else None


# (reason, message, warning): an Event on the rules ConfigMap.
Notify = Callable[[str, str, bool], None]


def report_warnings(rules: RuleSet, source: str, metrics: Metrics) -> list[str]:
    """Rules that load but refuse nothing (rules.rule_warnings): logged and counted under
    ``source`` (file or configmap); returned for whoever tells the admin more."""
    warnings = rule_warnings(rules)
    metrics.rules_warnings.labels(source).set(len(warnings))
    for w in warnings:
        log.warning("%s", w)
    return warnings


class Sync(Protocol):
    resource: str
    off_loop: bool

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> None: ...

    def event(self, kind: str, obj: Mapping[str, Any]) -> None: ...


class OneObjectSync:
    """A sync of one object, by name: the list and every event come down to "this is the
    object now" (``_apply(obj)``) or "it is gone" (``_apply(None)``)."""

    name: str

    def _apply(self, obj: Mapping[str, Any] | None) -> None:
        raise NotImplementedError

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> None:
        ours = [o for o in objects if _meta_name(o) == self.name]
        self._apply(ours[0] if ours else None)

    def event(self, kind: str, obj: Mapping[str, Any]) -> None:
        if _meta_name(obj) == self.name:
            self._apply(None if kind == "DELETED" else obj)


class RulesConfigMapSync(OneObjectSync):
    """The live rules: ``data[key]`` of one ConfigMap. A bad edit keeps the last good rules."""

    resource = "configmap"
    # Parsing a rules ConfigMap (YAML, up to 1 MiB, globs compiled) once held the event
    # loop for seconds: run_watch applies this sync's events on a worker thread. The
    # holder swaps one reference, which the loop reads atomically.
    off_loop = True

    def __init__(
        self,
        holder: RulesHolder,
        namespace: str,
        name: str,
        key: str,
        metrics: Metrics,
    ) -> None:
        self.holder = holder
        self.namespace = namespace
        self.name = name
        self.key = key
        self.metrics = metrics
        # Where an admin looks (an Event on the ConfigMap); set once a cluster is known.
        self.notify: Notify = lambda _reason, _message, _warning: None
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
            self.notify(
                "EpguardRulesRejected",
                f"epguard rejected this rules edit and keeps the last good rules ({len(kept)} "
                f"from {kept.source}): {exc}",
                True,
            )
            return
        self.last_error = None
        self.holder.set_live(rules)
        self.metrics.rules_reloads.labels("configmap", "ok").inc()
        self.metrics.rules_loaded.labels("configmap").set(len(rules))
        log.info("rules loaded from %s: %d rule(s)", self.source, len(rules))
        warnings = report_warnings(rules, "configmap", self.metrics)
        if warnings:
            self.notify(
                "EpguardRulesWarning",
                f"epguard loaded {len(rules)} rule(s) with {len(warnings)} warning(s): "
                + "; ".join(warnings),
                True,
            )


class NamespaceSync:
    resource = "namespace"
    off_loop = False

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
    # Off the loop: a listing of many thousand verdicts is parsed for seconds, and the
    # loop answers reviews meanwhile (the store takes its lock only to swap them in).
    off_loop = True

    def __init__(self, store: VerdictStore, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> None:
        parsed = [v for o in objects if (v := verdict_from_object(o)) is not None]
        self.store.replace(parsed)
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
                "ImageVerdict %s not held: the store's %s share is full (%d); see "
                "epguard_verdicts_dropped",
                name,
                "scan" if verdict.from_scan else "probe",
                self.store.scan_cap if verdict.from_scan else self.store.cap,
            )
        self._count()

    def _count(self) -> None:
        self.metrics.verdicts_loaded.set(len(self.store))
        self.metrics.verdicts_dropped.set(self.store.dropped)


class ProbeKeySync(OneObjectSync):
    """The probe-signing keyring: one Secret, by name (webhook/engine/signing.py)."""

    resource = "secret"
    off_loop = False

    def __init__(self, holder: KeyringHolder, name: str) -> None:
        self.holder = holder
        self.name = name

    def _apply(self, obj: Mapping[str, Any] | None) -> None:
        if obj is None:
            # Keep signing with the keys we had: the controller recreates the Secret, and
            # a pod signed meanwhile still verifies if the old key comes back; if a new
            # one does, that pod's result is not learned, which is the safe side.
            if self.holder.ring is None:
                self.holder.set(None, f"Secret {self.name} does not exist (yet)")
            log.warning("probe-signing Secret %s is gone; keeping the keys held", self.name)
            return
        try:
            ring = keyring_from_secret(obj)
        except KeyringError as exc:
            log.error(
                "probe-signing Secret %s is unusable, keeping the keys held: %s", self.name, exc
            )
            if self.holder.ring is None:
                self.holder.set(None, f"Secret {self.name}: {exc}")
            return
        changed = self.holder.ring is None or self.holder.ring.current.id != ring.current.id
        self.holder.set(ring)
        if changed:
            log.info("probe-signing key %s in use (%d held)", ring.current.id, len(ring.keys))


@dataclass
class Source:
    """How to list and watch one resource, as raw JSON objects. Both calls block (the
    official client is synchronous); ``run_watch`` runs them on a thread of their own."""

    # Every object, and the resourceVersion of that snapshot.
    list: Callable[[], tuple[list[Mapping[str, Any]], str]]
    # The events after a resourceVersion: (type, object), BOOKMARK included; ends when
    # the server closes the watch; raises on an error (410 Gone: list again).
    watch: Callable[[str], Iterator[tuple[str, Mapping[str, Any]]]]


T = TypeVar("T")


async def _threaded(produce: Callable[[], Iterable[T]], name: str) -> AsyncIterator[T]:
    """Iterate a blocking iterator on a daemon thread, feeding the event loop.

    A daemon thread, not the loop's default executor: a watch blocks in a socket read
    until the next event or its server-side timeout, and the executor is joined at
    shutdown, which would hold a stopping webhook for minutes. When the consumer goes
    away the thread ends at its next item."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    stop = threading.Event()

    def post(item: tuple[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            stop.set()

    def pump() -> None:
        try:
            for x in produce():
                if stop.is_set():
                    return
                post(("item", x))
            post(("end", None))
        except BaseException as exc:
            post(("error", exc))

    threading.Thread(target=pump, name=name, daemon=True).start()
    try:
        while True:
            tag, x = await queue.get()
            if tag == "end":
                return
            if tag == "error":
                raise x
            yield x
    finally:
        stop.set()


def _resource_version(obj: Mapping[str, Any]) -> str | None:
    rv = meta(obj).get("resourceVersion")
    return rv if isinstance(rv, str) and rv else None


async def _apply(sync: Sync, fn: Callable[..., None], *args: Any) -> None:
    """Run one of ``sync``'s updates where it belongs: on a worker thread for a sync whose
    parsing is heavy (``off_loop``), else on the loop."""
    if sync.off_loop:
        await asyncio.to_thread(fn, *args)
    else:
        fn(*args)


async def run_watch(
    sync: Sync,
    source: Source,
    metrics: Metrics,
    max_backoff: float = 30.0,
    listed: Callable[[], None] = lambda: None,
) -> None:
    """List once, then watch from the list's resourceVersion; after a dropped watch,
    resume from the last resourceVersion seen (no replay of every object); list again
    only on 410 Gone. Errors back off (1 s doubling to ``max_backoff``, with jitter).
    ``listed`` is called after each listing has replaced the state."""
    delay = 1.0
    rv: str | None = None
    while True:
        try:
            if rv is None:
                listing = [x async for x in _threaded(lambda: [source.list()], sync.resource)]
                objects, listed_at = listing[0]
                await _apply(sync, sync.replace, objects)
                # Watched from only once applied: a listing whose replace failed is
                # listed again, not skipped for a watch from its version.
                rv = listed_at
                listed()
                metrics.watch_up.labels(sync.resource).set(1)
                log.info("watching %s (%d listed at %s)", sync.resource, len(objects), rv)
            started, events = time.monotonic(), 0
            async for kind, obj in _threaded(functools.partial(source.watch, rv), sync.resource):
                rv = _resource_version(obj) or rv
                if kind == "BOOKMARK":
                    continue
                await _apply(sync, sync.event, kind, obj)
                events += 1
                metrics.watch_events.labels(sync.resource).inc()
                delay = 1.0
            metrics.watch_up.labels(sync.resource).set(1)
            if events or time.monotonic() - started > 1.0:
                log.debug("watch on %s ended at %s; resuming", sync.resource, rv)
                continue
            # An empty watch that ended at once: back off rather than spin.
        except asyncio.CancelledError:
            metrics.watch_up.labels(sync.resource).set(0)
            raise
        except Exception as exc:
            if status_of(exc) == HTTPStatus.GONE:
                log.info(
                    "watch on %s: resourceVersion %s is gone; listing again", sync.resource, rv
                )
                rv = None
            else:
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


# The server ends each watch after this long (plus its own jitter); the client resumes.
WATCH_SECONDS = 300


def watch_error(status: Mapping[str, Any]) -> client.ApiException:
    """The API error an in-stream ERROR event stands for (its object is a Status): a
    watch from a resourceVersion the server no longer holds gets ``code: 410`` this way,
    with HTTP 200, after every API server restart."""
    code = status.get("code")
    reason = f"{status.get('reason', 'Error')}: {status.get('message', '')}"
    return client.ApiException(status=code if isinstance(code, int) else 500, reason=reason)


def _watching(
    fn: Callable[..., Any], args: tuple[Any, ...], selectors: Any
) -> Callable[[str], Iterator[tuple[str, Mapping[str, Any]]]]:
    # The lines are read here, not through the client's watch.Watch: with
    # deserialize=False it reads an ERROR event's "raw_object", which only deserialising
    # sets, so an in-stream 410 raised KeyError, the watch resumed from the same
    # expired version again and again, and every watch stayed stale after an API
    # server restart while the webhook stayed ready.
    def watching(rv: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        resp = fn(
            *args,
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS,
            # The socket read outlives the server's timeout: a silent half-open
            # connection ends here instead of hanging forever.
            _request_timeout=(REQUEST_TIMEOUT[0], WATCH_SECONDS + 60),
            _preload_content=False,
            **selectors,
        )
        try:
            for line in iter_resp_lines(resp):
                try:
                    event = json.loads(line)
                except (ValueError, RecursionError):
                    # Not an event, or nested past what this process decodes
                    # (kube.allow_api_depth): the next line is read.
                    continue
                obj = event.get("object") if isinstance(event, Mapping) else None
                if not isinstance(obj, Mapping):
                    continue
                kind = str(event.get("type"))
                if kind == "ERROR":
                    raise watch_error(obj)
                yield kind, obj
        finally:
            resp.close()
            resp.release_conn()

    return watching


def list_watch_source(
    fn: Callable[..., Any],
    *args: Any,
    slim: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    **selectors: Any,
) -> Source:
    """Every object of a list call (each cut down by ``slim`` as its page is read), then
    its events."""

    def listing() -> tuple[list[Mapping[str, Any]], str]:
        return list_all(fn, *args, slim=slim, **selectors)

    return Source(listing, _watching(fn, args, selectors))


def changes_source(fn: Callable[..., Any], *args: Any, **selectors: Any) -> Source:
    """Only the events of a list call, from now: its "list" reads one object to learn
    the snapshot's resourceVersion and hands over none, so a 410 Gone costs one small
    request, not every object (the backstop's wake-up on ImageVerdict changes)."""

    def listing() -> tuple[list[Mapping[str, Any]], str]:
        return [], snapshot_version(fn, *args, **selectors)

    return Source(listing, _watching(fn, args, selectors))


def kube_sources(
    api: client.ApiClient, namespace: str, configmap: str, key_secret: str
) -> dict[str, Source]:
    """The four sources, over one ApiClient: the rules ConfigMap and the probe-key Secret
    (each by name, which RBAC's resourceNames can limit), Namespaces, ImageVerdicts."""
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    return {
        "configmap": list_watch_source(
            core.list_namespaced_config_map, namespace, field_selector=f"metadata.name={configmap}"
        ),
        "secret": list_watch_source(
            core.list_namespaced_secret, namespace, field_selector=f"metadata.name={key_secret}"
        ),
        "namespace": list_watch_source(core.list_namespace),
        "imageverdict": list_watch_source(
            custom.list_cluster_custom_object, GROUP, VERSION, PLURAL, slim=slim_verdict_object
        ),
    }
