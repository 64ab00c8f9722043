"""Completion layer: a parsed review and a handler → the :class:`Answer` to send.

It echoes the request's ``uid`` and ``apiVersion``, encodes the outcome as an
AdmissionReview response, and recovers from a handler that raises. A failure inside
epguard must never read as a decision: it is answered ``500``, because the API server
treats any non-2xx answer as a failed call and applies the webhook's ``failurePolicy``
(``Ignore``: admit unchecked; ``Fail``: refuse), while any AdmissionReview it gets back,
even ``allowed: false`` with a 5xx status code inside, is a decision it obeys whatever
the policy (k8s.io/apiserver, webhook/validating/dispatcher.go: ``ErrCallingWebhook``
vs ``ErrWebhookRejection``). So the chart's ``webhook.failurePolicy`` decides, as the
admin chose. The answer's ``result`` is ``error``; instrumentation counts it.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from webhook.handler import Handler, Outcome
from webhook.review import AdmissionRequest

log = logging.getLogger("epguard.admission")

# Where transport leaves the Answer in the ASGI scope, for instrumentation to read.
ANSWER = "epguard.answer"
ERROR = "error"  # the result of a request epguard failed to judge
BAD_REQUEST = "bad_request"  # the result of a request refused as malformed

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Review:
    """The validated envelope of an AdmissionReview."""

    api_version: str
    request: AdmissionRequest


@dataclass(frozen=True, slots=True)
class Answer:
    status: int  # HTTP status
    body: bytes
    result: str  # the handler's result, ``error`` or ``bad_request``
    outcome: Outcome | None = None
    request: AdmissionRequest | None = None
    reason: str | None = None  # why a request was refused or failed (a bounded word)
    detail: str | None = None  # the same, in words


def problem(
    status: int, result: str, reason: str, message: str, request: AdmissionRequest | None = None
) -> Answer:
    """An answer that is not a review: ``{"error": message}`` with a 4xx or 5xx status."""
    body = _encode({"error": message})
    return Answer(status, body, result, request=request, reason=reason, detail=message)


def encode(api_version: str, uid: str, o: Outcome) -> bytes:
    response: dict[str, Any] = {"uid": uid, "allowed": o.allowed}
    if not o.allowed:
        response["status"] = {
            "code": 403,
            "reason": "Forbidden",
            "message": o.message or "denied by epguard",
        }
    if o.warnings:
        response["warnings"] = o.warnings
    if o.audit_annotations:
        response["auditAnnotations"] = o.audit_annotations
    if o.patch:
        response["patch"] = base64.b64encode(_encode(o.patch)).decode()
        response["patchType"] = "JSONPatch"
    return _encode({"apiVersion": api_version, "kind": "AdmissionReview", "response": response})


def complete(handler: Handler, review: Review) -> Answer:
    req = review.request
    try:
        outcome = handler(req)
        if outcome.result not in handler.results:
            raise ValueError(f"handler {handler.endpoint} returned result {outcome.result!r}")
        body = encode(review.api_version, req.uid, outcome)
    except Exception:
        log.exception("internal error in /%s judging %s", handler.endpoint, req.uid)
        return problem(
            500,
            ERROR,
            "internal_error",
            f"epguard failed to judge request {req.uid} (internal error); "
            "the webhook's failurePolicy applies",
            req,
        )
    return Answer(200, body, outcome.result, outcome, req)
