"""A replica is ready only once its watches have listed: before its verdicts are in, it
would admit pods on images with Unusable verdicts (a rollout's new replicas once took
reviews at once), and before the probe-key Secret's, it injects unsigned probes that
gate nothing. Not forever: a listing that never answers (403) must not leave every
replica unready. Listings are held by stand-in Sources (a real API server answers in
milliseconds, so the window could not be held open on purpose); the webhook, its HTTP
server and the parsing of what is listed are real."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from epguard.webhook.cluster.watch import Source
from tests.factory import TEST_RULES, container, pod, review
from tests.servers import running_server

IMAGE = "registry.example.com/ml/sglang:v-learned"
Listing = Callable[[], tuple[list[Mapping[str, Any]], str]]


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


def quiet(rv: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    threading.Event().wait(5)  # connected, no events
    return iter(())


def ready_soon(client: httpx.Client) -> bool:
    for _ in range(200):
        if client.get("/readyz").status_code == 200:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(
    ("resource", "objects"),
    [("imageverdict", [verdict()]), ("secret", [])],  # no Secret yet: an answer all the same
)
def test_not_ready_until_the_watch_has_listed(
    tmp_path: Path, resource: str, objects: list[Mapping[str, Any]]
) -> None:
    release = threading.Event()

    def listing() -> tuple[list[Mapping[str, Any]], str]:
        release.wait(20)
        return objects, "7"

    sources = {resource: Source(listing, quiet)}
    with running_server(tmp_path, TEST_RULES, sources=sources) as s, s.client() as client:
        assert client.get("/readyz").status_code == 503
        release.set()
        assert ready_soon(client)
        r = client.post("/validate", json=review(pod([container(image=IMAGE)])))
        said = client.get("/readyz").json()
    answer = r.json()["response"]
    if resource == "imageverdict":  # the listed verdict refuses from the first review
        assert answer["allowed"] is False and "listed late" in answer["status"]["message"]
    else:
        assert said["probe_key"] is None


@pytest.mark.parametrize("resource", ["imageverdict", "secret"])
def test_a_listing_that_never_answers_does_not_keep_the_replica_unready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resource: str
) -> None:
    # An object this replica can never list (403): unready for good would leave the
    # Service without endpoints, which failurePolicy Ignore turns into admitting all.
    from epguard.webhook.admission import server as server_mod

    monkeypatch.setattr(server_mod, "LIST_WAIT_SECONDS", 1.0)
    never = threading.Event()

    def listing() -> tuple[list[Mapping[str, Any]], str]:
        never.wait(20)
        raise RuntimeError("403 Forbidden")

    with running_server(tmp_path, TEST_RULES, sources={resource: Source(listing, quiet)}) as s:
        with s.client() as client:
            assert client.get("/readyz").status_code == 503
            assert ready_soon(client)
        never.set()
