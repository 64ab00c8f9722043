"""A real epguard webhook (uvicorn + TLS) on a loopback port, run in a thread."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import uvicorn
from fastapi import APIRouter

from epguard.webhook.admission.server import Runtime
from epguard.webhook.cluster.watch import Source
from epguard.webhook.settings import Settings
from tests.pki import issue, make_ca, write_pair


@dataclass
class RunningServer:
    runtime: Runtime
    server: uvicorn.Server
    port: int
    ca_path: Path
    cert_path: Path
    key_path: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def ssl_context(self, ca_pem_path: Path | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(ca_pem_path or self.ca_path))
        return ctx

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=self.ssl_context(), timeout=10, **kw)  # type: ignore[arg-type]


@contextmanager
def running_server(
    tmp: Path,
    rules_text: str,
    *,
    sources: dict[str, Source] | None = None,
    routers: Sequence[APIRouter] = (),
    **overrides: object,
) -> Iterator[RunningServer]:
    ca = make_ca()
    issued = issue(ca)
    cert, key, ca_path = tmp / "tls.crt", tmp / "tls.key", tmp / "ca.crt"
    write_pair(issued, cert, key)
    ca_path.write_bytes(issued.ca_pem)
    rules = tmp / "rules.yaml"
    rules.write_text(rules_text)
    settings = Settings(
        rules=str(rules),
        tls_cert=str(cert),
        tls_key=str(key),
        host="127.0.0.1",
        port=0,
        watch="off",
        reload_interval=0.1,
    )
    settings = replace(settings, **overrides)  # type: ignore[arg-type]
    runtime = Runtime(settings, sources=sources, routers=routers)
    server = uvicorn.Server(runtime.uvicorn_config())
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("webhook server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(runtime, server, port, ca_path, cert, key)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
