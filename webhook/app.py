"""The HTTP surface: ``POST /validate``, ``/healthz``, ``/readyz``, ``/metrics``.

``/validate`` reads the raw body (bounded), validates only the AdmissionReview
envelope with pydantic, and hands the request to the pure policy engine. Bad
input is the client's problem (4xx with a message), never a 500: Kubernetes
treats a 500 like an outage and applies ``failurePolicy``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from webhook.metrics import Metrics
from webhook.policy import Decision, PolicyState, decide, describe_object
from webhook.review import (
    AdmissionRequest,
    AdmissionResponse,
    AdmissionReviewRequest,
    AdmissionReviewResponse,
    Status,
)

log = logging.getLogger("epguard.admission")

MAX_BODY_BYTES = 3 * 1024 * 1024  # the API server's own request limit is 3 MiB
JSON = "application/json"


class BadReview(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


def _problem(status: int, message: str) -> Response:
    return Response(
        content=json.dumps({"error": message}).encode(), status_code=status, media_type=JSON
    )


def _explain(exc: ValidationError) -> BadReview:
    errors = exc.errors(include_url=False, include_input=False)
    for e in errors:
        if e["type"] == "json_invalid":
            detail = str(e.get("ctx", {}).get("error", "")) or e["msg"]
            return BadReview(400, "not_json", f"request body is not valid JSON ({detail})")
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


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise BadReview(400, "bad_length", "Content-Length is not a number")
        if int(length) > limit:
            raise BadReview(413, "too_large", f"request body is larger than {limit} bytes")
        try:
            # Bounded by the check above (the server enforces Content-Length), so read
            # it whole: cheaper than the chunk loop below.
            return await request.body()
        except ClientDisconnect:
            raise BadReview(
                400, "disconnected", "client disconnected before the body ended"
            ) from None
    # No Content-Length (chunked): count while reading.
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise BadReview(413, "too_large", f"request body is larger than {limit} bytes")
    except ClientDisconnect:
        # Nobody is left to answer; say 400 rather than let it surface as a 500 in the log.
        raise BadReview(400, "disconnected", "client disconnected before the body ended") from None
    return bytes(body)


async def read_review(
    request: Request, metrics: Metrics, max_body_bytes: int = MAX_BODY_BYTES
) -> AdmissionReviewRequest | Response:
    """The review in a request, or the 4xx answer to send back (counted and logged).

    Shared by every admission endpoint, so /validate and /mutate refuse bad input alike.
    """
    try:
        body = await _read_body(request, max_body_bytes)
        try:
            return AdmissionReviewRequest.model_validate_json(body)
        except ValidationError as exc:
            raise _explain(exc) from None
    except BadReview as bad:
        metrics.bad_requests.labels(bad.reason).inc()
        log.warning("refused a malformed review (%s): %s", bad.reason, bad.message)
        return _problem(bad.status, bad.message)


def _response(review: AdmissionReviewRequest, decision: Decision) -> AdmissionReviewResponse:
    status = (
        None
        if decision.allowed
        else Status(code=403, reason="Forbidden", message=decision.message or "denied by epguard")
    )
    return AdmissionReviewResponse(
        apiVersion=review.apiVersion,
        response=AdmissionResponse(
            uid=review.request.uid,
            allowed=decision.allowed,
            status=status,
            warnings=list(decision.warnings) or None,
            auditAnnotations=decision.audit_annotations,
        ),
    )


def _log_decision(req: AdmissionRequest, decision: Decision) -> None:
    if decision.result in ("allowed", "ignored"):
        return
    what = f"{req.operation} {describe_object(req.object)} in namespace {req.namespace or '-'}"
    if decision.result == "exempted":
        log.info(
            "exempted %s (%s): %s; would-deny=%s",
            what,
            req.uid,
            decision.exemption,
            ",".join(decision.fired) or "none",
        )
    elif decision.result == "denied":
        log.info("denied %s (%s): %s", what, req.uid, decision.message)
    else:
        log.info(
            "%s %s (%s) in %s mode: would deny: %s",
            decision.result,
            what,
            req.uid,
            decision.mode,
            "; ".join(f.message for f in decision.denials),
        )


def create_app(
    state: PolicyState,
    metrics: Metrics,
    *,
    ready: Callable[[], bool] = lambda: True,
    status: Callable[[], dict[str, Any]] = dict,
    max_body_bytes: int = MAX_BODY_BYTES,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    routers: Sequence[APIRouter] = (),
) -> FastAPI:
    """The ASGI app. ``routers`` add endpoints on the same TLS port (e.g. a ``/mutate``
    for probe injection) without touching this module."""
    app = FastAPI(
        title="epguard admission webhook",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    @app.post("/validate")
    async def validate(request: Request) -> Response:
        started = time.perf_counter()
        review = await read_review(request, metrics, max_body_bytes)
        if isinstance(review, Response):
            return review
        try:
            decision = decide(review.request, state)
        except Exception:
            # The engine is written to be total over any JSON; if it still fails, do not
            # become the reason a workload cannot start: allow, say so, and count it.
            log.exception("internal error judging review %s; allowing", review.request.uid)
            metrics.bad_requests.labels("internal_error").inc()
            decision = Decision(
                allowed=True,
                result="allowed",
                mode=state.config.default_mode,
                warnings=("epguard hit an internal error and did not check this object",),
            )
        payload = _response(review, decision).to_json()
        metrics.count_review(decision.result)
        if decision.result not in ("allowed", "ignored"):
            for rule in decision.fired or ("none",):
                metrics.decisions.labels(decision.result, rule).inc()
            _log_decision(review.request, decision)
        elif decision.result == "allowed":
            metrics.count_allowed_decision()
        for f in decision.findings:
            if f.severity == "warn":
                metrics.warn_findings.labels(f.source or "none").inc()
        metrics.latency.observe(time.perf_counter() - started)
        return Response(content=payload, media_type=JSON)

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response(content=b"ok\n", media_type="text/plain")

    @app.get("/readyz")
    async def readyz() -> Response:
        body = {
            "ready": ready(),
            "rules": len(state.rules.current),
            "rules_source": state.rules.current.source,
            **status(),
        }
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(content=metrics.render(), media_type=metrics.content_type)

    for router in routers:
        app.include_router(router)
    return app
