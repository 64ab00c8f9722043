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
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from webhook.completion import complete
from webhook.handler import Handler, Injector, RulesConfigMap, Validator
from webhook.injection import InjectionSettings
from webhook.instrumentation import Instrumented
from webhook.metrics import Metrics
from webhook.policy import PolicyState
from webhook.transport import POOL_THREADS, AdmissionEndpoint

# epguard's metrics are Prometheus (instrumentation.py), not OpenTelemetry. FastAPI
# releases with native OTel support ask three provider globals (and os.environ) on every
# request whether tracing, metrics or logs were set up; turned off, they do not. Older
# releases (the floor in pyproject.toml) have no such probe and no such argument.
_NO_OTEL: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


def admission_route(
    app: FastAPI,
    handler: Handler,
    metrics: Metrics,
    max_body_bytes: int,
    deadline: float,
    pool: ThreadPoolExecutor | None = None,
) -> None:
    """Serve ``handler`` at ``POST /<handler.endpoint>`` through the four layers."""
    endpoint = AdmissionEndpoint(partial(complete, handler), max_body_bytes, deadline, pool)
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
    max_body_bytes: int,
    deadline: float = 3.0,
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
    # One pool for the large reviews of every endpoint (transport.POOL_THREADS in all).
    pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="epguard-judge")
    validator = Validator(state, rules_configmap)
    admission_route(app, validator, metrics, max_body_bytes, deadline, pool)
    if injection is not None:
        injector = Injector(state, injection)
        admission_route(app, injector, metrics, max_body_bytes, deadline, pool)

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
