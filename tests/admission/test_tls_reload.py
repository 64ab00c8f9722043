"""Certificate rotation in place: new connections get the new pair, open ones are not
dropped, and a half-written pair is never served."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from tests.factory import TEST_RULES, pod, review
from tests.pki import issue, make_ca, write_pair
from tests.servers import RunningServer, running_server


@pytest.fixture
def live(tmp_path: Path) -> Iterator[RunningServer]:
    with running_server(tmp_path, TEST_RULES) as s:
        yield s


def served_serial(server: RunningServer) -> int:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw,
        ctx.wrap_socket(raw) as tls,  # no SNI: the reload must not depend on it
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def wait_for_serial(server: RunningServer, serial: int, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if served_serial(server) == serial:
            return True
        time.sleep(0.05)
    return False


def metric(server: RunningServer, name: str, **labels: str) -> float:
    return server.runtime.metrics.registry.get_sample_value(name, labels) or 0.0


def test_rotation_serves_the_new_certificate_without_dropping_open_connections(
    live: RunningServer,
) -> None:
    new_ca = make_ca("rotated-ca")
    rotated = issue(new_ca)
    with live.client() as old_client:
        assert old_client.post("/validate", json=review(pod())).status_code == 200
        write_pair(rotated, live.cert_path, live.key_path)
        assert wait_for_serial(live, rotated.serial)
        # The keep-alive connection opened before the rotation still works.
        assert old_client.post("/validate", json=review(pod())).status_code == 200
    new_ca_path = live.ca_path.with_name("new-ca.crt")
    new_ca_path.write_bytes(rotated.ca_pem)
    import httpx

    with httpx.Client(base_url=live.url, verify=live.ssl_context(new_ca_path)) as fresh:
        assert fresh.get("/healthz").status_code == 200
    assert metric(live, "epguard_tls_reloads_total", result="ok") >= 1


def test_a_half_written_pair_is_not_served(live: RunningServer) -> None:
    before = served_serial(live)
    first = issue(make_ca())
    # New certificate, old key: mid-rotation. Must keep serving the old pair.
    live.cert_path.write_bytes(first.cert_pem)
    deadline = time.monotonic() + 20
    while metric(live, "epguard_tls_reloads_total", result="failed") < 1:
        assert time.monotonic() < deadline, "the failed reload was never attempted"
        time.sleep(0.05)
    assert served_serial(live) == before
    with live.client() as c:
        assert c.get("/healthz").status_code == 200
    # The key arrives: now the new pair is served.
    live.key_path.write_bytes(first.key_pem)
    assert wait_for_serial(live, first.serial)


def test_startup_fails_loudly_on_a_bad_pair(tmp_path: Path) -> None:
    from epguard.webhook.admission.tls import ReloadingTLS, TLSReloadError

    a, b = issue(make_ca()), issue(make_ca())
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_bytes(a.cert_pem)
    key.write_bytes(b.key_pem)
    with pytest.raises(TLSReloadError, match="cannot load certificate"):
        ReloadingTLS(str(cert), str(key))
    write_pair(a, cert, key)
    assert ReloadingTLS(str(cert), str(key)).generation == 0


def test_a_reload_that_failed_once_is_tried_again_for_the_same_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A passing error (out of file descriptors under a connection flood) must not mark
    # the new files as seen: the old certificate would be served until it expired. The
    # one failure is made by replacing build_context for one call (a stand-in: running a
    # real process out of descriptors at the right moment is not reliable in a test).
    from epguard.webhook.admission import tls

    old, new = issue(make_ca()), issue(make_ca())
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    write_pair(old, cert, key)
    results: list[bool] = []
    reloading = tls.ReloadingTLS(str(cert), str(key), on_reload=results.append)
    write_pair(new, cert, key)
    real = tls.build_context
    calls = []

    def fails_once(*args: str | None) -> object:
        calls.append(args)
        if len(calls) == 1:
            raise tls.TLSReloadError("cannot load certificate: [Errno 24] Too many open files")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(tls, "build_context", fails_once)
    assert reloading.check() is False
    assert reloading.check() is True  # the same files, loaded on the next tick
    assert reloading.generation == 1 and results == [False, True]
    assert reloading.check() is False and len(calls) == 2  # nothing new: not loaded again


def test_a_bad_pair_is_reported_once_while_it_is_retried(tmp_path: Path) -> None:
    from epguard.webhook.admission.tls import ReloadingTLS

    a, b = issue(make_ca()), issue(make_ca())
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    write_pair(a, cert, key)
    results: list[bool] = []
    reloading = ReloadingTLS(str(cert), str(key), on_reload=results.append)
    cert.write_bytes(b.cert_pem)  # b's certificate with a's key: never loads
    assert [reloading.check() for _ in range(3)] == [False, False, False]
    assert results == [False]
    key.write_bytes(b.key_pem)  # the pair completes
    assert reloading.check() is True and results == [False, True]
