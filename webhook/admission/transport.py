"""Transport layer: one admission path as an ASGI endpoint on the FastAPI app.

It checks the content type, reads the body (bounded, on ``Content-Length`` and while
streaming), parses it once straight from bytes (msgspec) and validates only the
AdmissionReview envelope (pydantic, on the decoded dict: the object inside is a whole
Kubernetes object that the engine walks leniently), then hands the review to
completion. Bad input is the client's problem: ``4xx {"error": ...}``, never a 500.
The :class:`~webhook.completion.Answer` is left in the ASGI scope for instrumentation.

**A review is never failed open because someone sent work.** Whoever can reach the
port can send reviews, so every way a review can go unjudged under load ends in an
answer by mode (``unjudged``, built by completion: a refusal under ``enforce``), never
in a 500 or a 413 that the API server's ``failurePolicy: Ignore`` would turn into an
admission. The limits, as controller-runtime's admission server would keep them:

* **Lanes.** Reviews up to ``INLINE_BYTES`` are judged on the event loop (a 10 KB
  elastic-EP pod takes well under a millisecond; a thread hop would cost more). Larger
  ones go to a lane: a small thread pool with a bounded number of places (running plus
  waiting). Rules-ConfigMap edits have a lane of their own (``RULES_LANE``: one thread,
  one waiting), whatever their size, because parsing a 1 MiB rules file takes up to ~0.4 s
  and ~20 MiB: a flood of them once filled the one shared pool and every large pod
  review behind them was a 500. Pod and workload reviews have ``PODS_LANE`` (two
  threads: with two cores more would only share the GIL; four waiting). A review that
  finds its lane full is not queued behind work it cannot overtake: it is answered by
  mode at once (reason ``busy``).
* **Deadline.** A review whose answer is not ready ``deadline`` seconds (well inside
  the webhook's ``timeoutSeconds``) after it was handed to a lane is answered by mode
  (reason ``deadline``); a job still waiting is cancelled, a running one finishes on its
  own (its work is bounded) and keeps its place and memory until then.
* **Memory.** Every review in flight is charged against one budget
  (``Limits.inflight_bytes``) from its first byte until its judgement ends: its body,
  plus, before it is decoded, an upper estimate of what decoding it makes
  (:func:`decoded_estimate`: dense JSON such as ``[{},{},...]`` is 24x its size as
  Python objects). A review the budget cannot hold now is answered by mode (``busy``);
  one it could never hold, by mode too (``too_large``). Either way it is not decoded.
* **Size.** A body over ``max_body_bytes`` is not buffered: its first ``PEEK_BYTES``
  are kept, the rest is read and dropped (the connection's body deadline in
  ``webhook/admission/protocol.py`` bounds how long), and the review is answered by mode from the
  request fields the API server writes before the objects (``peek_request``). Only a
  body that does not start like an AdmissionReview gets the 413 of old.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import ValidationError

from epguard.webhook.admission.completion import ANSWER, BAD_REQUEST, Answer, Review, problem
from epguard.webhook.engine.review import AdmissionReviewRequest

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_decode = msgspec.json.Decoder().decode
_validate = AdmissionReviewRequest.model_validate
_JSON_TYPES = (b"application/json;", b"application/json ")
# Reviews up to this size are judged on the event loop (measured: a 10 KB elastic-EP pod
# takes well under a millisecond); larger ones in a lane, under the deadline.
INLINE_BYTES = 64 * 1024
# What is kept of a body that is not buffered whole: the API server writes the request's
# uid, kind, namespace and operation before the objects, in the first few hundred bytes
# (a long userInfo with many groups and extra fields stays well inside 64 KiB).
PEEK_BYTES = 64 * 1024
# Set in the ASGI scope by the connection (webhook/admission/protocol.py): True when the client
# presented a certificate the client CA signed (tls.py).
CLIENT_CERT = "epguard.client_cert"


@dataclass(frozen=True, slots=True)
class LaneSpec:
    name: str
    threads: int
    waiting: int  # places beyond the running ones; a review finding none is answered


# Pods and workloads: two threads (two cores; more would only share the GIL), and four
# waiting, as many as the two threads can judge within the deadline at the worst
# measured cost of a large pod (~0.3 s under contention).
PODS_LANE = LaneSpec("pods", threads=2, waiting=4)
# Rules-ConfigMap edits: one thread (a 1 MiB rules file takes up to ~0.4 s and ~20 MiB
# to parse: engine/rules.py), one waiting; an admin's edit is rare, a stream of them is
# not an admin.
RULES_LANE = LaneSpec("rules", threads=1, waiting=1)


@dataclass(frozen=True, slots=True)
class Limits:
    # The body limit: settings.MAX_BODY_BYTES says how it is sized from what the API
    # server can send.
    max_body_bytes: int
    deadline: float = 3.0
    # settings.MAX_INFLIGHT_BYTES says how it is sized.
    inflight_bytes: int = 48 * 1024 * 1024
    # Answer only clients with a certificate the client CA signed (tls.py): the API
    # server, when it is given one. Anything else gets 403 before its body is read.
    require_client_cert: bool = False


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
            400, "too_deep", "request body is nested deeper than epguard decodes"
        ) from None
    try:
        review = _validate(decoded)
    except ValidationError as exc:
        raise _explain(exc) from None
    return Review(review.apiVersion, review.request)


def decoded_estimate(body: bytes) -> int:
    """An upper estimate, in bytes, of the Python objects decoding ``body`` makes.

    Measured with msgspec: a dict or list costs up to ~72 bytes plus ~8 per item, a
    small key or value string ~50; ``[{},{},...]`` is 24x its JSON, 150,000 env entries
    10x, a string of escaped ``<`` one sixth. Braces and separators inside strings are
    counted too, so it only ever overestimates. Four passes of ``bytes.count`` (C, a few
    ms for 19 MiB)."""
    containers = body.count(b"{") + body.count(b"[")
    items = body.count(b",") + body.count(b":")
    return 100 * containers + 50 * items


# -- the request fields of a body that is not decoded whole ---------------------------

_WS = frozenset(b" \t\r\n")
_PEEKED = ("uid", "kind", "namespace", "name", "operation", "subResource")


def _skip_ws(b: bytes, i: int) -> int:
    n = len(b)
    while i < n and b[i] in _WS:
        i += 1
    return i


def _string_end(b: bytes, i: int) -> int:
    """The index after the string that opens at ``b[i]`` (a quote); -1 if it is cut."""
    j = i + 1
    while True:
        j = b.find(b'"', j)
        if j < 0:
            return -1
        k = j - 1
        while b[k] == 0x5C:  # a quote after an odd number of backslashes is escaped
            k -= 1
        if (j - 1 - k) % 2 == 0:
            return j + 1
        j += 1


def _value_end(b: bytes, i: int) -> int:
    """The index after the JSON value that starts at ``b[i]``; -1 if it is cut."""
    if i >= len(b):
        return -1
    c = b[i]
    if c == 0x22:
        return _string_end(b, i)
    if c in (0x7B, 0x5B):  # { [
        depth = 0
        n = len(b)
        while i < n:
            c = b[i]
            if c == 0x22:
                i = _string_end(b, i)
                if i < 0:
                    return -1
                continue
            if c in (0x7B, 0x5B):
                depth += 1
            elif c in (0x7D, 0x5D):
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return -1
    j = i
    while j < len(b) and b[j] not in b",}] \t\r\n":
        j += 1
    return j if j < len(b) else -1


def _members(b: bytes, i: int, stop: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """The members of the object that opens at ``b[i]``, as key → value span, until a
    key in ``stop``, the object's end, or the end of what was kept."""
    out: dict[str, tuple[int, int]] = {}
    if i >= len(b) or b[i] != 0x7B:
        return out
    i += 1
    while True:
        i = _skip_ws(b, i)
        if i >= len(b) or b[i] != 0x22:
            return out
        end = _string_end(b, i)
        if end < 0:
            return out
        try:
            key = msgspec.json.decode(b[i:end])
        except msgspec.DecodeError:
            return out
        i = _skip_ws(b, end)
        if i >= len(b) or b[i] != 0x3A:  # :
            return out
        start = _skip_ws(b, i + 1)
        if not isinstance(key, str) or key in stop:
            if isinstance(key, str):
                out[key] = (start, start)
            return out
        end = _value_end(b, start)
        if end < 0:
            return out
        out[key] = (start, end)
        i = _skip_ws(b, end)
        if i >= len(b) or b[i] != 0x2C:  # ,
            return out
        i += 1


