"""``POST /mutate``: inject the epguard probe into worker pods that opted in.

Opt-in is the namespace label or the pod annotation ``epguard.io/inject: enabled``;
the chart's MutatingWebhookConfiguration already filters on both with CEL, and this
endpoint checks again so a misconfigured webhook never injects into a pod that did
not ask. What is injected, and why, is in ``webhook.injection``.

Injection is best-effort: every answer is ``allowed``. A pod that cannot be patched
is admitted unchanged (and still judged by ``/validate``), because refusing a pod
for want of a diagnostic would make epguard the outage.
"""

from __future__ import annotations

import base64
import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response

from webhook.app import JSON, MAX_BODY_BYTES, read_review
from webhook.injection import InjectionSettings, label_patch, plan
from webhook.metrics import Metrics
from webhook.namespaces import INJECT_KEY, opts_in
from webhook.policy import SKIP_ANNOTATION, PolicyState
from webhook.review import AdmissionRequest, AdmissionResponse, AdmissionReviewResponse
from webhook.workloads import annotations_of, as_map

log = logging.getLogger("epguard.injection")


def _opted_in(req: AdmissionRequest, state: PolicyState) -> bool:
    return state.namespaces.get(req.namespace).inject or opts_in(
        annotations_of(req.object).get(INJECT_KEY)
    )


def injection_for(
    req: AdmissionRequest, state: PolicyState, settings: InjectionSettings
) -> tuple[str, list[dict[str, object]]]:
    """(result, patch) for one request; result is the metric label."""
    if req.kind.kind != "Pod" or req.operation != "CREATE" or req.subResource:
        return "unchanged", []
    if not _opted_in(req, state):
        return "not_opted_in", []
    if state.config.allow_skip and SKIP_ANNOTATION in annotations_of(req.object):
        return "exempted", []
    obj = as_map(req.object)
    injection = plan(obj.get("spec"), settings)
    if not injection.changed:
        return "unchanged", []
    return "injected", [*injection.patch, label_patch(obj.get("metadata"))]


def mutation_router(
    state: PolicyState,
    metrics: Metrics,
    settings: InjectionSettings,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> APIRouter:
    router = APIRouter()

    @router.post("/mutate")
    async def mutate(request: Request) -> Response:
        review = await read_review(request, metrics, max_body_bytes)
        if isinstance(review, Response):
            return review
        req = review.request
        try:
            result, patch = injection_for(req, state, settings)
        except Exception:
            log.exception("internal error planning injection for %s; admitting unchanged", req.uid)
            result, patch = "error", []
        metrics.injections.labels(result).inc()
        response = AdmissionResponse(uid=req.uid, allowed=True)
        if patch:
            response.patch = base64.b64encode(json.dumps(patch).encode()).decode()
            response.patchType = "JSONPatch"
            meta = as_map(as_map(req.object).get("metadata"))
            name = meta.get("name") or meta.get("generateName") or "?"
            log.info("injected the probe into pod %s/%s", req.namespace, name)
        payload = AdmissionReviewResponse(apiVersion=review.apiVersion, response=response)
        return Response(content=payload.to_json(), media_type=JSON)

    return router


def injection_settings(inject_image: str, probe_level: str) -> InjectionSettings:
    return InjectionSettings(epguard_image=inject_image, level=probe_level)
