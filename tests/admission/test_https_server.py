"""The HTTPS surface on a real loopback server: probes, metrics, and bad input.

Bad input gets a 4xx with a message, never a 500, and the server keeps serving.
"""

from __future__ import annotations

import json
import socket
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.factory import GOOD_IMAGE, container, pod, review
from tests.servers import RunningServer


def post(server: RunningServer, content: bytes | str, **headers: str) -> httpx.Response:
    with server.client() as c:
        return c.post("/validate", content=content, headers=headers)


def test_health_and_readiness(server: RunningServer) -> None:
    with server.client() as c:
        assert c.get("/healthz").text == "ok\n"
        ready = c.get("/readyz")
    assert ready.status_code == 200
    body = ready.json()
    assert body["ready"] is True and body["rules"] == 3 and body["watching"] is False


def test_metrics_count_decisions_by_result_and_rule(server: RunningServer) -> None:
    with server.client() as c:
        c.post("/validate", json=review(pod()))
        text = c.get("/metrics").text
    assert (
        'epguard_admission_decisions_total{result="denied",rule="sglang-0516-cu129-test"}' in text
    )
    assert "epguard_admission_duration_seconds_bucket" in text
    assert 'epguard_rules_loaded{source="file"} 3.0' in text


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_speaks_tls_1_2_or_newer_only(server: RunningServer) -> None:
    ctx = server.ssl_context()
    ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    ctx.minimum_version = ssl.TLSVersion.TLSv1
    with (
        pytest.raises(ssl.SSLError),
        socket.create_connection(("127.0.0.1", server.port)) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost"),
    ):
        pass


def test_echoes_v1beta1_reviews_in_their_own_version(server: RunningServer) -> None:
    r = post(server, json.dumps(review(pod(), api_version="admission.k8s.io/v1beta1")))
    assert r.status_code == 200 and r.json()["apiVersion"] == "admission.k8s.io/v1beta1"


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"not json", 400, "request body is not valid JSON"),
        (b"", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'"x"', 400, "must be a JSON object"),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}',
            400,
            "has no 'request'",
        ),
        (
            b'{"apiVersion": "v1", "kind": "AdmissionReview", "request": {}}',
            400,
            "apiVersion must be",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "Pod", "request": {}}',
            400,
            "kind must be",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", '
            b'"request": {"uid": 5}}',
            400,
            "not a valid AdmissionReview: request.uid",
        ),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": '
            b'{"uid": "u", "kind": "Pod", "operation": "CREATE"}}',
            400,
            "request.kind",
        ),
        (b"\xff\xfe\x00garbage", 400, "not valid JSON"),
        (b"[" * 5000, 400, "nested deeper than epguard decodes"),
    ],
)
def test_refuses_malformed_reviews_with_a_clear_4xx(
    server: RunningServer, body: bytes, status: int, message: str
) -> None:
    r = post(server, body, **{"content-type": "application/json"})
    assert r.status_code == status
    assert message in r.json()["error"]


def test_judges_an_update_review_of_two_large_objects(server: RunningServer) -> None:
    # An UPDATE carries the object and the old one: two pods near the API server's 3 MiB
    # object limit make a valid review over 6 MB, which must be judged, not refused
    # (a 413 fails open).
    obj = pod([container(args=["x" * (3 * 1024 * 1024 - 4096)])])
    big = review(obj)
    big["request"]["operation"] = "UPDATE"
    big["request"]["oldObject"] = obj
    body = json.dumps(big)
    assert len(body) > 6_000_000
    r = post(server, body)
    assert r.status_code == 200, r.text
    assert r.json()["response"]["allowed"] is True


def test_a_review_over_the_body_limit_is_refused_by_mode_not_413(
    server: RunningServer,
) -> None:
    # Over the body limit (19 MiB: more than the API server can send) a review is not
    # buffered; it is answered from the fields the API server writes before the objects.
    limit = server.runtime.settings.max_body_bytes
    big = review(pod([container(args=["x" * limit])]))
    r = post(server, json.dumps(big))
    assert r.status_code == 200, r.text
    response = r.json()["response"]
    assert response["uid"] == big["request"]["uid"] and response["allowed"] is False
    assert "larger than epguard judges" in response["status"]["message"]