def peek_request(prefix: bytes) -> Review | None:
    """The envelope of a review from the first bytes of its body, without its objects:
    enough to answer it by mode (uid, kind, namespace, operation). None when they are
    not there, which the API server never does (it writes them first)."""
    b = prefix
    top = _members(b, _skip_ws(b, 0), stop=("request",))
    if "request" not in top:
        return None
    start, _ = top["request"]
    fields: dict[str, Any] = {}
    for key, (s, e) in _members(b, start, stop=("object", "oldObject")).items():
        if key in _PEEKED and e > s:
            try:
                fields[key] = msgspec.json.decode(b[s:e])
            except msgspec.DecodeError:
                continue
    api_version: Any = "admission.k8s.io/v1"
    if "apiVersion" in top:
        s, e = top["apiVersion"]
        try:
            api_version = msgspec.json.decode(b[s:e])
        except msgspec.DecodeError:
            return None
    try:
        review = _validate(
            {"apiVersion": api_version, "kind": "AdmissionReview", "request": fields}
        )
    except ValidationError:
        return None
    return Review(review.apiVersion, review.request)


# -- bounds shared by every endpoint --------------------------------------------------


class Budget:
    """Bytes of memory charged to the reviews in flight (thread-safe: a lane's thread
    gives back what its review held when its judgement ends)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.limit:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


class Lane:
    """A small thread pool with a bounded number of places (running plus waiting)."""

    def __init__(self, spec: LaneSpec) -> None:
        self.spec = spec
        self.places = spec.threads + spec.waiting
        self.held = 0
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(spec.threads, thread_name_prefix=f"epguard-{spec.name}")

    def submit(
        self, fn: Callable[[Review], Answer], review: Review, then: Callable[[], None]
    ) -> Future[Answer] | None:
        """The job's future, or None when every place is taken. ``then`` runs when the
        job ends (done, failed or cancelled), and frees its place."""
        with self._lock:
            if self.held >= self.places:
                return None
            self.held += 1

        def done(_: Future[Answer]) -> None:
            with self._lock:
                self.held -= 1
            then()

        job = self.pool.submit(fn, review)
        job.add_done_callback(done)
        return job


@dataclass
class Bounds:
    """What every admission endpoint of one app shares: the memory budget and lanes."""

    limits: Limits
    budget: Budget
    lanes: dict[str, Lane]

    @classmethod
    def make(cls, limits: Limits, lanes: tuple[LaneSpec, ...] = (PODS_LANE, RULES_LANE)) -> Bounds:
        return cls(limits, Budget(limits.inflight_bytes), {s.name: Lane(s) for s in lanes})


# What the endpoint is told to do with a review it cannot judge: reason, words → answer.
Unjudged = Callable[[Review, str, str], Answer]
# Which lane judges a parsed review: a lane's name ("pods" judges a review up to
# INLINE_BYTES on the loop instead), or INLINE for the loop whatever its size.
LaneOf = Callable[[Review], str]
INLINE = "inline"


def _headers(scope: Scope) -> tuple[bytes | None, bytes | None]:
    length = ctype = None
    for name, value in scope["headers"]:
        if name == b"content-length":
            length = value
        elif name == b"content-type":
            ctype = value
    return length, ctype


@dataclass
class Body:
    data: bytes  # the whole body, or only its first PEEK_BYTES when ``over`` is set
    charged: int  # bytes taken from the budget (given back when the review is done)
    over: str | None = None  # "too_large" (over the body limit) or "busy" (over budget)


async def read_body(scope: Scope, receive: Receive, limit: int, budget: Budget) -> Body:
    length, ctype = _headers(scope)
    # The API server sends application/json; a client that says nothing is read as JSON.
    if ctype is not None:
        lowered = ctype.lower()
        if not (lowered == b"application/json" or lowered.startswith(_JSON_TYPES)):
            raise BadReview(
                415, "content_type", f"Content-Type must be application/json, not {ctype!r}"
            )
    over: str | None = None
    charged = 0
    if length is not None:
        if not (length.isascii() and length.isdigit()):  # int() refuses "²"
            raise BadReview(400, "bad_length", "Content-Length is not a number")
        # int() refuses more than 4,300 digits (a 500 once): a length that long, leading
        # zeros aside, is over any limit.
        digits = length.lstrip(b"0") or b"0"
        declared = int(digits) if len(digits) <= 18 else limit + 1
        if declared > limit:
            over = "too_large"
        elif budget.take(declared):
            charged = declared
        else:
            over = "busy"
    chunks: list[bytes] = []
    size = 0
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # Nobody is left to answer; say 400 rather than let it surface as a 500.
                raise BadReview(400, "disconnected", "client disconnected before the body ended")
            chunk = message.get("body", b"")
            if over is not None:
                # Read and dropped; only the head of the body is kept, to answer by mode.
                if size < PEEK_BYTES:
                    chunks.append(chunk[: PEEK_BYTES - size])
                size += len(chunk)
            else:
                size += len(chunk)
                chunks.append(chunk)
                if size > limit:
                    over = "too_large"
                elif size > charged:
                    # No length given (chunked), or more than it said: charge as it comes.
                    if budget.take(size - charged):
                        charged = size
                    else:
                        over = "busy"
                if over is not None:  # from here on, read and dropped
                    chunks = [b"".join(chunks)[:PEEK_BYTES]]
                    budget.give(charged)
                    charged = 0
            if not message.get("more_body", False):
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                return Body(data, charged, over)
    except BaseException:
        budget.give(charged)
        raise


class AdmissionEndpoint:
    """The ASGI app of one admission path (mounted as a POST route)."""

    def __init__(
        self,
        complete: Callable[[Review], Answer],
        unjudged: Unjudged,
        bounds: Bounds,
        lane_of: LaneOf = lambda _review: PODS_LANE.name,
    ) -> None:
        self.complete = complete
        self.unjudged = unjudged
        self.bounds = bounds
        self.lane_of = lane_of

    async def answer(self, scope: Scope, receive: Receive) -> Answer:
        bounds = self.bounds
        limit = bounds.limits.max_body_bytes
        if bounds.limits.require_client_cert and scope.get(CLIENT_CERT) is not True:
            return problem(
                403,
                BAD_REQUEST,
                "no_client_cert",
                "epguard answers admission reviews only from clients with a certificate "
                "its client CA signed (the API server)",
            )
        try:
            body = await read_body(scope, receive, limit, bounds.budget)
        except BadReview as bad:
            return problem(bad.status, BAD_REQUEST, bad.reason, bad.message)
        charged = body.charged
        handed_over = False
        try:
            if body.over is None:
                # What decoding will make is charged before it is made.
                extra = decoded_estimate(body.data)
                if bounds.budget.take(extra):
                    charged += extra
                else:
                    body.over = (
                        "too_large" if extra + charged > bounds.limits.inflight_bytes else "busy"
                    )
            if body.over is not None:
                return self._over(body)
            try:
                review = parse_review(body.data)
            except BadReview as bad:
                peeked = peek_request(body.data[:PEEK_BYTES]) if bad.reason == "too_deep" else None
                if peeked is not None:
                    # A review the API server sent (custom resources with unknown fields
                    # may nest past msgspec's 1,000 levels), not one epguard can read: a
                    # 400 there was an admission under failurePolicy Ignore.
                    return self.unjudged(peeked, "too_deep", bad.message)
                return problem(bad.status, BAD_REQUEST, bad.reason, bad.message)
            size = len(body.data)
            del body  # the decoded review is what the judgement holds from here on
            lane = self.lane_of(review)
            if lane == INLINE or (lane == PODS_LANE.name and size <= INLINE_BYTES):
                return self.complete(review)
            release = _giver(bounds.budget, charged)
            job = bounds.lanes[lane].submit(self.complete, review, release)
            if job is None:
                return self.unjudged(
                    review,
                    "busy",
                    f"every place in epguard's {lane} lane is taken "
                    f"({bounds.lanes[lane].places} reviews in progress)",
                )
            handed_over = True
            try:
                return await asyncio.wait_for(asyncio.wrap_future(job), bounds.limits.deadline)
            except TimeoutError:
                # A job still waiting is dropped; a running one finishes on its own (its
                # work is bounded) and frees its place and memory then.
                job.cancel()
                return self.unjudged(
                    review, "deadline", f"not judged within {bounds.limits.deadline:g} s"
                )
        finally:
            if not handed_over:
                bounds.budget.give(charged)

    def _over(self, body: Body) -> Answer:
        limit = self.bounds.limits
        if body.over == "too_large":
            words = (
                f"the review is larger than epguard judges ({limit.max_body_bytes} bytes of "
                f"body, {limit.inflight_bytes} bytes in memory)"
            )
            status, reason = 413, "too_large"
        else:
            words = "epguard's memory for reviews in flight is taken by other reviews"
            status, reason = 429, "busy"
        peeked = peek_request(body.data)
        if peeked is None:
            # Not the start of an AdmissionReview: no API server sent it.
            return problem(status, BAD_REQUEST, reason, f"request refused: {words}")
        return self.unjudged(peeked, reason, words)

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


def _giver(budget: Budget, n: int) -> Callable[[], None]:
    return lambda: budget.give(n)
