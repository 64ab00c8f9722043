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
        # The admission families: instrumentation.Instrumented gives every admission
        # endpoint the same ones, with bounded labels.
        self.reviews = Counter(
            "epguard_admission_reviews",
            "Admission requests answered, by endpoint (validate, mutate) and result: the "
            "handler's (allowed, denied, warned, audited, exempted, ignored; injected, "
            "unchanged, not_opted_in, exempted), bad_request (4xx) or error (5xx: epguard "
            "failed, the webhook's failurePolicy applied).",
            ["endpoint", "result"],
            registry=r,
        )
        self.decisions = Counter(
            "epguard_admission_decisions",
            "Decisions by result and by the rule id (or 'verdict' for a learned ImageVerdict) "
            "behind a would-be denial; rule is 'none' when nothing would deny. A review with "
            "two rules counts twice.",
            ["result", "rule"],
            registry=r,
        )
        self.warn_findings = Counter(
            "epguard_admission_warnings",
            "Warnings returned to clients, by the rule that produced them ('verdict' for a "
            "learned ImageVerdict, 'none' for advice).",
            ["rule"],
            registry=r,
        )
        self.latency = Histogram(
            "epguard_admission_duration_seconds",
            "Time to answer an admission request, by endpoint, from the request reaching the "
            "endpoint to the answer sent.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.bad_requests = Counter(
            "epguard_bad_requests",
            "Admission requests refused as malformed (or failed inside epguard: "
            "internal_error), by reason.",
            ["reason"],
            registry=r,
        )
        self.unjudged = Counter(
            "epguard_admission_unjudged",
            "Admission reviews answered by mode without being judged, by endpoint, reason "
            "(busy: its lane or the memory for reviews in flight was full; deadline: not "
            "judged in time; too_large: over the body or memory limit) and the answer's "
            "result (denied under enforce, warned, audited; unchanged for mutate).",
            ["endpoint", "reason", "result"],
            registry=r,
        )
        self.connections_cut = Counter(
            "epguard_connections_cut",
            "Connections closed by epguard's own limits: a request head over the limit "
            "(head_size, answered 431), a head not complete in time (head_deadline), a "
            "body not complete in time (body_deadline), bytes that begin no request "
            "(idle), too many pipelined requests (pipeline), a body's framing over the "
            "limit (body_framing) or in too many small pieces (body_chunks).",
            ["reason"],
            registry=r,
        )
        self.rules_warnings = Gauge(
            "epguard_rules_warnings",
            "Problems in rules that loaded, by source: no rules at all, or an image glob "
            "that can never match (each one is logged, and an Event on the ConfigMap).",
            ["source"],
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
            "ImageVerdicts not held because the store is full (verdicts.MAX_VERDICTS for "
            "the probes', MAX_SCAN_VERDICTS for scans).",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
