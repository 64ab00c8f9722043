"""The HTTP connection, bounded before any request reaches the app.

uvicorn's httptools protocol keeps reading a request head for as long as the client
sends one (a 64 MiB header once held every review for 4.9 s while it was parsed and
stored), and a connection that never finishes its head stays open forever (50 slow
sockets did). The API server sends a head of a few hundred bytes at once, so this
protocol cuts both:

* a head (request line and headers) over ``max_head_bytes`` is answered 431 and the
  connection closed: counted as it is fed while the head is unfinished (so a huge
  header is cut before the parser has buffered much more than the limit), and as the
  parser hands over URL and headers (a head that arrives whole in one read);
* a head not complete ``head_seconds`` after the connection opened, or after the first
  byte of a keep-alive connection's next request, closes the connection.

* a body not complete ``body_seconds`` after its head ended closes the connection
  (30 sockets sending a byte a second once stayed open for good): the whole body, not
  the gap between two reads, so a trickle cannot keep it alive.

* what the head state is comes from the parser's own callbacks only (a request begun,
  its head complete, its message complete), never from a response: a second head sent
  in the same read as the first once escaped both the size limit and the deadline
  while the first was answered;
* a connection with nothing in progress that sends bytes which begin no request (blank
  lines between requests cancel uvicorn's keep-alive timer) is cut ``head_seconds``
  later, like an unfinished head (such a socket once stayed open for good);
* at most ``max_pipelined`` requests may wait behind the one being answered: the API
  server never pipelines, and 256 KiB of ``GET /metrics`` in one read once queued
  10,484 requests (26 MiB) from a single connection;
* a body's framing (chunk sizes, extensions, trailers: the bytes of a message that
  are not its body) is at most ``max_head_bytes`` plus 64 bytes a chunk (16 MiB of
  trailer once went past the head limit, copied quadratically by the parser), and a
  body of more than ``chunk_grace`` pieces must average ``min_chunk_bytes`` a piece
  (one-byte chunks cost the event loop 48 ms a MiB, 40x 64 KiB ones).

The body's size is bounded by the app (transport.py). Each cut is counted through
``on_cut`` with its reason ("head_size", "head_deadline", "body_deadline", "idle",
"pipeline", "body_framing" or "body_chunks").

Not bounded here: the TLS handshake, which asyncio gives 60 s (uvicorn has no setting
for it) before ``connection_made``, so the head deadline counts from the handshake's end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from epguard.webhook.admission.transport import CLIENT_CERT


@dataclass(frozen=True, slots=True)
class HeadLimits:
    # 64 KiB: 30x the largest head an API server sends (bearer token, audit IDs), and
    # what one chunk of a socket read can hold, so the count is never far behind.
    max_head_bytes: int = 64 * 1024
    # 10 s: the API server writes its head in one go; its own timeout for the whole
    # call is timeoutSeconds (at most 30 s).
    head_seconds: float = 10.0
    # 10 s for the whole body: the API server writes it at once (19 MiB, the largest
    # review it can send, takes well under a second inside a cluster), and gives up on
    # the whole call after timeoutSeconds (5 s by default, at most 30 s) anyway.
    body_seconds: float = 10.0
    # 4: the API server sends one request at a time on a connection (Go's net/http does
    # not pipeline); a client that does may queue a few.
    max_pipelined: int = 4
    # A body in more than 1,024 pieces (chunks, or reads of a Content-Length body) must
    # average 256 bytes a piece: the API server's TLS records are 1-16 KiB.
    chunk_grace: int = 1024
    min_chunk_bytes: int = 256


class Cut(Exception):
    """Raised inside a parser callback to stop parsing: the connection is cut."""


_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: 34\r\n"
    b"connection: close\r\n\r\n"
    b"epguard: request head over limit\r\n"
)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(
        self,
        *args: Any,
        limits: HeadLimits,
        on_cut: Callable[[str], None] = lambda _reason: None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.on_cut = on_cut
        self._in_head = True  # a head is being read (from the connection's start)
        self._in_body = False  # between a head's end and its message's end
        self._head_bytes = 0  # bytes fed since this head began (an unfinished head)
        self._parsed = 0  # the head's URL and header bytes the parser handed over
        self._framing = 0  # bytes of this message after its head that were not body
        self._pieces = 0  # on_body calls of this message
        self._body_bytes = 0
        self._cut_reason: str | None = None  # set before a Cut is raised
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._client_cert = False  # the peer presented a certificate the client CA signed

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.limits.head_seconds, self._head_deadline)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _idle(self) -> bool:
        """Nothing in progress: no request being read, answered or waiting."""
        cycle = self.cycle
        return (
            not self._in_head
            and not self._in_body
            and (cycle is None or cycle.response_complete)
            and not self.pipeline
        )

    def _head_deadline(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._in_head:
            self._cut("head_deadline")
        elif self._idle():
            self._cut("idle")

    def _cut(self, reason: str) -> None:
        if self.transport.is_closing():
            return
        self.on_cut(reason)
        if reason == "head_size":
            self.transport.write(_431)
        self.transport.close()

    def _disarm_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_deadline(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing():
            self.on_cut("body_deadline")
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # After the handshake: a certificate is only there if the client CA verified it.
        ssl_object = transport.get_extra_info("ssl_object")
        self._client_cert = bool(ssl_object is not None and ssl_object.getpeercert())
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_body()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        elif self._in_body:
            self._framing += len(data)  # on_body takes the body's part back out
        super().data_received(data)
        if self.transport.is_closing():
            return
        limits = self.limits
        # Checked after the parser ran: a chunk that ends the head and carries body
        # bytes leaves the head state, and only a head still open past the limit is cut.
        if self._in_head and self._head_bytes > limits.max_head_bytes:
            self._cut("head_size")
        elif self._in_body:
            if self._framing > limits.max_head_bytes + 64 * self._pieces:
                self._cut("body_framing")
            elif (
                self._pieces > limits.chunk_grace
                and self._body_bytes < self._pieces * limits.min_chunk_bytes
            ):
                self._cut("body_chunks")
        elif self._head_timer is None and self.timeout_keep_alive_task is None and self._idle():
            # Bytes that began no request (blank lines) cancelled the keep-alive timer.
            self._arm()

    def _stop(self, reason: str) -> None:
        # Raising inside a parser callback stops the parser mid-read; uvicorn then answers
        # 400 through send_400_response, which cuts the connection instead.
        self._cut_reason = reason
        raise Cut(reason)

    def _count(self, n: int) -> None:
        # A head that arrives whole in one read never stays "in head" after a feed; its
        # parsed size is checked here (trailers are counted too: the same callback).
        self._parsed += n
        if self._parsed > self.limits.max_head_bytes:
            self._stop("head_size")

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._cut_reason is None:
            super().send_400_response(msg)
            return
        self._cut(self._cut_reason)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._parsed = 0
        if not self._in_head or self._head_timer is None:
            # The next request on a keep-alive connection (or after blank lines): its
            # head deadline counts from its first byte.
            self._in_head = True
            self._head_bytes = 0
            self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        self._head_bytes = 0
        self._framing = self._pieces = self._body_bytes = 0
        self._disarm()
        self._disarm_body()
        self._body_timer = self.loop.call_later(self.limits.body_seconds, self._body_deadline)
        self.scope[CLIENT_CERT] = self._client_cert  # type: ignore[literal-required]
        super().on_headers_complete()
        if len(self.pipeline) > self.limits.max_pipelined:
            self._stop("pipeline")

    def on_body(self, body: bytes) -> None:
        self._pieces += 1
        self._body_bytes += len(body)
        self._framing -= len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm_body()
        super().on_message_complete()
