"""The probe-signing key: created at start, rotated on schedule, held for the recorder.

The webhook signs every probe it injects with the newest key (``webhook/engine/signing.py``);
the recorder learns only from pods whose signature verifies. The key lives in one
Secret in the release namespace that only the webhook (read, by name) and the
controller (read and write, by name) may touch. A rotation puts a fresh key first and
keeps the previous ones (``signing.MAX_KEYS``), so pods signed shortly before it still
verify; the webhook's watch picks the new key up within seconds.

Every replica runs this (kopf peering pauses only event handlers): two replicas that
rotate at once write with the resourceVersion they read, so one wins and the other
re-reads (409), and both end up holding the same keyring.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import logging
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.webhook.cluster.kube import REQUEST_TIMEOUT
from epguard.webhook.controller import background
from epguard.webhook.controller.config import ControllerConfig
from epguard.webhook.engine.signing import (
    SECRET_KEY,
    Keyring,
    KeyringError,
    KeyringHolder,
    key_age,
    keyring_from_secret,
    new_keyring,
    rotated,
)

log = logging.getLogger("epguard.controller.probe_key")

MANAGED_BY = {"app.kubernetes.io/managed-by": "epguard-controller"}
# How often the Secret is re-read (rotation due? replaced by another replica?).
CHECK_EVERY = dt.timedelta(minutes=10)
ATTEMPTS = 5


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class ProbeKeyManager:
    """Blocking API calls on the official client; ``run`` puts them on a thread."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        rotation: dt.timedelta,
        holder: KeyringHolder,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.name = name
        self.rotation = rotation
        self.holder = holder

    def _body(self, ring: Keyring, resource_version: str | None) -> client.V1Secret:
        return client.V1Secret(
            api_version="v1",
            kind="Secret",
            metadata=client.V1ObjectMeta(
                name=self.name,
                namespace=self.namespace,
                labels=dict(MANAGED_BY),
                resource_version=resource_version,
            ),
            type="Opaque",
            data={SECRET_KEY: base64.b64encode(ring.to_json().encode()).decode()},
        )

    def reconcile_once(self, now: dt.datetime | None = None) -> Keyring:
        """Create, repair or rotate the keyring as needed; hold and return it."""
        now = now or _now()
        for _ in range(ATTEMPTS):
            try:
                obj = self.core.read_namespaced_secret(
                    self.name, self.namespace, _request_timeout=REQUEST_TIMEOUT
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                ring = new_keyring(now)
                try:
                    self.core.create_namespaced_secret(
                        self.namespace, self._body(ring, None), _request_timeout=REQUEST_TIMEOUT
                    )
                except ApiException as create_exc:
                    if create_exc.status == 409:  # another replica created it first
                        continue
                    raise
                log.info("created probe-signing key %s in Secret %s", ring.current.id, self.name)
                self.holder.set(ring)
                return ring
            raw = {"data": obj.data or {}}
            rv = obj.metadata.resource_version if obj.metadata else None
            try:
                ring = keyring_from_secret(raw)
            except KeyringError as exc:
                # The Secret is epguard's own; one that does not parse is replaced, which
                # only means pods signed before are not learned from.
                log.error("probe-signing Secret %s is unusable (%s); replacing it", self.name, exc)
                ring = new_keyring(now)
            else:
                age = key_age(ring, now)
                if age is not None and age < self.rotation:
                    self.holder.set(ring)
                    return ring
                ring = rotated(ring, now)
            try:
                self.core.replace_namespaced_secret(
                    self.name,
                    self.namespace,
                    self._body(ring, rv),
                    _request_timeout=REQUEST_TIMEOUT,
                )
            except ApiException as exc:
                if exc.status == 409:  # another replica rotated it: read theirs
                    continue
                raise
            log.info("probe-signing key rotated: %s is current", ring.current.id)
            self.holder.set(ring)
            return ring
        raise RuntimeError(f"Secret {self.name}: too many write conflicts")

    def refresh(self) -> Keyring | None:
        """Read the keyring again (a pod names a key not held: another replica rotated).
        Only a read: creating, repairing and rotating are ``run``'s, not a pod event's."""
        try:
            obj = self.core.read_namespaced_secret(
                self.name, self.namespace, _request_timeout=REQUEST_TIMEOUT
            )
            self.holder.set(keyring_from_secret({"data": obj.data or {}}))
        except Exception as exc:
            log.warning("could not read probe-signing Secret %s: %s", self.name, exc)
        return self.holder.ring

    async def run(self, stop: asyncio.Event) -> None:
        delay = 1.0
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.reconcile_once)
                wait = CHECK_EVERY.total_seconds()
                delay = 1.0
            except Exception as exc:
                log.warning("probe-signing key: %s; retrying in %.0fs", exc, delay)
                wait, delay = delay, min(delay * 2, 60.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=wait)


async def start_probe_key(memo: kopf.Memo, **_: Any) -> None:
    config: ControllerConfig = memo["config"]
    manager = ProbeKeyManager(
        memo["api"],
        config.namespace,
        config.probe_key_secret,
        config.probe_key_rotation,
        KeyringHolder(),
    )
    memo["probe_keys"] = manager
    background.start(memo, "probe_key", manager.run)


async def stop_probe_key(memo: kopf.Memo, **_: Any) -> None:
    await background.stop(memo, "probe_key")


kopf.on.startup(id="epguard-probe-key-start")(start_probe_key)
kopf.on.cleanup(id="epguard-probe-key-stop")(stop_probe_key)
