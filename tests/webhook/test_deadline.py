"""Large reviews are judged off the event loop under a deadline (webhook/transport.py).

The slow decision here is a test double (a completion that sleeps): the real engine's
work is bounded, so making it slow on purpose is the only way to see the deadline act.
What is real: the transport layer, its thread pool and the event loop it must not hold.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from webhook_factory import container, pod, review

from webhook.completion import ERROR, Answer, Review
from webhook.transport import INLINE_BYTES, AdmissionEndpoint


def _receive(body: bytes) -> Callable[[], Any]:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def _scope(body: bytes) -> dict[str, Any]:
    return {"headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]}  # fmt: skip


def _body(size: int) -> bytes:
    pad = max(0, size - 600)
    return json.dumps(review(pod([container(args=["x" * pad])]))).encode()


def _slow(seconds: float) -> Callable[[Review], Answer]:
    def complete(r: Review) -> Answer:
        time.sleep(seconds)
        return Answer(200, b"{}", "allowed", request=r.request)

    return complete


async def test_a_large_review_not_judged_in_time_is_an_error_for_the_failure_policy() -> None:
    endpoint = AdmissionEndpoint(_slow(2.0), 8 * 1024 * 1024, deadline=0.3)
    body = _body(INLINE_BYTES * 4)
    start = time.monotonic()
    answer = await endpoint.answer(_scope(body), _receive(body))
    took = time.monotonic() - start
    assert (answer.status, answer.result, answer.reason) == (500, ERROR, "deadline")
    assert "within 0.3 s" in (answer.detail or "")
    assert took < 1.5


async def test_a_slow_large_review_does_not_hold_up_small_ones() -> None:
    slow, fast = _slow(1.0), _slow(0.0)

    def complete(r: Review) -> Answer:
        big = len(json.dumps(r.request.object)) > INLINE_BYTES
        return (slow if big else fast)(r)

    endpoint = AdmissionEndpoint(complete, 8 * 1024 * 1024, deadline=3.0)
    big, small = _body(INLINE_BYTES * 4), _body(2000)
    pending = asyncio.create_task(endpoint.answer(_scope(big), _receive(big)))
    await asyncio.sleep(0.05)  # the big one is now on the pool
    start = time.monotonic()
    answer = await endpoint.answer(_scope(small), _receive(small))
    assert answer.status == 200 and time.monotonic() - start < 0.5
    assert not pending.done()
    assert (await pending).status == 200


async def test_a_small_review_is_judged_inline() -> None:
    seen: list[str] = []

    def complete(r: Review) -> Answer:
        import threading

        seen.append(threading.current_thread().name)
        return Answer(200, b"{}", "allowed", request=r.request)

    endpoint = AdmissionEndpoint(complete, 8 * 1024 * 1024)
    body = _body(2000)
    assert len(body) <= INLINE_BYTES
    await endpoint.answer(_scope(body), _receive(body))
    big = _body(INLINE_BYTES * 2)
    await endpoint.answer(_scope(big), _receive(big))
    assert seen[0] == "MainThread" and seen[1].startswith("epguard-judge")
