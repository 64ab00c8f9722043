"""Request heads over real TLS: an oversized head gets 431 and loses its connection, a
client that never finishes its head is cut after the head deadline, and reviews from
other connections are answered meanwhile."""

from __future__ import annotations

import contextlib
import json
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


def read_responses(sock: ssl.SSLSocket, n: int) -> bytes:
    """``n`` whole responses (head and Content-Length body), or fail within 5 s."""
    sock.settimeout(5)
    got = b""
    while True:
        rest, whole = got, 0
        while b"\r\n\r\n" in rest:
            head, rest = rest.split(b"\r\n\r\n", 1)
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            if len(rest) < length:
                break
            rest, whole = rest[length:], whole + 1
        if whole >= n:
            return got
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk


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


def test_pipelined_requests_past_the_limit_cut_the_connection(bounded: RunningServer) -> None:
    # One read of 200 pipelined requests once queued them all (10,484 from 256 KiB).
    before = cut_count(bounded, "pipeline")
    sock = tls_socket(bounded)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n" * 200)
    answer = read_all(sock, within=HEAD_SECONDS * 5)
    assert answer.count(b"HTTP/1.1 ") <= 6, answer.count(b"HTTP/1.1 ")
    assert cut_count(bounded, "pipeline") == before + 1


def test_a_few_pipelined_requests_are_all_answered(bounded: RunningServer) -> None:
    sock = tls_socket(bounded)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n" * 3)
    assert read_responses(sock, 3).count(b"HTTP/1.1 200") == 3
    sock.close()


def test_a_second_head_in_the_same_read_is_bounded_in_size(bounded: RunningServer) -> None:
    # The first request's answer once left the second head unbounded: 200 KiB went in
    # against a 1 KiB limit.
    before = cut_count(bounded, "head_size")
    sock = tls_socket(bounded)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\nGET /healthz HTTP/1.1\r\nx-a: ")
    try:
        for _ in range(64):
            sock.sendall(b"a" * 4000)
    except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
        pass
    answer = read_all(sock, within=5)
    assert b"431" in answer, answer[:200]
    assert cut_count(bounded, "head_size") == before + 1


def test_a_second_head_in_the_same_read_is_bounded_in_time(bounded: RunningServer) -> None:
    before = cut_count(bounded, "head_deadline")
    sock = tls_socket(bounded)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\nGET /healthz HTTP/1.1\r\nx-a: b")
    answer = read_all(sock, within=HEAD_SECONDS * 5)  # closed, or the read times out
    assert answer.count(b"HTTP/1.1 200") == 1, answer[:200]
    assert cut_count(bounded, "head_deadline") == before + 1


def test_blank_lines_after_a_request_do_not_hold_the_connection_open(
    bounded: RunningServer,
) -> None:
    # They cancel uvicorn's keep-alive timer and begin no request: such a socket once
    # stayed open for good.
    before = cut_count(bounded, "idle")
    sock = tls_socket(bounded)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    assert read_responses(sock, 1).startswith(b"HTTP/1.1 200")
    sock.sendall(b"\r\n")
    assert read_all(sock, within=HEAD_SECONDS * 5) == b""
    assert cut_count(bounded, "idle") == before + 1


def chunked_head(path: str = "/validate") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()


def test_a_trailer_is_bounded_like_a_head(bounded: RunningServer) -> None:
    # 16 MiB of trailer once went in against the head limit.
    before = cut_count(bounded, "body_framing")
    sock = tls_socket(bounded)
    sock.sendall(chunked_head() + b"2\r\n{}\r\n0\r\nx-t: ")
    try:
        for _ in range(64):
            sock.sendall(b"a" * 4000)
    except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
        pass
    assert read_all(sock, within=5) == b""
    assert cut_count(bounded, "body_framing") == before + 1


def test_a_body_in_one_byte_chunks_is_cut(bounded: RunningServer) -> None:
    before = cut_count(bounded, "body_chunks")
    sock = tls_socket(bounded)
    sock.sendall(chunked_head() + b"1\r\n \r\n" * 4000)
    assert read_all(sock, within=5) == b""
    assert cut_count(bounded, "body_chunks") == before + 1


def test_a_review_in_ordinary_chunks_is_judged(bounded: RunningServer) -> None:
    body = json.dumps(review(pod())).encode()
    pieces = [body[i : i + 1024] for i in range(0, len(body), 1024)]
    with bounded.client() as client:
        r = client.post(
            "/validate",
            content=iter(pieces),
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 200 and r.json()["response"]["allowed"] is False


def test_a_content_length_of_thousands_of_digits_is_refused_not_a_500(
    bounded: RunningServer,
) -> None:
    # int() refuses more than 4,300 digits: such a length was a 500 with a traceback.
    sock = tls_socket(bounded)
    length = b"0" * 5000 + b"1"
    sock.sendall(
        b"POST /validate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + length + b"\r\n\r\n{"
    )
    answer = read_responses(sock, 1)  # the length is 1, and "{" is no review
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"not valid JSON" in answer
