"""Prometheus metrics, on a registry per server so tests can run several side by side."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Admission latency is sub-millisecond when healthy; the API server's timeout is
# seconds. Buckets cover both ends.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reviews = Counter(
            "epguard_admission_reviews",
            "AdmissionReviews answered, by result "
            "(allowed, denied, warned, audited, exempted, ignored).",
            ["result"],
            registry=r,
        )
        self.decisions = Counter(
            "epguard_admission_decisions",
            "Decisions by result and by the rule (or verdict:<name>) behind a would-be denial; "
            "rule is 'none' when nothing would deny. A review with two rules counts twice.",
            ["result", "rule"],
            registry=r,
        )
        self.warn_findings = Counter(
            "epguard_admission_warnings",
            "Warnings returned to clients, by the rule that produced them ('none' for advice).",
            ["rule"],
            registry=r,
        )
        self.latency = Histogram(
            "epguard_admission_duration_seconds",
            "Time to answer /validate, from body received to response built.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.bad_requests = Counter(
            "epguard_bad_requests",
            "Requests to /validate or /mutate refused as malformed (or failed inside epguard: "
            "internal_error), by reason.",
            ["reason"],
            registry=r,
        )
        self.rules_loaded = Gauge(
            "epguard_rules_loaded",
            "Rules in force, by source (file or configmap).",
            ["source"],
            registry=r,
        )
        self.rules_reloads = Counter(
            "epguard_rules_reloads",
            "Attempts to load rules, by source and result (ok, rejected). A rejected load "
            "keeps the last good rules in force.",
            ["source", "result"],
            registry=r,
        )
        self.tls_reloads = Counter(
            "epguard_tls_reloads",
            "Certificate/key reloads, by result (ok, failed).",
            ["result"],
            registry=r,
        )
        self.watch_up = Gauge(
            "epguard_watch_up",
            "1 while the watch on a resource is connected.",
            ["resource"],
            registry=r,
        )
        self.watch_events = Counter(
            "epguard_watch_events",
            "Watch events applied, by resource.",
            ["resource"],
            registry=r,
        )
        self.verdicts_loaded = Gauge(
            "epguard_verdicts_loaded", "ImageVerdicts held in memory.", registry=r
        )
        self.verdicts_dropped = Gauge(
            "epguard_verdicts_dropped",
            "ImageVerdicts not held because the store is full (verdicts.MAX_VERDICTS).",
            registry=r,
        )
        # Pre-create the label children used on every request: .labels() costs a lock
        # and a dict lookup, which shows in the admission hot path.
        self._review_children = {
            res: self.reviews.labels(res)
            for res in ("allowed", "denied", "warned", "audited", "exempted", "ignored")
        }

        self._allowed_decision = self.decisions.labels("allowed", "none")
        self.injections = Counter(
            "epguard_probe_injections",
            "POST /mutate answers: injected, unchanged (already there or nothing to probe), "
            "not_opted_in, exempted, error",
            ["result"],
            registry=self.registry,
        )

    def count_allowed_decision(self) -> None:
        self._allowed_decision.inc()

    def count_review(self, result: str) -> None:
        child = self._review_children.get(result)
        (child or self.reviews.labels(result)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
