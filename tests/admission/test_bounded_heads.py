"""Request heads over real TLS: an oversized head gets 431 and loses its connection, a
client that never finishes its head is cut after the head deadline, and reviews from
other connections are answered meanwhile."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factory import TEST_RULES, pod, review
from tests.servers import RunningServer, running_server

HEAD_SECONDS = 1.0


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(
        tmp_path_factory.mktemp("bounded"),
        TEST_RULES,
        max_head_bytes=16 * 1024,
        head_timeout_seconds=HEAD_SECONDS,
    ) as s:
        yield s


def tls_socket(server: RunningServer) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return server.ssl_context().wrap_socket(raw, server_hostname="localhost")


def read_all(sock: ssl.SSLSocket, within: float) -> bytes:
    """Everything the server sends until it closes (b"" read), or fail after ``within``."""
    sock.settimeout(within)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, ssl.SSLError):
            return out
        if not chunk:
            return out
        out += chunk


def cut_count(server: RunningServer, reason: str) -> float:
    with server.client() as client:
        text = client.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(f'epguard_connections_cut_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_an_oversized_head_is_a_431_and_the_connection_closes(bounded: RunningServer) -> None:
    before = cut_count(bounded, "head_size")
    sock = tls_socket(bounded)
    sock.sendall(b"POST /validate HTTP/1.1\r\nhost: x\r\n")
    filler = b"x-filler: " + b"a" * 4000 + b"\r\n"
    try:
        for _ in range(64):  # up to 256 KiB of headers, never ending the head
            sock.sendall(filler)
    except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
        pass  # the server closed while we were still sending: that is the point
    answer = read_all(sock, within=5)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]
    assert cut_count(bounded, "head_size") == before + 1


def test_a_head_left_unfinished_is_cut_after_the_deadline(bounded: RunningServer) -> None:
    before = cut_count(bounded, "head_deadline")
    sock = tls_socket(bounded)
    sock.sendall(b"POST /validate HTTP/1.1\r\nhost: x\r\n")  # and then nothing
    started = time.monotonic()
    assert read_all(sock, within=HEAD_SECONDS * 5) == b""
    assert time.monotonic() - started < HEAD_SECONDS * 4
    assert cut_count(bounded, "head_deadline") == before + 1


def test_a_connection_that_sends_nothing_is_cut_too(bounded: RunningServer) -> None:
    sock = tls_socket(bounded)
    assert read_all(sock, within=HEAD_SECONDS * 5) == b""


def test_reviews_are_answered_while_slow_clients_hold_connections(
    bounded: RunningServer,
) -> None:
    slow = [tls_socket(bounded) for _ in range(20)]
    for s in slow:
        s.sendall(b"POST /validate HTTP/1.1\r\n")
    stop = threading.Event()

    def trickle() -> None:  # one header byte at a time, as a slowloris does
        while not stop.is_set():
            for s in slow:
                with contextlib.suppress(OSError):
                    s.sendall(b"x")
            time.sleep(0.05)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        with bounded.client() as client:
            r = client.post("/validate", json=review(pod()))
        assert r.status_code == 200 and r.json()["response"]["allowed"] is False
    finally:
        stop.set()
        t.join()
    # The trickling ones were cut at the head deadline, one byte every 50 ms or not.
    for s in slow:
        assert read_all(s, within=HEAD_SECONDS * 5) == b""


def test_keep_alive_requests_with_normal_heads_are_unaffected(bounded: RunningServer) -> None:
    with bounded.client() as client:
        for _ in range(3):
            r = client.post("/validate", json=review(pod()))
            assert r.status_code == 200
            time.sleep(HEAD_SECONDS * 1.5)  # idle longer than the head deadline: keep-alive


def test_the_limits_are_settings(tmp_path: Path) -> None:
    with running_server(tmp_path, TEST_RULES, max_head_bytes=2048) as small:
        with small.client() as client:
            r = client.post("/validate", json=review(pod()), headers={"x-pad": "a" * 4000})
        assert r.status_code == 431
