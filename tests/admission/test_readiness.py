"""A replica is ready only once its watches have listed: before its verdicts are in, it
would admit pods on images with Unusable verdicts (a rollout's new replicas once took
reviews at once). The listing is held by a stand-in Source (a real API server answers
in milliseconds, so the window could not be held open on purpose); the webhook, its
HTTP server and the verdict parsing are real."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.factory import TEST_RULES, container, pod, review
from tests.servers import running_server

IMAGE = "registry.example.com/ml/sglang:v-learned"


def verdict() -> dict[str, Any]:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "apiVersion": "epguard.io/v1alpha1",
        "kind": "ImageVerdict",
        "metadata": {"name": "iv-listed", "resourceVersion": "7"},
        "spec": {"image": IMAGE, "digest": "", "verdict": "Unusable",
                 "reason": "ImportError: libcudart.so.12: listed late",
                 "lastSeen": now, "pod": "ml/worker-0", "count": 1},
    }  # fmt: skip


def test_not_ready_until_the_verdicts_are_listed_and_then_they_refuse(tmp_path: Path) -> None:
    from epguard.webhook.cluster.watch import Source

    release = threading.Event()

    def listing() -> tuple[list[Mapping[str, Any]], str]:
        release.wait(20)
        return [verdict()], "7"

    def watching(rv: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        threading.Event().wait(5)
        return iter(())

    sources = {"imageverdict": Source(listing, watching)}
    with running_server(tmp_path, TEST_RULES, sources=sources) as s:
        with s.client() as client:
            assert client.get("/readyz").status_code == 503
            release.set()
            for _ in range(200):
                if client.get("/readyz").status_code == 200:
                    break
                time.sleep(0.05)
            assert client.get("/readyz").status_code == 200
            r = client.post("/validate", json=review(pod([container(image=IMAGE)])))
        answer = r.json()["response"]
        assert answer["allowed"] is False and "listed late" in answer["status"]["message"]


def test_a_listing_that_never_answers_does_not_keep_the_replica_unready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Verdicts this replica can never list (403): unready for good would leave the
    # Service without endpoints, which failurePolicy Ignore turns into admitting all.
    from epguard.webhook.admission import server as server_mod
    from epguard.webhook.cluster.watch import Source

    monkeypatch.setattr(server_mod, "LIST_WAIT_SECONDS", 1.0)
    never = threading.Event()

    def listing() -> tuple[list[Mapping[str, Any]], str]:
        never.wait(20)
        raise RuntimeError("403 Forbidden")

    def watching(rv: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        return iter(())

    sources = {"imageverdict": Source(listing, watching)}
    with running_server(tmp_path, TEST_RULES, sources=sources) as s:
        with s.client() as client:
            assert client.get("/readyz").status_code == 503
            for _ in range(100):
                if client.get("/readyz").status_code == 200:
                    break
                time.sleep(0.05)
            assert client.get("/readyz").status_code == 200
        never.set()
