"""The four layers of an admission endpoint, over real TLS where it matters.

* completion: an exception inside the engine is answered 500 -- which the API server
  treats as a failed call and hands to the webhook's failurePolicy -- never allowed,
  never a review (a review, even allowed=false, is a decision the API server obeys);
* transport: the content type and the body are checked before anything is parsed;
* instrumentation: every admission endpoint gets the same metric families, with
  bounded labels, and a log line for what is not everyday.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epguard.webhook.admission import handler as handler_module
from epguard.webhook.admission.completion import ERROR, Review, complete
from epguard.webhook.admission.handler import (
    MUTATE_RESULTS,
    VALIDATE_RESULTS,
    Outcome,
    Validator,
)
from epguard.webhook.admission.transport import BadReview, parse_review
from epguard.webhook.engine.review import AdmissionRequest, GroupVersionKind
from tests.factory import GOOD_IMAGE, TEST_RULES, container, pod, review
from tests.servers import RunningServer, running_server

INJECT = {"epguard.io/inject": "enabled"}
ADMISSION_FAMILIES = (
    "epguard_admission_reviews",
    "epguard_admission_duration_seconds",
)


def _families(server: RunningServer) -> dict[str, Any]:
    with server.client() as c:
        text = c.get("/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _count(server: RunningServer, endpoint: str, result: str) -> float:
    fam = _families(server)["epguard_admission_reviews"]
    return sum(
        s.value
        for s in fam.samples
        if s.name.endswith("_total") and s.labels == {"endpoint": endpoint, "result": result}
    )


def _boom(*_: object, **__: object) -> Any:
    raise RuntimeError("engine bug")


class _Raising:
    endpoint = "validate"
    results = VALIDATE_RESULTS

    def __call__(self, request: AdmissionRequest) -> Outcome:
        raise ZeroDivisionError("bug")


def _request() -> AdmissionRequest:
    return AdmissionRequest(uid="u-1", kind=GroupVersionKind(kind="Pod"), operation="CREATE")


# -- completion ---------------------------------------------------------------------------


def test_a_handler_that_raises_is_answered_500_never_allowed() -> None:
    answer = complete(_Raising(), Review("admission.k8s.io/v1", _request()))
    assert answer.status == 500 and answer.result == ERROR
    assert b'"allowed"' not in answer.body and b"failurePolicy" in answer.body
    assert answer.reason == "internal_error"


def test_a_handler_answering_outside_its_results_is_an_error_too() -> None:
    class Odd(_Raising):
        def __call__(self, request: AdmissionRequest) -> Outcome:
            return Outcome(True, "maybe")

    assert complete(Odd(), Review("admission.k8s.io/v1", _request())).status == 500


def test_completion_echoes_uid_and_api_version() -> None:
    from tests.factory import make_state

    answer = complete(Validator(make_state()), Review("admission.k8s.io/v1beta1", _request()))
    assert answer.status == 200
    assert b'"uid":"u-1"' in answer.body and b'"admission.k8s.io/v1beta1"' in answer.body


@pytest.fixture
def broken_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handler_module, "decide", _boom)
    monkeypatch.setattr(handler_module, "plan", _boom)


@pytest.mark.parametrize("path", ["/validate", "/mutate"])
def test_an_engine_failure_over_https_is_a_500_counted_as_error(
    server: RunningServer, broken_engine: None, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = path.lstrip("/")
    before = _count(server, endpoint, "error")
    body = review(pod(annotations=INJECT))
    with caplog.at_level(logging.ERROR, logger="epguard.admission"), server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 500, r.text
    assert "failurePolicy" in r.json()["error"] and "response" not in r.json()
    assert _count(server, endpoint, "error") == before + 1
    assert any("engine bug" in (rec.exc_text or "") for rec in caplog.records)
    assert any(f"endpoint={endpoint} result=error" in rec.getMessage() for rec in caplog.records)


def test_the_server_keeps_judging_after_an_engine_failure(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with server.client() as c:
        monkeypatch.setattr(handler_module, "decide", _boom)
        assert c.post("/validate", json=review(pod())).status_code == 500
        monkeypatch.undo()
        r = c.post("/validate", json=review(pod()))
    assert r.status_code == 200 and r.json()["response"]["allowed"] is False


# -- transport ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ctype", "status"),
    [
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON", 200),
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("application/jsonx", 415),
    ],
)
def test_the_content_type_is_checked(server: RunningServer, ctype: str, status: int) -> None:
    import json

    body = json.dumps(review(pod([container(image=GOOD_IMAGE)])))
    with server.client() as c:
        r = c.post("/validate", content=body, headers={"content-type": ctype})
    assert r.status_code == status, r.text
    if status == 415:
        assert "Content-Type must be application/json" in r.json()["error"]


def test_the_envelope_is_parsed_once_from_bytes() -> None:
    import json

    parsed = parse_review(json.dumps(review(pod())).encode())
    assert parsed.api_version == "admission.k8s.io/v1"
    assert parsed.request.object["kind"] == "Pod"
    with pytest.raises(BadReview, match="nested deeper than epguard decodes"):
        parse_review(b"[" * 100_000)


# -- instrumentation ----------------------------------------------------------------------


def test_every_admission_endpoint_gets_the_same_metric_families(server: RunningServer) -> None:
    with server.client() as c:
        assert c.post("/validate", json=review(pod())).status_code == 200
        assert c.post("/mutate", json=review(pod(annotations=INJECT))).status_code == 200
        assert c.post("/validate", content=b"{").status_code == 400
        assert c.post("/mutate", content=b"{").status_code == 400
    fams = _families(server)
    for name in ADMISSION_FAMILIES:
        endpoints = {s.labels.get("endpoint") for s in fams[name].samples}
        assert {"validate", "mutate"} <= endpoints, (name, endpoints)
    assert _count(server, "validate", "denied") >= 1
    assert _count(server, "mutate", "injected") >= 1
    assert _count(server, "validate", "bad_request") >= 1
    assert _count(server, "mutate", "bad_request") >= 1
    buckets = [
        s for s in fams["epguard_admission_duration_seconds"].samples if s.name.endswith("_count")
    ]
    assert {s.labels["endpoint"] for s in buckets} == {"validate", "mutate"}


def test_labels_stay_bounded_whatever_the_requests(server: RunningServer) -> None:
    with server.client() as c:
        for i in range(20):
            c.post("/validate", json=review(pod(name=f"p-{i}")))
            c.post(f"/validate?x={i}", content=b"[" * (i + 1))
    fams = _families(server)
    allowed_results = {*VALIDATE_RESULTS, *MUTATE_RESULTS, "bad_request", "error"}
    for s in fams["epguard_admission_reviews"].samples:
        assert s.labels["endpoint"] in {"validate", "mutate"}
        assert s.labels["result"] in allowed_results
    for s in fams["epguard_admission_decisions"].samples:
        assert not s.labels["rule"].startswith("verdict:")  # one per image: unbounded


def test_a_refusal_is_one_structured_log_line(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="epguard.admission"), server.client() as c:
        c.post("/validate", json=review(pod()))
        # The line is written once the answer is sent: the client may read it first.
        for _ in range(100):
            if any("result=denied" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.05)
    (line,) = [r.getMessage() for r in caplog.records if "result=denied" in r.getMessage()]
    assert re.search(r"^endpoint=validate result=denied uid=\S+ operation=CREATE ", line)
    assert "rules=sglang-0516-cu129-test" in line and "duration_ms=" in line
    record = next(r for r in caplog.records if "result=denied" in r.getMessage())
    assert record.epguard["result"] == "denied"  # type: ignore[attr-defined]


def test_an_extra_admission_handler_gets_the_same_instrumentation(tmp_path: Path) -> None:
    """Any admission path built with app.admission_route is counted and timed alike."""
    from epguard.webhook.admission.app import admission_route

    class Echo:
        endpoint = "echo"
        results = ("allowed",)

        def __call__(self, request: AdmissionRequest) -> Outcome:
            return Outcome(True, "allowed")

    with running_server(tmp_path, TEST_RULES) as s:
        admission_route(s.runtime.app, Echo(), s.runtime.metrics, s.runtime.app.state.bounds)
        with s.client() as c:
            assert c.post("/echo", json=review(pod())).json()["response"]["allowed"] is True
        assert _count(s, "echo", "allowed") == 1


def test_a_logged_value_cannot_start_a_log_line_of_its_own() -> None:
    # A direct client's review puts any text in what is logged: a \r\n in it once began
    # what read as another line ("level=ERROR ...").
    from epguard.webhook.admission.instrumentation import _logfmt

    line = _logfmt({"name": "x\r\nlevel=ERROR forged", "other": "a\u2028b", "ok": "plain"})
    assert "\n" not in line and "\r" not in line and "\u2028" not in line
    assert line == 'name="x\\u000d\\u000alevel=ERROR forged" other="a\\u2028b" ok=plain'
