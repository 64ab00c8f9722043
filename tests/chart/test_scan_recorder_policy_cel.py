"""The scan-recorder policy's CEL, evaluated with a CEL interpreter (cel-python) on the
requests a recorder can send: the times it may write and whose verdicts it may touch.
The same requests go through the real API server in tests/e2e/test_verdict_writes.py;
this one shows each rule's reasoning case by case, and runs without a cluster."""

from __future__ import annotations

import copy
import datetime as dt
import json
from typing import Any

import celpy
import pytest
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

from tests.chart.chartlib import CEL_FUNCTIONS, render

ME = "system:serviceaccount:ci:image-scanner"
OTHER = "system:serviceaccount:build-2:kaniko.bot"
DIGEST = "sha256:" + "ab" * 32
T = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.UTC)
ENV = celpy.Environment()


def _policy() -> dict[str, Any]:
    accounts = json.dumps([{"namespace": "ci", "name": "image-scanner"},
                           {"namespace": "build-2", "name": "kaniko.bot"}])  # fmt: skip
    r = render("--set-json", f"scanRecorder.serviceAccounts={accounts}")
    spec: dict[str, Any] = r.one("ValidatingAdmissionPolicy", "epguard-scan-recorder")["spec"]
    return spec


POLICY = _policy()


def stamp(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def verdict(
    by: str = ME, seen: dt.datetime = T, written: dt.datetime = T, **spec: Any
) -> dict[str, Any]:
    """A scan verdict as the API server hands it to the policy: the writer's managedFields
    entry carries the server's time of the write."""
    body = {"image": "r.example/x:1", "digest": DIGEST, "verdict": "Unusable",
            "source": "scan", "recordedBy": by, "firstSeen": stamp(seen),
            "lastSeen": stamp(seen), "count": 1}  # fmt: skip
    body.update(spec)
    return {
        "apiVersion": "epguard.io/v1alpha1", "kind": "ImageVerdict",
        "metadata": {"name": "scan-" + DIGEST.replace(":", "-"), "managedFields": [{
            "manager": "epguard-scan", "operation": "Update", "time": stamp(written),
            "apiVersion": "epguard.io/v1alpha1", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:spec": {}}}]},
        "spec": body,
    }  # fmt: skip


def refusals(
    operation: str, obj: dict[str, Any] | None, old: dict[str, Any] | None, user: str = ME
) -> list[str]:
    """The messages of the validations that refuse this request (none: admitted)."""
    activation: dict[str, Any] = {
        "request": json_to_cel({"operation": operation, "userInfo": {"username": user}}),
        "object": json_to_cel(obj),
        "oldObject": json_to_cel(old),
    }
    [match] = POLICY["matchConditions"]
    assert _eval(match["expression"], activation), "the policy must match a recorder"
    variables = {v["name"]: _eval(v["expression"], activation) for v in POLICY["variables"]}
    activation["variables"] = celpy.celtypes.MapType(
        {celpy.celtypes.StringType(k): v for k, v in variables.items()}
    )
    return [
        " ".join(v["message"].split())
        for v in POLICY["validations"]
        if not _eval(v["expression"], activation)
    ]


def _eval(expression: str, activation: dict[str, Any]) -> Any:
    result = ENV.program(ENV.compile(expression), functions=CEL_FUNCTIONS).evaluate(activation)
    assert not isinstance(result, CELEvalError), f"{expression}: {result!r}"
    return result


def refused(operation: str, obj: Any, old: Any, user: str = ME) -> str:
    return " | ".join(refusals(operation, obj, old, user))


def test_the_recorders_own_writes_are_admitted() -> None:
    first = verdict()
    assert refusals("CREATE", first, None) == []
    again = verdict(seen=T + dt.timedelta(days=3), written=T + dt.timedelta(days=3),
                    firstSeen=stamp(T), count=2)  # fmt: skip
    assert refusals("UPDATE", again, first) == []
    assert refusals("DELETE", None, again) == []
    # A recorder's clock a few minutes off the API server's is fine.
    assert refusals("CREATE", verdict(seen=T + dt.timedelta(minutes=4)), None) == []


@pytest.mark.parametrize(
    "seen",
    [dt.datetime(2099, 1, 1, tzinfo=dt.UTC), T + dt.timedelta(hours=1), T - dt.timedelta(days=1)],
)
def test_a_last_seen_far_from_the_api_servers_time_of_the_write_is_refused(
    seen: dt.datetime,
) -> None:
    assert "within 5m of the API server's clock" in refused("CREATE", verdict(seen=seen), None)
    old = verdict()
    moved = verdict(seen=seen, written=T + dt.timedelta(minutes=1), firstSeen=stamp(T))
    assert "within 5m of the API server's clock" in refused("UPDATE", moved, old)


def test_a_last_seen_in_another_format_is_refused() -> None:
    odd = verdict(lastSeen="2026-12-01T10:00:00.5+00:00", firstSeen="2026-12-01T10:00:00.5+00:00")
    assert "within 5m" in refused("CREATE", odd, None)


def test_a_write_that_is_not_the_recorders_alone_is_refused() -> None:
    # Its own managedFields entry claiming the future sent under another manager name: the
    # API server adds the writer's entry beside it.
    forged = verdict(seen=dt.datetime(2099, 1, 1, tzinfo=dt.UTC),
                     written=dt.datetime(2099, 1, 1, tzinfo=dt.UTC))  # fmt: skip
    entry = {"manager": "kubectl-replace", "operation": "Update", "time": stamp(T)}
    forged["metadata"]["managedFields"].append(entry)
    assert "writes its verdicts alone" in refused("CREATE", forged, None)
    other_manager = verdict()
    other_manager["metadata"]["managedFields"][0]["manager"] = "kubectl-create"
    assert "writes its verdicts alone" in refused("CREATE", other_manager, None)
    none = verdict()
    del none["metadata"]["managedFields"]
    assert "writes its verdicts alone" in refused("CREATE", none, None)


def test_first_seen_is_last_seen_on_create_and_never_changes_after() -> None:
    early = verdict(firstSeen=stamp(T - dt.timedelta(days=400)))
    assert "firstSeen is lastSeen when the verdict is created" in refused("CREATE", early, None)
    old = verdict()
    later = T + dt.timedelta(hours=2)
    moved = verdict(seen=later, written=later)  # firstSeen moved to the new lastSeen
    assert "never changes after" in refused("UPDATE", moved, old)


def test_another_recorders_verdict_can_be_neither_changed_nor_deleted() -> None:
    theirs = verdict(by=OTHER)
    taken = copy.deepcopy(theirs)
    taken["spec"]["recordedBy"] = ME
    mine = "may change or delete only the verdicts it recorded itself"
    assert mine in refused("UPDATE", taken, theirs)
    assert mine in refused("DELETE", None, theirs)
    assert refusals("DELETE", None, theirs, user=OTHER) == []


@pytest.mark.parametrize("label", ["epguard.io/taught-by", "epguard.io/architecture"])
def test_a_recorder_cannot_label_a_verdict_as_a_namespaces_or_an_architectures(
    label: str,
) -> None:
    """Review helper: scan verdicts labelled epguard.io/taught-by=<victim> counted against
    that namespace's share (controller.verdictsPerNamespace), so its probes taught
    nothing new; the architecture label steers the controller's sweep."""
    labelled = verdict()
    labelled["metadata"]["labels"] = {label: "team-b"}
    said = refusals("CREATE", labelled, None)
    assert any("carry neither epguard.io/taught-by nor epguard.io/architecture" in m
               for m in said), said  # fmt: skip
    plain = verdict()
    plain["metadata"]["labels"] = {"app.kubernetes.io/managed-by": "epguard-scan"}
    assert refusals("CREATE", plain, None) == []


@pytest.mark.parametrize(
    ("part", "value"),
    [
        ("status", {f"k{i}": 0 for i in range(100)}),
        ("annotations", {"x": "y" * 1000}),
        ("finalizers", ["tenant.example/keep"]),
        ("ownerReferences", [{"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "u"}]),
        ("labels", {"app.kubernetes.io/managed-by": "epguard-scan", "team": "a"}),
    ],
)
def test_a_recorders_verdict_is_its_spec_and_the_managed_by_label_alone(
    part: str, value: Any
) -> None:
    """Review helper: an open status (and free metadata) let a recorder store 1.3 MB
    objects of tiny keys, 18.6 MiB each once decoded, in every list the webhook and the
    controller read: twenty of them past both their memory limits."""
    bloated = verdict()
    if part == "status":
        bloated["status"] = value
    else:
        bloated["metadata"][part] = value
    said = refused("CREATE", bloated, None)
    assert "is its spec and the app.kubernetes.io/managed-by label alone" in said, said
    assert "is its spec" in refused("UPDATE", bloated, verdict())
    assert refusals("DELETE", None, bloated) == []  # a recorder may still delete its own