def test_a_chunked_body_over_the_limit_that_is_no_review_is_413(server: RunningServer) -> None:
    limit = server.runtime.settings.max_body_bytes

    def chunks() -> Any:
        for _ in range(limit // (1024 * 1024) + 1):
            yield b" " * (1024 * 1024)

    with server.client() as c:
        r = c.post("/validate", content=chunks())
    assert r.status_code == 413


def test_other_methods_and_paths_are_4xx(server: RunningServer) -> None:
    with server.client() as c:
        assert c.get("/validate").status_code == 405
        assert c.get("/nope").status_code == 404


def test_keeps_serving_on_one_keepalive_connection_after_bad_requests(
    server: RunningServer,
) -> None:
    with server.client() as c:
        for _ in range(3):
            assert c.post("/validate", content=b"{").status_code == 400
            ok = c.post("/validate", json=review(pod([container(image=GOOD_IMAGE, args=[])])))
            assert ok.status_code == 200 and ok.json()["response"]["allowed"] is True


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
k8s_words = st.sampled_from(
    [
        "Pod",
        "Deployment",
        "CronJob",
        "LeaderWorkerSet",
        "DynamoGraphDeployment",
        "apps",
        "batch",
        "nvidia.com",
        "leaderworkerset.x-k8s.io",
        "",
        "CREATE",
        "UPDATE",
        "DELETE",
        "mooncake",
        "--elastic-ep-backend",
        "sh",
        "-c",
        "containers",
        "spec",
        "template",
    ]
)


def mutate(base: Any, path: list[str], value: Any) -> Any:
    if not path or not isinstance(base, dict):
        return value
    out = dict(base)
    out[path[0]] = mutate(base.get(path[0]), path[1:], value)
    return out


paths = st.sampled_from(
    [
        ["request"],
        ["request", "uid"],
        ["request", "kind"],
        ["request", "kind", "kind"],
        ["request", "kind", "group"],
        ["request", "operation"],
        ["request", "object"],
        ["request", "object", "spec"],
        ["request", "object", "spec", "containers"],
        ["request", "object", "metadata"],
        ["request", "object", "metadata", "annotations"],
        ["request", "oldObject"],
        ["request", "namespace"],
        ["request", "subResource"],
        ["apiVersion"],
        ["kind"],
    ]
)


@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=paths, value=json_values | k8s_words, kind=k8s_words)
def test_fuzzed_reviews_never_get_a_500(
    server: RunningServer, path: list[str], value: Any, kind: str
) -> None:
    base = review(pod(), kind=("", "v1", kind) if kind else None)
    body = mutate(base, path, value)
    with server.client() as c:
        r = c.post("/validate", json=body)
        assert r.status_code in (200, 400, 413), r.text
        if r.status_code == 200:
            resp = r.json()["response"]
            assert resp["uid"] == body["request"]["uid"]
            assert isinstance(resp["allowed"], bool)
            # The engine must be total: its internal-error fallback must never fire.
            assert "internal error" not in json.dumps(resp.get("warnings"))
        assert c.get("/healthz").status_code == 200


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=2000) | st.text(max_size=2000).map(str.encode))
def test_fuzzed_bytes_never_get_a_500(server: RunningServer, body: bytes) -> None:
    with server.client() as c:
        r = c.post("/validate", content=body)
    assert r.status_code in (200, 400)


def test_extra_routers_share_the_tls_port(tmp_path: Path) -> None:
    from fastapi import APIRouter

    from tests.factory import TEST_RULES
    from tests.servers import running_server

    router = APIRouter()

    @router.post("/extra")
    async def extra() -> dict[str, str]:
        return {"hello": "extension"}

    with running_server(tmp_path, TEST_RULES, routers=[router]) as s, s.client() as c:
        assert c.post("/extra").json() == {"hello": "extension"}
        assert c.get("/healthz").status_code == 200
