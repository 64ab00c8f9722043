"""The backstop's read of the ImageVerdicts (webhook/controller/backstop.py
``read_verdicts``): every verdict, a page at a time, past the webhook's own cap.

The API here is a test double: an in-memory list that pages as the API server does
(``limit``/``continue``, raw JSON bodies). The real API server reads 1,000 real
ImageVerdicts through the same code in tests/e2e/test_backstop_scale.py.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

import pytest

from epguard.webhook.controller import backstop
from epguard.webhook.controller.compiler import compile_params
from epguard.webhook.engine.verdicts import MAX_VERDICTS

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
TTL = dt.timedelta(hours=24)


def verdict(i: int) -> dict[str, Any]:
    digest = "sha256:" + f"{i:016x}" * 4
    return {
        "metadata": {"name": digest.replace(":", "-"), "resourceVersion": str(1000 + i)},
        "spec": {
            "image": f"registry.example.com/team-{i % 100}/sglang:b{i}",
            "digest": digest,
            "verdict": "Unusable",
            "reason": f"libcudart.so.12 is missing (build {i % 7})",
            "pod": "ml/sglang-0",
            "lastSeen": (NOW - dt.timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    }


class _Response:
    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()


class PagedList:
    """``list_cluster_custom_object`` over ``objects``, in pages as the API server
    serves them; counts the pages asked for."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = objects
        self.pages = 0

    def __call__(self, _api: Any) -> PagedList:  # stands in for client.CustomObjectsApi
        return self

    def list_cluster_custom_object(self, *_: Any, **kw: Any) -> _Response:
        self.pages += 1
        start = int(kw.get("_continue") or 0)
        end = start + int(kw["limit"])
        more = end < len(self.objects)
        meta = {"resourceVersion": "77", **({"continue": str(end)} if more else {})}
        return _Response({"items": self.objects[start:end], "metadata": meta})


def test_every_verdict_past_the_webhooks_cap_is_read_and_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = MAX_VERDICTS + 10_000
    listing = PagedList([verdict(i) for i in range(n)])
    monkeypatch.setattr(backstop.client, "CustomObjectsApi", listing)
    index, fingerprint = backstop.read_verdicts(object(), TTL, NOW)  # type: ignore[arg-type]
    assert index.verdicts == n
    params = compile_params(index, NOW)
    # One digest and one tag entry per verdict, none dropped.
    assert (params.kept, params.dropped) == (2 * n, 0)
    held = sum(len(s["d"]) + sum(len(t) for t in s["t"].values()) for s in params.shards)
    assert held == 2 * n
    # The same objects give the same fingerprint; a changed resourceVersion another.
    _, same = backstop.read_verdicts(object(), TTL, NOW)  # type: ignore[arg-type]
    assert same == fingerprint
    listing.objects[-1]["metadata"]["resourceVersion"] = "changed"
    assert backstop.read_verdicts(object(), TTL, NOW)[1] != fingerprint  # type: ignore[arg-type]


def test_past_its_own_cap_the_backstop_stops_reading_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    listing = PagedList([verdict(i) for i in range(2_600)])
    monkeypatch.setattr(backstop.client, "CustomObjectsApi", listing)
    monkeypatch.setattr(backstop, "MAX_BACKSTOP_VERDICTS", 1_000)
    with caplog.at_level(logging.WARNING, logger="epguard.controller.backstop"):
        index, _ = backstop.read_verdicts(object(), TTL, NOW)  # type: ignore[arg-type]
    assert index.verdicts == 1_000 and listing.pages == 2  # pages of 500: no third page read
    assert "more than 1000 ImageVerdicts" in caplog.text
