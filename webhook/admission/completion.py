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

from epguard.webhook.admission.handler import Handler, Outcome
from epguard.webhook.engine.namespaces import Mode
from epguard.webhook.engine.review import AdmissionRequest
from epguard.webhook.engine.workloads import describe

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
    # Why a review was answered by mode without being judged: busy, deadline or too_large.
    unjudged: str | None = None


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


# Operations epguard never judges: answered "ignored" whether judged or not.
_NEVER_JUDGED = frozenset({"DELETE", "CONNECT"})


def unjudged(
    review: Review, reason: str, why: str, *, endpoint: str, mode: Mode, rules_edit: bool
) -> Answer:
    """The answer to a review epguard could not judge (too busy, too late, too large),
    by what is safer for each case, as an AdmissionReview the API server obeys whatever
    the webhook's ``failurePolicy`` (a 500 would be admitted under ``Ignore``):

    * a pod or workload under ``enforce``: refused, saying that epguard could not judge
      it: refusing a good pod costs a retry, admitting a bad image costs a node's worth
      of GPUs and the model download before the probe stops it;
    * under ``warn``: allowed with that warning; under ``audit``: allowed, logged,
      counted and annotated (``unjudged: <reason>``): the admin chose never to refuse;
    * an edit of the rules ConfigMap: refused (the rules in use stay; the admin
      retries), in every mode: an unchecked edit could be one no restart will load;
    * ``/mutate``: allowed unchanged with a warning, as its ``Ignore`` would (the pod
      is then judged by ``/validate``);
    * DELETE and CONNECT: allowed, as always.
    """
    req = review.request
    tag = f"[epguard unjudged: {reason}]"
    subject = describe(req.kind.kind, req.namespace, req.name or "(unnamed)")
    what = f"{req.operation} of {subject}".rstrip()
    if endpoint == "mutate":
        outcome = Outcome(
            True,
            "unchanged",
            warnings=(f"epguard could not inject its probe ({why}) {tag}",),
            note=f"unjudged ({reason}) {what}: {why}",
        )
    elif req.operation in _NEVER_JUDGED:
        outcome = Outcome(True, "ignored")
    elif rules_edit:
        message = (
            f"epguard could not check this rules edit ({why}); the rules in use stay as "
            f"they are: retry the edit {tag}"
        )
        outcome = Outcome(False, "denied", message=message, note=message)
    elif mode == "enforce":
        message = (
            f"epguard could not judge this request ({why}), so it refuses it "
            "rather than admit an image it has not checked (mode enforce): retry; if it "
            f"persists, the webhook is overloaded or flooded {tag}"
        )
        outcome = Outcome(False, "denied", message=message, note=f"{what}: {message}")
    elif mode == "warn":
        warning = f"epguard (warn mode) could not judge this request ({why}): not checked {tag}"
        outcome = Outcome(True, "warned", warnings=(warning,), note=f"{what}: {warning}")
    else:
        outcome = Outcome(
            True,
            "audited",
            audit_annotations={"unjudged": reason},
            note=f"audit mode: not judged ({why}): {what}",
        )
    body = encode(review.api_version, req.uid, outcome)
    return Answer(200, body, outcome.result, outcome, req, reason, why, unjudged=reason)
