"""POST /mutate over real TLS: probe injection answers, opt-in, and bad input."""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonpatch

from tests.factory import container, pod, review
from tests.servers import RunningServer

INJECT = {"epguard.io/inject": "enabled"}


def mutate(server: RunningServer, body: Any) -> dict[str, Any]:
    with server.client() as client:
        r = client.post("/mutate", json=body)
    assert r.status_code == 200, r.text
    response: dict[str, Any] = r.json()["response"]
    return response


def patch_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    assert response["patchType"] == "JSONPatch"
    ops: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    return ops


def test_opted_in_worker_pod_gets_the_probe_first(server: RunningServer) -> None:
    download = {"name": "download", "image": "busybox"}
    body = review(pod(init=[download], annotations=INJECT))
    response = mutate(server, body)
    assert response["allowed"] is True
    assert response["uid"] == body["request"]["uid"]
    ops = patch_of(response)
    inits = next(op for op in ops if op["path"] == "/spec/initContainers")["value"]
    assert [c["name"] for c in inits] == ["epguard-copy-probe", "epguard-probe", "download"]
    assert inits[0]["image"] == server.runtime.settings.inject_image
    assert "--level" in inits[1]["command"]
    # This server holds no signing key: the probe is injected unsigned, and without the
    # label that puts a pod on the controller's lists (/validate refuses it unsigned).
    assert not any(op["path"].startswith("/metadata/labels") for op in ops), ops


def test_pod_that_did_not_opt_in_is_admitted_unchanged(server: RunningServer) -> None:
    response = mutate(server, review(pod()))
    assert response["allowed"] is True
    assert "patch" not in response


def test_opted_in_pod_without_the_flag_is_admitted_unchanged(server: RunningServer) -> None:
    plain = container(args=["--model-path", "/m"])
    response = mutate(server, review(pod([plain], annotations=INJECT)))
    assert "patch" not in response


def test_a_reinvocation_on_an_injected_pod_gives_the_same_pod(server: RunningServer) -> None:
    obj = pod(annotations=INJECT)
    once = jsonpatch.apply_patch(obj, patch_of(mutate(server, review(obj))))
    twice = jsonpatch.apply_patch(once, patch_of(mutate(server, review(once))))
    assert twice == once


def test_updates_are_never_patched(server: RunningServer) -> None:
    obj = pod(annotations=INJECT)
    response = mutate(server, review(obj, operation="UPDATE", old=obj))
    assert "patch" not in response


def test_exempted_pod_is_not_injected(server: RunningServer) -> None:
    annotations = {**INJECT, "epguard.io/skip": "vendor-tested image"}
    assert "patch" not in mutate(server, review(pod(annotations=annotations)))


def test_injections_are_counted_by_result(server: RunningServer) -> None:
    mutate(server, review(pod(annotations=INJECT)))
    with server.client() as client:
        text = client.get("/metrics").text
    assert 'epguard_admission_reviews_total{endpoint="mutate",result="injected"}' in text


def test_malformed_mutate_request_is_a_400_not_a_500(server: RunningServer) -> None:
    with server.client() as client:
        r = client.post("/mutate", content=b"{not json")
        assert r.status_code == 400
        assert "not valid JSON" in r.json()["error"]
        r = client.post(
            "/mutate", json={"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}
        )
        assert r.status_code == 400
        assert "no 'request'" in r.json()["error"]
