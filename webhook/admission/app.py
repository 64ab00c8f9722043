"""The HTTP surface: ``POST /validate``, ``POST /mutate``, ``/healthz``, ``/readyz``,
``/metrics``, on one FastAPI app.

Every admission path is built from the same four layers, like controller-runtime's
webhook server:

* decision (``webhook.handler``): request → outcome, pure, on the engine ``epguard
  check`` shares;
* completion (``webhook.completion``): uid, encoding, and recovery from a handler that
  raises (a 500, so the API server applies the admin's failurePolicy);
* transport (``webhook.transport``): content type, bounded body, the envelope;
* instrumentation (``webhook.instrumentation``): the same metrics and log line for all.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from epguard.webhook.admission.completion import Answer, Review, complete, unjudged
from epguard.webhook.admission.handler import Handler, Injector, RulesConfigMap, Validator
from epguard.webhook.admission.instrumentation import Instrumented
from epguard.webhook.admission.transport import (
    INLINE,
    PODS_LANE,
    RULES_LANE,
    AdmissionEndpoint,
    Bounds,
    Limits,
)
from epguard.webhook.engine.injection import InjectionSettings
from epguard.webhook.engine.policy import PolicyState
from epguard.webhook.metrics import Metrics

# epguard's metrics are Prometheus (instrumentation.py), not OpenTelemetry. FastAPI
# releases with native OTel support ask three provider globals (and os.environ) on every
# request whether tracing, metrics or logs were set up; turned off, they do not. Older
# releases (the floor in pyproject.toml) have no such probe and no such argument.
_NO_OTEL: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


# The API server refuses a ConfigMap whose data is over 1 MiB (etcd's object limit
# leaves no more), so a longer rules text never comes from it.
MAX_RULES_TEXT = 1024 * 1024


def _rules_lane(review: Review) -> str:
    kind = review.request.kind
    return RULES_LANE.name if kind.kind == "ConfigMap" and not kind.group else PODS_LANE.name


def _pods_lane(_review: Review) -> str:
    return PODS_LANE.name


def admission_route(
    app: FastAPI,
    handler: Handler,
    metrics: Metrics,
    bounds: Bounds,
    state: PolicyState | None = None,
    rules: RulesConfigMap | None = None,
) -> None:
    """Serve ``handler`` at ``POST /<handler.endpoint>`` through the four layers.

    ``/validate`` sends every ConfigMap review (the API server sends only edits of the
    rules ConfigMap) to the rules lane, whatever its size, so none takes a pod review's
    place nor holds the loop; everything else large goes to the pods lane
    (transport.py). A review that
    cannot be judged is answered by the namespace's mode (completion.unjudged)."""
    validating = handler.endpoint == "validate"

    def by_mode(review: Review, reason: str, why: str) -> Answer:
        req = review.request
        mode = (
            (state.namespaces.get(req.namespace).mode or state.config.default_mode)
            if state is not None
            else "enforce"
        )
        rules_edit = (
            validating
            and rules is not None
            and req.kind.kind == "ConfigMap"
            and not req.kind.group
            and req.namespace == rules.namespace
            and req.name in (None, rules.name)  # no name: refusing is the safe side
        )
        return unjudged(
            review, reason, why, endpoint=handler.endpoint, mode=mode, rules_edit=rules_edit
        )

    judge = partial(complete, handler)

    def oversized_rules(review: Review) -> str | None:
        # A rules text over what a ConfigMap can hold is never parsed (a 19 MiB one is
        # ~1 GiB of YAML nodes); no API server sends one.
        req = review.request
        if req.kind.kind == "ConfigMap" and not req.kind.group and rules is not None:
            data = req.object.get("data") if isinstance(req.object, dict) else None
            text = data.get(rules.key) if isinstance(data, dict) else None
            if isinstance(text, str) and len(text) > MAX_RULES_TEXT:
                return (
                    f"its {rules.key} is over {MAX_RULES_TEXT} characters, more than a "
                    "ConfigMap holds"
                )
        return None

    def judge_validate(review: Review) -> Answer:
        why = oversized_rules(review)
        return judge(review) if why is None else by_mode(review, "too_large", why)

    def validate_lane(review: Review) -> str:
        # The refusal of an oversized text costs nothing: answered at once, never queued
        # behind rules edits that are being parsed.
        return INLINE if oversized_rules(review) is not None else _rules_lane(review)

    endpoint = AdmissionEndpoint(
        judge_validate if validating else judge,
        by_mode,
        bounds,
        validate_lane if validating else _pods_lane,
    )
    app.add_route(
        f"/{handler.endpoint}",
        Instrumented(metrics, handler, endpoint),  # type: ignore[arg-type]
        methods=["POST"],
        include_in_schema=False,
    )


def create_app(
    state: PolicyState,
    metrics: Metrics,
    *,
    limits: Limits,
    injection: InjectionSettings | None = None,
    rules_configmap: RulesConfigMap | None = None,
    ready: Callable[[], bool] = lambda: True,
    status: Callable[[], dict[str, Any]] = dict,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    routers: Sequence[APIRouter] = (),
) -> FastAPI:
    """The ASGI app. ``injection`` adds ``/mutate``; ``routers`` add endpoints of other
    kinds on the same TLS port."""
    app = FastAPI(
        title="epguard admission webhook",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        **_NO_OTEL,
    )
    # One memory budget and one set of lanes for every endpoint (transport.py).
    bounds = Bounds.make(limits)
    app.state.bounds = bounds
    validator = Validator(state, rules_configmap)
    admission_route(app, validator, metrics, bounds, state, rules_configmap)
    if injection is not None:
        injector = Injector(state, injection)
        admission_route(app, injector, metrics, bounds, state)

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
