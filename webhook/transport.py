"""Transport layer: one admission path as an ASGI endpoint on the FastAPI app.

It checks the content type, reads the body (bounded, on ``Content-Length`` and while
streaming), parses it once straight from bytes (msgspec) and validates only the
AdmissionReview envelope (pydantic, on the decoded dict: the object inside is a whole
Kubernetes object that the engine walks leniently), then hands the review to
completion. Bad input is the client's problem: ``4xx {"error": ...}``, never a 500.
The :class:`~webhook.completion.Answer` is left in the ASGI scope for instrumentation.

Large reviews are judged off the event loop, with a deadline. Every review's work is
bounded (the reader's budget), but a pod of 48 containers with 62 KB scripts once held
the loop for seconds and every other review in that window timed out and failed open.
A review over ``INLINE_BYTES`` is judged on a small thread pool; if the answer is not
ready within ``deadline`` seconds (well inside the webhook's ``timeoutSeconds``) the
reply is a 500, so the API server applies the admin's failurePolicy instead of the
webhook silently timing out, and ``epguard_bad_requests_total{reason="deadline"}``
counts it. Small reviews (nearly all) are judged inline: a thread hop would cost more
than their whole decision.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from pydantic import ValidationError

from webhook.completion import ANSWER, BAD_REQUEST, ERROR, Answer, Review, problem
from webhook.review import AdmissionReviewRequest

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_decode = msgspec.json.Decoder().decode
_validate = AdmissionReviewRequest.model_validate
_JSON_TYPES = (b"application/json;", b"application/json ")
# Reviews up to this size are judged on the event loop (measured: a 10 KB elastic-EP pod
# takes well under a millisecond); larger ones on the pool, under the deadline.
INLINE_BYTES = 64 * 1024
# Threads for large reviews: with two cores more would only share the GIL; a burst
# beyond them waits its turn, and the deadline still bounds each answer.
POOL_THREADS = 2


class BadReview(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


def _explain(exc: ValidationError) -> BadReview:
    errors = exc.errors(include_url=False, include_input=False)
    if any(e["type"] == "model_type" and not e["loc"] for e in errors):
        return BadReview(
            400, "not_object", "request body must be a JSON object (an AdmissionReview)"
        )
    for e in errors:
        if e["loc"] == ("request",) and e["type"] == "missing":
            return BadReview(400, "no_request", "AdmissionReview has no 'request'")
        if e["loc"] == ("apiVersion",):
            return BadReview(
                400, "api_version", "apiVersion must be admission.k8s.io/v1 (or v1beta1)"
            )
        if e["loc"] == ("kind",):
            return BadReview(400, "kind", "kind must be AdmissionReview")
    shown = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:5]
    )
    return BadReview(400, "invalid_review", f"not a valid AdmissionReview: {shown}")


def parse_review(body: bytes) -> Review:
    """The envelope of an AdmissionReview, or BadReview saying what is wrong with it."""
    try:
        decoded = _decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadReview(400, "not_json", f"request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise BadReview(
            400, "not_json", "request body is not valid JSON (recursion limit exceeded)"
        ) from None
    try:
        review = _validate(decoded)
    except ValidationError as exc:
        raise _explain(exc) from None
    return Review(review.apiVersion, review.request)


def _headers(scope: Scope) -> tuple[bytes | None, bytes | None]:
    length = ctype = None
    for name, value in scope["headers"]:
        if name == b"content-length":
            length = value
        elif name == b"content-type":
            ctype = value
    return length, ctype


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    length, ctype = _headers(scope)
    # The API server sends application/json; a client that says nothing is read as JSON.
    if ctype is not None:
        lowered = ctype.lower()
        if not (lowered == b"application/json" or lowered.startswith(_JSON_TYPES)):
            raise BadReview(
                415, "content_type", f"Content-Type must be application/json, not {ctype!r}"
            )
    if length is not None:
        if not length.isdigit():
            raise BadReview(400, "bad_length", "Content-Length is not a number")
        if int(length) > limit:
            raise BadReview(413, "too_large", f"request body is larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            # Nobody is left to answer; say 400 rather than let it surface as a 500.
            raise BadReview(400, "disconnected", "client disconnected before the body ended")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadReview(413, "too_large", f"request body is larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class AdmissionEndpoint:
    """The ASGI app of one admission path (mounted as a POST route)."""

    def __init__(
        self,
        complete: Callable[[Review], Answer],
        max_body_bytes: int,
        deadline: float = 3.0,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        self.complete = complete
        self.max_body_bytes = max_body_bytes
        self.deadline = deadline
        self.pool = pool or ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="epguard-judge")

    async def answer(self, scope: Scope, receive: Receive) -> Answer:
        try:
            body = await read_body(scope, receive, self.max_body_bytes)
            review = parse_review(body)
        except BadReview as bad:
            return problem(bad.status, BAD_REQUEST, bad.reason, bad.message)
        if len(body) <= INLINE_BYTES:
            return self.complete(review)
        job = asyncio.get_running_loop().run_in_executor(self.pool, self.complete, review)
        try:
            return await asyncio.wait_for(asyncio.shield(job), self.deadline)
        except TimeoutError:
            # The thread finishes on its own (its work is bounded); nobody waits for it.
            uid = review.request.uid
            return problem(
                500,
                ERROR,
                "deadline",
                f"epguard could not judge request {uid} within {self.deadline:g} s; "
                "the webhook's failurePolicy applies",
                review.request,
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = await self.answer(scope, receive)
        scope[ANSWER] = answer
        await send(
            {
                "type": "http.response.start",
                "status": answer.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(answer.body)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": answer.body})
