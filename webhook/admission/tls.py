"""TLS for the webhook server, with certificate and key reloaded in place.

cert-manager and kubelet Secret projection rewrite ``tls.crt``/``tls.key`` while
the server runs. The listening socket keeps one ``SSLContext`` for its whole
life; its SNI callback (which OpenSSL calls on every ClientHello, with or
without a server name) points each new connection at the newest *complete*
context. Open connections keep the context they started with, so nothing is
dropped, and a half-written pair (new cert, old key) is never served: a pair
that does not load is ignored until the next check.

**Client certificates (optional).** With a client CA (``--client-ca``), a client that
presents a certificate must present one that CA signed (the handshake fails otherwise),
and the admission paths answer only connections that did (``webhook/admission/transport.py``):
the API server, given a client certificate in its AdmissionConfiguration
(docs/webhook.md). The kubelet's probes and metrics scrapers present none and are still
served ``/healthz``, ``/readyz`` and ``/metrics``, so verification is optional at the TLS
layer and required per path. The CA file is reloaded with the pair.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
from collections.abc import Callable

log = logging.getLogger("epguard.tls")


class TLSReloadError(RuntimeError):
    pass


def build_context(cert_path: str, key_path: str, client_ca: str | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    try:
        ctx.load_cert_chain(cert_path, key_path)
    except (OSError, ssl.SSLError) as exc:
        raise TLSReloadError(
            f"cannot load certificate {cert_path} with key {key_path}: {exc}"
        ) from exc
    if client_ca:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise TLSReloadError(f"cannot load client CA {client_ca}: {exc}") from exc
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def _fingerprint(cert_path: str, key_path: str, client_ca: str | None = None) -> bytes | None:
    h = hashlib.sha256()
    try:
        for path in (cert_path, key_path, *([client_ca] if client_ca else [])):
            with open(path, "rb") as fh:
                h.update(fh.read())
                h.update(b"\x00")
    except OSError:
        return None
    return h.digest()


class ReloadingTLS:
    def __init__(
        self,
        cert_path: str,
        key_path: str,
        on_reload: Callable[[bool], None] | None = None,
        client_ca: str | None = None,
    ) -> None:
        self.cert_path = cert_path
        self.key_path = key_path
        self.client_ca = client_ca
        self._on_reload = on_reload
        self._seen = _fingerprint(cert_path, key_path, client_ca)
        self._failed: bytes | None = None  # the content whose load failed last
        # Startup must fail loudly on a bad pair: there is no older one to keep.
        self.server_context = build_context(cert_path, key_path, client_ca)
        self.current = self.server_context
        self.server_context.sni_callback = self._pick_context
        self.generation = 0

    def _pick_context(
        self, sslobj: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, ctx: ssl.SSLContext
    ) -> None:
        current = self.current
        if current is not ctx:
            sslobj.context = current
        return None

    def check(self) -> bool:
        """Reload if the files changed and now form a valid pair. True when reloaded."""
        fp = _fingerprint(self.cert_path, self.key_path, self.client_ca)
        if fp is None or fp == self._seen:
            return False
        try:
            fresh = build_context(self.cert_path, self.key_path, self.client_ca)
        except TLSReloadError as exc:
            # Possibly mid-rotation (cert written, key not yet), or a passing error
            # (out of file descriptors): tried again every tick until it loads, but said
            # only once per content. (Marking the content seen once kept a new
            # certificate from ever loading after one passing error, until the old one
            # expired and every handshake failed.)
            if fp != self._failed:
                self._failed = fp
                log.warning("TLS reload failed, still serving the previous certificate: %s", exc)
                if self._on_reload:
                    self._on_reload(False)
            return False
        self._seen = fp
        self._failed = None
        self.current = fresh
        self.generation += 1
        log.info(
            "TLS certificate reloaded from %s (generation %d)", self.cert_path, self.generation
        )
        if self._on_reload:
            self._on_reload(True)
        return True

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                self.check()
            except Exception:  # never let the reloader die; the next tick retries
                log.exception("unexpected error while checking TLS files")
