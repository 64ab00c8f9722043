"""Large reviews are judged off the event loop, in bounded lanes, under a deadline
(webhook/admission/transport.py); one that cannot be judged is answered by mode, never a 500.

The slow decision here is a test double (a completion that sleeps): the real engine's
work is bounded, so making it slow on purpose is the only way to see the deadline act.
What is real: the transport layer, its lanes and the event loop it must not hold. The
same bounds through the real webhook process: test_unjudged_by_mode.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from epguard.webhook.admission.completion import Answer, Review, unjudged
from epguard.webhook.admission.transport import INLINE_BYTES, AdmissionEndpoint, Bounds, Limits
from tests.factory import container, pod, review


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


def _enforce(r: Review, reason: str, why: str) -> Answer:
    return unjudged(r, reason, why, endpoint="validate", mode="enforce", rules_edit=False)


def _endpoint(complete: Callable[[Review], Answer], deadline: float = 3.0) -> AdmissionEndpoint:
    return AdmissionEndpoint(complete, _enforce, Bounds.make(Limits(8 << 20, deadline)))


async def test_a_large_review_not_judged_in_time_is_refused_under_enforce_not_a_500() -> None:
    endpoint = _endpoint(_slow(2.0), deadline=0.3)
    body = _body(INLINE_BYTES * 4)
    start = time.monotonic()
    answer = await endpoint.answer(_scope(body), _receive(body))
    took = time.monotonic() - start
    assert (answer.status, answer.result, answer.unjudged) == (200, "denied", "deadline")
    response = json.loads(answer.body)["response"]
    assert response["allowed"] is False
    assert (
        "could not judge this request (not judged within 0.3 s)" in (response["status"]["message"])
    )
    assert took < 1.5


async def test_a_slow_large_review_does_not_hold_up_small_ones() -> None:
    slow, fast = _slow(1.0), _slow(0.0)

    def complete(r: Review) -> Answer:
        big = len(json.dumps(r.request.object)) > INLINE_BYTES
        return (slow if big else fast)(r)

    endpoint = _endpoint(complete)
    big, small = _body(INLINE_BYTES * 4), _body(2000)
    pending = asyncio.create_task(endpoint.answer(_scope(big), _receive(big)))
    await asyncio.sleep(0.05)  # the big one is now in its lane
    start = time.monotonic()
    answer = await endpoint.answer(_scope(small), _receive(small))
    assert answer.status == 200 and time.monotonic() - start < 0.5
    assert not pending.done()
    assert (await pending).status == 200


async def test_a_small_review_is_judged_inline() -> None:
    seen: list[str] = []

    def complete(r: Review) -> Answer:
        seen.append(threading.current_thread().name)
        return Answer(200, b"{}", "allowed", request=r.request)

    endpoint = _endpoint(complete)
    body = _body(2000)
    assert len(body) <= INLINE_BYTES
    await endpoint.answer(_scope(body), _receive(body))
    big = _body(INLINE_BYTES * 2)
    await endpoint.answer(_scope(big), _receive(big))
    assert seen[0] == "MainThread" and seen[1].startswith("epguard-pods")


async def test_a_full_lane_answers_at_once_by_mode_instead_of_queueing() -> None:
    endpoint = _endpoint(_slow(1.0), deadline=5.0)
    places = endpoint.bounds.lanes["pods"].places
    big = _body(INLINE_BYTES * 2)
    held = [asyncio.create_task(endpoint.answer(_scope(big), _receive(big))) for _ in range(places)]
    await asyncio.sleep(0.05)
    start = time.monotonic()
    answer = await endpoint.answer(_scope(big), _receive(big))
    assert (answer.result, answer.unjudged) == ("denied", "busy")
    assert time.monotonic() - start < 0.5
    assert all(a.status == 200 and a.unjudged is None for a in await asyncio.gather(*held))


async def test_the_memory_of_a_review_is_given_back_when_its_judgement_ends() -> None:
    endpoint = _endpoint(_slow(0.6), deadline=0.1)
    big = _body(INLINE_BYTES * 2)
    answer = await endpoint.answer(_scope(big), _receive(big))
    assert answer.unjudged == "deadline"
    assert endpoint.bounds.budget.held > 0  # the thread still judges it
    await asyncio.sleep(1.0)
    assert endpoint.bounds.budget.held == 0
    assert endpoint.bounds.lanes["pods"].held == 0
