"""Wiring: settings → in-memory state, background tasks, and the uvicorn server.

Background tasks (started in the app's lifespan, cancelled on shutdown):
TLS file reload, rules file reload, and — when cluster credentials exist —
the ConfigMap, Namespace and ImageVerdict watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import gc
import hashlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import uvicorn
from fastapi import APIRouter, FastAPI
from kubernetes import client

from epguard.webhook.admission.app import create_app
from epguard.webhook.admission.handler import RulesConfigMap
from epguard.webhook.admission.protocol import BoundedHttpToolsProtocol, HeadLimits
from epguard.webhook.admission.tls import ReloadingTLS
from epguard.webhook.admission.transport import Limits
from epguard.webhook.cluster.kube import NoCredentials, api_client, post_event
from epguard.webhook.cluster.watch import (
    NamespaceSync,
    Notify,
    ProbeKeySync,
    RulesConfigMapSync,
    Source,
    Sync,
    VerdictSync,
    kube_sources,
    report_warnings,
    run_watch,
)
from epguard.webhook.engine.injection import InjectionSettings
from epguard.webhook.engine.namespaces import NamespaceIndex
from epguard.webhook.engine.policy import PolicyConfig, PolicyState
from epguard.webhook.engine.rules import (
    RulesError,
    RuleSet,
    RulesHolder,
    default_rules_path,
    load_rules_file,
)
from epguard.webhook.engine.verdicts import VerdictStore
from epguard.webhook.engine.workloads import KindRegistry
from epguard.webhook.metrics import Metrics
from epguard.webhook.settings import Settings

log = logging.getLogger("epguard.server")
COMPONENT = "epguard-webhook"  # the source of the Events the webhook posts
# How long a replica waits, unready, for its watches' first listings (the probe-signing
# Secret, namespaces, verdicts, rules: milliseconds to a few seconds when it can read
# them) before it serves without what is missing.
LIST_WAIT_SECONDS = 60.0


def _file_digest(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).digest()
    except OSError:
        return None


class Runtime:
    """Everything one webhook process holds. Raises TLSReloadError on a bad start.

    A rules file that does not load at start is not fatal: in the chart it is the rules
    ConfigMap, mounted, and a broken edit of it must not crash-loop the webhook on its
    next restart. It starts on the built-in rules instead, says so at ERROR, in
    ``/readyz`` (``rules_file_error``) and in ``epguard_rules_reloads_total{file,
    rejected}``, and takes the file as soon as it is fixed (the file poll)."""

    def __init__(
        self,
        settings: Settings,
        sources: dict[str, Source] | None = None,
        routers: Sequence[APIRouter] = (),
    ) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.rules_path = settings.rules or default_rules_path()
        self.rules_file_error: str | None = None
        self._rules_digest = _file_digest(self.rules_path)
        try:
            file_rules = load_rules_file(self.rules_path)
        except RulesError as exc:
            if self.rules_path == default_rules_path():
                raise  # the built-in rules themselves: a broken install, not an edit
            self.rules_file_error = str(exc)
            self.metrics.rules_reloads.labels("file", "rejected").inc()
            file_rules = load_rules_file(default_rules_path())
            log.error(
                "the rules file does not load; starting on the %d built-in rules until it "
                "is fixed: %s",
                len(file_rules),
                exc,
            )
        else:
            self.metrics.rules_reloads.labels("file", "ok").inc()
        self.metrics.rules_loaded.labels("file").set(len(file_rules))
        self._warn_about_file(file_rules)
        self.verdicts = VerdictStore(dt.timedelta(hours=settings.verdict_ttl_hours))
        self.state = PolicyState(
            rules=RulesHolder(file_rules),
            namespaces=NamespaceIndex(),
            verdicts=self.verdicts,
            config=PolicyConfig(
                default_mode=settings.mode,
                allow_skip=settings.allow_skip,
                kinds=KindRegistry(settings.extra_kinds),
            ),
        )
        self.tls: ReloadingTLS | None = None
        if settings.tls_cert and settings.tls_key:
            self.tls = ReloadingTLS(
                settings.tls_cert,
                settings.tls_key,
                on_reload=lambda ok: self.metrics.tls_reloads.labels(
                    "ok" if ok else "failed"
                ).inc(),
                client_ca=settings.client_ca,
            )
        self.rules_sync = RulesConfigMapSync(
            self.state.rules,
            settings.namespace,
            settings.rules_configmap,
            settings.rules_key,
            self.metrics,
        )
        self.syncs: dict[str, Sync] = {
            "configmap": self.rules_sync,
            "secret": ProbeKeySync(self.state.keys, settings.probe_key_secret),
            "namespace": NamespaceSync(self.state.namespaces),
            "imageverdict": VerdictSync(self.verdicts, self.metrics),
        }
        self._sources = sources
        self.watching = False
        self.watched: set[str] = set()  # the sources watched
        self.listed: set[str] = set()  # those whose first listing has replaced the state
        self.started_at = time.monotonic()
        self.ready = False
        self.app: FastAPI = create_app(
            self.state,
            self.metrics,
            limits=Limits(
                max_body_bytes=settings.max_body_bytes,
                deadline=settings.deadline_seconds,
                inflight_bytes=settings.max_inflight_bytes,
                require_client_cert=bool(settings.client_ca and self.tls),
            ),
            rules_configmap=RulesConfigMap(
                settings.namespace, settings.rules_configmap, settings.rules_key
            ),
            injection=InjectionSettings(
                settings.inject_image,
                level=settings.probe_level,
                pull_secrets=settings.inject_pull_secrets,
                preflight=settings.preflight_mode,
            ),
            ready=self.is_ready,
            status=self.status,
            lifespan=self.lifespan,
            routers=routers,
        )

    def is_ready(self) -> bool:
        """Started, and every watch has listed once, or LIST_WAIT_SECONDS have passed.
        Before that this replica would admit pods on images with Unusable verdicts, give
        namespaces the default mode, and inject unsigned probes that gate nothing (a
        rollout's new replicas once took reviews before their verdicts were listed).
        Not forever: an object it can never read (403) must not leave every replica
        unready, which under failurePolicy Ignore admits everything."""
        if not self.ready:
            return False
        if self.listed >= self.watched:
            return True
        return time.monotonic() - self.started_at > LIST_WAIT_SECONDS

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.settings.mode,
            "watching": self.watching,
            "namespaces_with_settings": len(self.state.namespaces),
            "verdicts": len(self.verdicts),
            "last_rules_error": self.rules_sync.last_error,
            "rules_file_error": self.rules_file_error,
            # Unsigned probes are injected while no key is held; nothing is refused for it.
            "probe_key": self.state.keys.ring.current.id if self.state.keys.ring else None,
            "probe_key_error": self.state.keys.error,
        }

    def check_rules_file(self) -> bool:
        """Reload the rules file if it changed (e.g. a mounted ConfigMap); keep the old on error."""
        digest = _file_digest(self.rules_path)
        if digest is None or digest == self._rules_digest:
            return False
        self._rules_digest = digest
        try:
            rules = load_rules_file(self.rules_path)
        except RulesError as exc:
            self.metrics.rules_reloads.labels("file", "rejected").inc()
            self.rules_file_error = str(exc)
            log.error("rejected a rules file change, keeping the last good rules: %s", exc)
            return False
        self.rules_file_error = None
        self.state.rules.set_file(rules)
        self.metrics.rules_reloads.labels("file", "ok").inc()
        self.metrics.rules_loaded.labels("file").set(len(rules))
        log.info("rules file %s reloaded: %d rule(s)", self.rules_path, len(rules))
        self._warn_about_file(rules)
        return True

    def _warn_about_file(self, rules: RuleSet) -> None:
        if rules.source == default_rules_path():  # the built-in rules are checked by a test
            self.metrics.rules_warnings.labels("file").set(0)
        else:
            report_warnings(rules, "file", self.metrics)

    def _events_on_rules_configmap(self, api: client.ApiClient) -> Notify:
        """Problems with the rules, told where the admin edits them: Events on the
        rules ConfigMap (the chart mounts the same ConfigMap as the rules file)."""
        about = client.V1ObjectReference(
            api_version="v1",
            kind="ConfigMap",
            name=self.settings.rules_configmap,
            namespace=self.settings.namespace,
        )

        def notify(reason: str, message: str, warning: bool) -> None:
            key = hashlib.sha256(f"{reason}/{message}".encode()).hexdigest()
            if not post_event(
                api, about, reason, message, warning=warning, component=COMPONENT, key=key
            ):
                log.warning("could not post %s on the rules ConfigMap", reason)

        return notify

    async def _poll_rules_file(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reload_interval)
            try:
                self.check_rules_file()
            except Exception:
                log.exception("unexpected error while checking the rules file")

    def _watch_sources(self) -> dict[str, Source] | None:
        if self._sources is not None:
            return self._sources
        if self.settings.watch == "off":
            log.info("watches disabled: running on the rules file %s alone", self.rules_path)
            return None
        try:
            api = api_client(self.settings.kubeconfig)
        except NoCredentials:
            log.info(
                "no cluster credentials: running on the rules file %s alone "
                "(no live ConfigMap rules, namespace modes or learned verdicts)",
                self.rules_path,
            )
            return None
        except Exception as exc:
            log.warning(
                "cannot read cluster credentials (%s): running on the rules file alone", exc
            )
            return None
        notify = self._events_on_rules_configmap(api)
        self.rules_sync.notify = notify
        if self.rules_file_error:
            # Off the loop: the API may be slow to answer, and this is only a courtesy.
            message = (
                "epguard started on its built-in rules because the rules file (this "
                f"ConfigMap) does not load; fix it and it is taken at once: "
                f"{self.rules_file_error}"
            )
            threading.Thread(
                target=notify, args=("EpguardRulesFileRejected", message, True), daemon=True
            ).start()
        return kube_sources(
            api,
            self.settings.namespace,
            self.settings.rules_configmap,
            self.settings.probe_key_secret,
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        tasks: list[asyncio.Task[None]] = []
        if self.tls is not None:
            tasks.append(asyncio.create_task(self.tls.run(self.settings.reload_interval)))
        tasks.append(asyncio.create_task(self._poll_rules_file()))
        sources = self._watch_sources()
        if sources:
            self.watching = True
            self.started_at = time.monotonic()
            self.watched = set(sources)
            for name, source in sources.items():
                listed = functools.partial(self.listed.add, name)
                tasks.append(
                    asyncio.create_task(
                        run_watch(self.syncs[name], source, self.metrics, listed=listed)
                    )
                )
        rules = self.state.rules.current
        log.info(
            "epguard webhook ready: %d rule(s) from %s, mode %s, exemptions %s",
            len(rules),
            rules.source,
            self.settings.mode,
            "honoured" if self.settings.allow_skip else "disabled",
        )
        # Everything imported and built so far lives as long as the process: move it out
        # of the garbage collector's sight, so full collections (triggered by the many
        # short-lived dicts of each review) stay short and p99 stays flat.
        gc.collect()
        gc.freeze()
        self.ready = True
        try:
            yield
        finally:
            self.ready = False
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def uvicorn_config(self) -> uvicorn.Config:
        s = self.settings
        tls = self.tls
        return uvicorn.Config(
            self.app,
            host=s.host,
            port=s.port,
            log_config=None,
            access_log=False,
            lifespan="on",
            # The API server reuses connections; keep them longer than uvicorn's 5 s.
            timeout_keep_alive=75,
            timeout_graceful_shutdown=10,
            server_header=False,
            ssl_certfile=s.tls_cert,
            ssl_keyfile=s.tls_key,
            ssl_context_factory=(lambda _cfg, _default: tls.server_context) if tls else None,
            # Bounded request heads and a head deadline (webhook/admission/protocol.py).
            http=cast(
                "type[asyncio.Protocol]",
                functools.partial(
                    BoundedHttpToolsProtocol,
                    limits=HeadLimits(
                        s.max_head_bytes, s.head_timeout_seconds, s.body_timeout_seconds
                    ),
                    on_cut=lambda reason: self.metrics.connections_cut.labels(reason).inc(),
                ),
            ),
        )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
