"""Self-managed TLS: keep the Secret's CA and serving cert valid and the webhook
configurations' caBundle equal to the Secret's CA bundle.

Why a background loop and not kopf watches/timers on the Secret:
- kopf timers and daemons put a finalizer on the object they run for; a finalizer on the
  TLS Secret or on the webhook configuration would block ``helm uninstall`` whenever the
  controller is gone first;
- kopf's watches are cluster-wide in a cluster-wide operator, which would need a
  ClusterRole on Secrets. The loop reads one named Secret in the release namespace, which
  a Role limited by ``resourceNames`` allows.

The loop runs in every controller replica, also in those that kopf peering pauses: each
write carries the resourceVersion it read (or is a create), so when two replicas race
one write wins, the other gets a 409 and re-reads on its next pass. Nothing here needs
a leader.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.webhook.cluster.kube import REQUEST_TIMEOUT
from epguard.webhook.controller import authority, background
from epguard.webhook.controller.config import ControllerConfig

log = logging.getLogger("epguard.controller.certificates")

VALIDATING = "ValidatingWebhookConfiguration"
MUTATING = "MutatingWebhookConfiguration"
MANAGED_BY_LABELS = {
    "app.kubernetes.io/part-of": "epguard",
    "app.kubernetes.io/managed-by": "epguard-controller",
}


class Conflict(Exception):
    """A write lost a race (HTTP 409): re-read and decide again."""


@dataclass
class StoredSecret:
    data: dict[str, bytes]
    resource_version: str | None
    owner_uids: tuple[str, ...] = ()


@dataclass(frozen=True)
class WebhookConfigRef:
    kind: str  # VALIDATING or MUTATING
    name: str


@dataclass
class StoredWebhookConfig:
    uid: str
    # (webhook name, current caBundle bytes) in list order; the index matters for patches.
    webhooks: list[tuple[str, bytes]]


class TLSApi(Protocol):
    """The handful of API calls TLS management needs. The real one is KubeTLSApi;
    the tests use an in-memory fake with the same conflict semantics."""

    async def read_secret(self, namespace: str, name: str) -> StoredSecret | None: ...

    async def write_secret(
        self,
        namespace: str,
        name: str,
        secret: StoredSecret,
        owner: tuple[WebhookConfigRef, str] | None,
    ) -> None:
        """Create when ``secret.resource_version`` is None, else replace at that version.
        Raises Conflict when the object exists (create) or changed (replace)."""

    async def read_webhook_config(self, ref: WebhookConfigRef) -> StoredWebhookConfig | None: ...

    async def set_ca_bundle(
        self, ref: WebhookConfigRef, webhooks: list[tuple[int, str]], bundle: bytes
    ) -> None:
        """Set caBundle of the listed (index, name) webhooks; Conflict if one moved."""


@dataclass
class ReconcileResult:
    secret_written: bool = False
    bundles_patched: list[str] = field(default_factory=list)
    missing_configs: list[str] = field(default_factory=list)
    reasons: tuple[str, ...] = ()
    next_action_at: dt.datetime | None = None


class CertificateManager:
    def __init__(
        self,
        api: TLSApi,
        config: ControllerConfig,
        clock: Callable[[], dt.datetime] | None = None,
    ) -> None:
        if config.policy is None:
            raise ValueError("CertificateManager needs a TLS policy (manage_certs on)")
        self.api = api
        self.config = config
        self.policy: authority.TLSPolicy = config.policy
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))

    def _configs(self) -> list[WebhookConfigRef]:
        refs = [WebhookConfigRef(VALIDATING, self.config.validating_webhook)]
        if self.config.mutating_webhook:
            refs.append(WebhookConfigRef(MUTATING, self.config.mutating_webhook))
        return refs

    async def reconcile_once(self) -> ReconcileResult:
        """One pass: fix the Secret if needed, then every caBundle. Raises Conflict when
        another replica wrote in between (the caller retries soon)."""
        now = self.clock()
        result = ReconcileResult()
        ns, name = self.config.namespace, self.config.tls_secret

        configs: dict[WebhookConfigRef, StoredWebhookConfig] = {}
        for ref in self._configs():
            found = await self.api.read_webhook_config(ref)
            if found is None:
                result.missing_configs.append(f"{ref.kind}/{ref.name}")
            else:
                configs[ref] = found
        # The Secret is owned by the ValidatingWebhookConfiguration (a namespaced object may
        # have a cluster-scoped owner), so `helm uninstall`, which deletes that
        # configuration, also garbage-collects the Secret the controller created.
        owner_ref = self._configs()[0]
        owner = (owner_ref, configs[owner_ref].uid) if owner_ref in configs else None

        stored = await self.api.read_secret(ns, name)
        decision = authority.reconcile(stored.data if stored else None, self.policy, now)
        owner_missing = owner is not None and (stored is None or owner[1] not in stored.owner_uids)
        if decision.changed or owner_missing:
            new = StoredSecret(
                data=decision.data,
                resource_version=stored.resource_version if stored else None,
            )
            await self.api.write_secret(ns, name, new, owner)
            result.secret_written = True
            for reason in decision.reasons:
                log.info("TLS Secret %s/%s: %s", ns, name, reason)
        result.reasons = decision.reasons

        bundle = decision.data[authority.CA_CRT]
        for ref, cfg in configs.items():
            stale = [
                (i, hook) for i, (hook, current) in enumerate(cfg.webhooks) if current != bundle
            ]
            if stale:
                await self.api.set_ca_bundle(ref, stale, bundle)
                result.bundles_patched.append(f"{ref.kind}/{ref.name}")
                log.info(
                    "caBundle of %s/%s updated for %s",
                    ref.kind,
                    ref.name,
                    ", ".join(h for _, h in stale),
                )
        result.next_action_at = authority.next_action_at(decision.data, self.policy)
        return result

    def delay_after(self, result: ReconcileResult | None) -> float:
        """Seconds to sleep before the next pass: soon while something is missing (the
        chart creates the webhook configuration at about the same time as this pod), else
        the poll interval, cut short when a rotation step falls due before it."""
        interval = self.config.poll_interval
        if result is None or result.missing_configs:
            return min(5.0, interval)
        if result.next_action_at is not None:
            until = (result.next_action_at - self.clock()).total_seconds()
            return max(1.0, min(interval, until + 1.0))
        return interval

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            result: ReconcileResult | None = None
            try:
                result = await self.reconcile_once()
            except Conflict:
                log.info("TLS reconcile lost a race with another replica; retrying")
            except asyncio.CancelledError:
                raise
            except Exception:
                # Never let the loop die: a transient API error must not end rotation.
                log.exception("TLS reconcile failed; retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.delay_after(result))


# --- the real API, through the official client --------------------------------------------


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


class KubeTLSApi:
    """TLSApi over the official (synchronous) client: each call runs on a worker thread
    so the certificate loop never blocks kopf's event loop."""

    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.admission = client.AdmissionregistrationV1Api(api)

    async def read_secret(self, namespace: str, name: str) -> StoredSecret | None:
        def call() -> StoredSecret | None:
            try:
                obj = self.core.read_namespaced_secret(
                    name, namespace, _request_timeout=REQUEST_TIMEOUT
                )
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            data = {k: base64.b64decode(v) for k, v in (obj.data or {}).items()}
            md = obj.metadata
            owners = tuple(o.uid for o in (md.owner_references or [])) if md else ()
            return StoredSecret(data, md.resource_version if md else None, owners)

        return await asyncio.to_thread(call)

    async def write_secret(
        self,
        namespace: str,
        name: str,
        secret: StoredSecret,
        owner: tuple[WebhookConfigRef, str] | None,
    ) -> None:
        owners = None
        if owner is not None:
            ref, uid = owner
            owners = [
                client.V1OwnerReference(
                    api_version="admissionregistration.k8s.io/v1",
                    kind=ref.kind,
                    name=ref.name,
                    uid=uid,
                )
            ]
        body = client.V1Secret(
            api_version="v1",
            kind="Secret",
            metadata=client.V1ObjectMeta(
                name=name,
                namespace=namespace,
                labels=dict(MANAGED_BY_LABELS),
                resource_version=secret.resource_version,
                owner_references=owners,
            ),
            type="kubernetes.io/tls",
            data={k: _b64(v) for k, v in sorted(secret.data.items())},
        )

        def call() -> None:
            try:
                if secret.resource_version is None:
                    self.core.create_namespaced_secret(
                        namespace, body, _request_timeout=REQUEST_TIMEOUT
                    )
                else:
                    self.core.replace_namespaced_secret(
                        name, namespace, body, _request_timeout=REQUEST_TIMEOUT
                    )
            except ApiException as exc:
                if exc.status == 409:
                    raise Conflict(str(exc.reason)) from exc
                raise

        await asyncio.to_thread(call)

    def _read_config(self, ref: WebhookConfigRef) -> Any:
        if ref.kind == VALIDATING:
            return self.admission.read_validating_webhook_configuration(
                ref.name, _request_timeout=REQUEST_TIMEOUT
            )
        return self.admission.read_mutating_webhook_configuration(
            ref.name, _request_timeout=REQUEST_TIMEOUT
        )

    async def read_webhook_config(self, ref: WebhookConfigRef) -> StoredWebhookConfig | None:
        def call() -> StoredWebhookConfig | None:
            try:
                obj = self._read_config(ref)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            hooks = [
                (w.name, base64.b64decode(w.client_config.ca_bundle or ""))
                for w in (obj.webhooks or [])
            ]
            return StoredWebhookConfig(uid=obj.metadata.uid, webhooks=hooks)

        return await asyncio.to_thread(call)

    async def set_ca_bundle(
        self, ref: WebhookConfigRef, webhooks: list[tuple[int, str]], bundle: bytes
    ) -> None:
        # A JSON patch with a `test` per webhook: if `helm upgrade` reordered or renamed
        # the webhooks since the read, the patch fails as a whole instead of writing a
        # bundle into the wrong entry.
        ops: list[dict[str, Any]] = []
        for index, hook in webhooks:
            ops.append({"op": "test", "path": f"/webhooks/{index}/name", "value": hook})
            ops.append(
                {
                    "op": "add",
                    "path": f"/webhooks/{index}/clientConfig/caBundle",
                    "value": _b64(bundle),
                }
            )
        patch = (
            self.admission.patch_validating_webhook_configuration
            if ref.kind == VALIDATING
            else self.admission.patch_mutating_webhook_configuration
        )

        def call() -> None:
            try:
                patch(
                    ref.name,
                    ops,
                    field_manager="epguard-controller",
                    _content_type="application/json-patch+json",
                    _request_timeout=REQUEST_TIMEOUT,
                )
            except ApiException as exc:
                # 422 is what a failed `test` op returns.
                if exc.status in (409, 422):
                    raise Conflict(str(exc.reason)) from exc
                raise

        await asyncio.to_thread(call)


# --- kopf wiring ----------------------------------------------------------------------------

ApiFactory = Callable[[], Awaitable[TLSApi]]


async def start_certificate_manager(memo: kopf.Memo, **_: Any) -> None:
    config: ControllerConfig = memo["config"]
    if not config.manage_certs:
        log.info("TLS is managed elsewhere (cert-manager); not touching certificates")
        return
    factory: ApiFactory | None = memo.get("tls_api_factory")
    api: TLSApi = await factory() if factory is not None else KubeTLSApi(memo["api"])
    background.start(memo, "tls", CertificateManager(api, config).run)
    policy = config.policy
    names = [*policy.dns_names, *map(str, policy.ip_addresses)] if policy else []
    log.info(
        "managing TLS Secret %s/%s for %s", config.namespace, config.tls_secret, ", ".join(names)
    )


async def stop_certificate_manager(memo: kopf.Memo, **_: Any) -> None:
    await background.stop(memo, "tls")


# Registered without decorator syntax so the names keep their plain signatures (kopf's
# decorators retype them as ActivityFn, which the tests could not call).
kopf.on.startup(id="epguard-tls-start")(start_certificate_manager)
kopf.on.cleanup(id="epguard-tls-stop")(stop_certificate_manager)

