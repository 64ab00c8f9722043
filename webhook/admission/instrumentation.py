"""Instrumentation: one wrapper that gives every admission endpoint the same metrics
and the same structured log line, whatever the layers under it decided.

For each request to ``/<endpoint>``:

* ``epguard_admission_reviews_total{endpoint, result}``: the handler's result
  (a closed set per handler), ``bad_request`` (4xx) or ``error`` (5xx);
* ``epguard_admission_duration_seconds{endpoint}``: from the request reaching the
  endpoint to the answer sent;
* ``epguard_bad_requests_total{reason}``: why a request was refused or failed;
* ``epguard_admission_unjudged_total{endpoint, reason, result}``: a review answered by
  mode without being judged (transport.py says when), and what that answer was;
* for policy decisions, ``epguard_admission_decisions_total{result, rule}`` and
  ``epguard_admission_warnings_total{rule}``; ``rule`` is an admin's rule id (bounded by
  the rules) or ``verdict`` for any learned ImageVerdict (not its name: one per image).

Every label is from a bounded set; the children for the everyday labels are created
once, so a request costs two dict lookups and three increments. Anything outside the
everyday results is logged as one ``key=value`` line (``epguard.admission`` logger),
with the same fields also attached to the record as ``extra={"epguard": {...}}``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from epguard.webhook.admission.completion import ANSWER, BAD_REQUEST, ERROR, Answer
from epguard.webhook.admission.handler import ROUTINE, Handler
from epguard.webhook.admission.transport import AdmissionEndpoint, Receive, Scope, Send
from epguard.webhook.engine.workloads import describe_object
from epguard.webhook.metrics import Metrics

log = logging.getLogger("epguard.admission")


def rule_label(source: str) -> str:
    return "verdict" if source.startswith("verdict:") else source


# Control characters (a tenant writes pod names, messages and reasons that reach the log)
# as \uNNNN: a \r or \n in a value once started what looked like a log line of its own.
_CONTROL = {c: f"\\u{c:04x}" for c in (*range(0x20), 0x7F, 0x85, 0x2028, 0x2029)}


def _logfmt(fields: dict[str, Any]) -> str:
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=') or not text.isprintable():
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').translate(_CONTROL) + '"'
        parts.append(f"{key}={text}")
    return " ".join(parts)


class Instrumented:
    """ASGI wrapper of one admission endpoint: counts, times and logs each answer."""

    def __init__(self, metrics: Metrics, handler: Handler, inner: AdmissionEndpoint) -> None:
        self.inner = inner
        self.endpoint = endpoint = handler.endpoint
        self.metrics = metrics
        results = (*handler.results, BAD_REQUEST, ERROR)
        self._count = {r: metrics.reviews.labels(endpoint, r) for r in results}
        self._latency = metrics.latency.labels(endpoint)
        self._decisions: dict[tuple[str, str], Any] = {}
        self._warnings: dict[str, Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        try:
            await self.inner(scope, receive, send)
        finally:
            answer = scope.get(ANSWER)
            self.record(answer, time.perf_counter() - started)

    def _decision(self, result: str, rule: str) -> Any:
        key = (result, rule)
        child = self._decisions.get(key)
        if child is None:
            child = self._decisions[key] = self.metrics.decisions.labels(result, rule)
        return child

    def _warning(self, rule: str) -> Any:
        child = self._warnings.get(rule)
        if child is None:
            child = self._warnings[rule] = self.metrics.warn_findings.labels(rule)
        return child

    def record(self, answer: Answer | None, seconds: float) -> None:
        result = answer.result if answer is not None else ERROR
        self._count.get(result, self._count[ERROR]).inc()
        self._latency.observe(seconds)
        if answer is None:
            self.metrics.bad_requests.labels("internal_error").inc()
            log.error(_logfmt({"endpoint": self.endpoint, "result": ERROR, "status": 500}))
            return
        if answer.unjudged is not None:
            self.metrics.unjudged.labels(self.endpoint, answer.unjudged, result).inc()
        outcome = answer.outcome
        if outcome is not None:
            if outcome.rules is not None:
                for rule in outcome.rules:
                    self._decision(result, rule_label(rule)).inc()
            for source in outcome.warned_by:
                self._warning(rule_label(source)).inc()
            if result in ROUTINE and answer.unjudged is None:
                return
        elif answer.reason is not None:
            self.metrics.bad_requests.labels(answer.reason).inc()
        self._log(answer, result, seconds)

    def _log(self, answer: Answer, result: str, seconds: float) -> None:
        req = answer.request
        fields: dict[str, Any] = {"endpoint": self.endpoint, "result": result}
        if req is not None:
            fields["uid"] = req.uid
            fields["operation"] = req.operation
            fields["object"] = describe_object(req.object)
            fields["namespace"] = req.namespace or "-"
        fields["status"] = answer.status
        fields["duration_ms"] = round(seconds * 1e3, 3)
        outcome = answer.outcome
        if outcome is not None:
            if outcome.rules and outcome.rules != ("none",):
                fields["rules"] = ",".join(outcome.rules)
            fields["message"] = outcome.note or ""
            if answer.unjudged is not None:
                fields["unjudged"] = answer.unjudged
            level = logging.INFO if answer.unjudged is None else logging.WARNING
            log.log(level, _logfmt(fields), extra={"epguard": fields})
        else:
            fields["reason"] = answer.reason or ""
            fields["message"] = answer.detail or ""
            level = logging.ERROR if answer.status >= 500 else logging.WARNING
            log.log(level, _logfmt(fields), extra={"epguard": fields})
