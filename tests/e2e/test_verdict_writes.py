"""ImageVerdict writes through a real kube-apiserver (the chart's CRD and scan-recorder
policy, nothing else of epguard): what the controller writes from a probe fits the CRD,
and a scan recorder can neither date its verdicts into the future nor touch another
recorder's.

The recorders here are real ServiceAccounts with TokenRequest tokens, writing with the
real kubectl, as a CI pipeline would; ``epguard scan --record`` itself, on a real image
archive, is tested in test_scan_record.py.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster import ControlPlane, binaries
from devcluster.stack import Stack
from epguard.webhook.engine.outcome import outcomes_of, verdict_spec
from epguard.webhook.engine.verdicts import MAX_VERSION, verdict_name, verdict_object
from epguard.webhook.scan.record import MANAGER
from tests.chart.chartlib import CHART, NAMESPACE, RELEASE, run_helm
from tests.e2e.e2e_kube import apply, denied_by_epguard, eventually, output, pod, worker

pytestmark = [pytest.mark.e2e]

POLICY = "epguard-scan-recorder"
FIRST, SECOND = "scanner-a", "scanner-b"
IMAGE = "registry.example.com/ml/sglang:v0.5.18-e2e"
FORMAT = "%Y-%m-%dT%H:%M:%SZ"


@dataclass
class Recorders:
    namespace: str
    kubeconfigs: dict[str, Path]

    def user(self, name: str) -> str:
        return f"system:serviceaccount:{self.namespace}:{name}"


def _render(*args: str) -> str:
    return run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args).stdout


@pytest.fixture(scope="module")
def crd(control_plane: ControlPlane) -> None:
    """The chart's CRDs alone, marked as the release's, so that a later ``helm install`` of
    the session's epguard (the ``epguard`` fixture) adopts them instead of failing."""
    owner = {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": NAMESPACE}
    for crd in yaml.safe_load_all(_render("--show-only", "templates/crds.yaml")):
        if not crd:
            continue
        crd["metadata"].setdefault("labels", {})["app.kubernetes.io/managed-by"] = "Helm"
        crd["metadata"].setdefault("annotations", {}).update(owner)
        r = control_plane.kubectl("apply", "-f", "-", input=json.dumps(crd))
        assert r.returncode == 0, output(r)
    control_plane.kubectl("wait", "--for=condition=Established",
                          "crd/imageverdicts.epguard.io", check=True)  # fmt: skip


@pytest.fixture(scope="module")
def recorders(
    control_plane: ControlPlane, crd: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Recorders]:
    """Two accounts the chart names as recorders, and its policy in force."""
    ns = f"e2e-rec-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", ns, check=True)
    for sa in (FIRST, SECOND):
        control_plane.kubectl("create", "serviceaccount", sa, "-n", ns, check=True)
    accounts = json.dumps([{"namespace": ns, "name": n} for n in (FIRST, SECOND)])
    rendered = _render("--show-only", "templates/rbac-scan-recorder.yaml",
                       "--set-json", f"scanRecorder.serviceAccounts={accounts}")  # fmt: skip
    r = control_plane.kubectl("apply", "-f", "-", input=rendered)
    assert r.returncode == 0, output(r)
    d = tmp_path_factory.mktemp("recorders")
    rec = Recorders(ns, {n: control_plane.service_account_kubeconfig(ns, n, d / n)
                         for n in (FIRST, SECOND)})  # fmt: skip
    _policy_in_force(control_plane, rec)
    yield rec
    control_plane.kubectl("delete", "-f", "-", "--ignore-not-found", input=rendered)
    control_plane.kubectl(
        "delete", "imageverdicts", "-l", f"app.kubernetes.io/managed-by={MANAGER}",
        "--ignore-not-found",
    )  # fmt: skip


def _as(
    rec: Recorders, who: str, *args: str, body: dict[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real kubectl as ServiceAccount ``who``."""
    return subprocess.run(
        [str(binaries.find("kubectl")), "--kubeconfig", str(rec.kubeconfigs[who]), *args],
        input=None if body is None else json.dumps(body), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def _stamp(at: dt.datetime) -> str:
    return at.astimezone(dt.UTC).strftime(FORMAT)


def _verdict(digest: str, by: str, seen: dt.datetime, **spec: Any) -> dict[str, Any]:
    """A scan verdict exactly as ``epguard scan --record`` writes one (record.spec)."""
    body: dict[str, Any] = {
        "image": IMAGE, "digest": digest, "verdict": "Unusable", "reason": "written by hand",
        "report": "", "versions": {}, "count": 1, "source": "scan", "recordedBy": by,
        "firstSeen": _stamp(seen), "lastSeen": _stamp(seen),
    }  # fmt: skip
    body.update(spec)
    return {
        "apiVersion": "epguard.io/v1alpha1", "kind": "ImageVerdict",
        "metadata": {"name": "scan-" + digest.replace(":", "-"),
                     "labels": {"app.kubernetes.io/managed-by": MANAGER}},
        "spec": body,
    }  # fmt: skip


def _digest() -> str:
    return "sha256:" + uuid.uuid4().hex * 2


def _create(rec: Recorders, who: str, obj: dict[str, Any], manager: str = MANAGER) -> Any:
    return _as(rec, who, "create", f"--field-manager={manager}", "-f", "-", body=obj)


def _replace(rec: Recorders, who: str, obj: dict[str, Any], manager: str = MANAGER) -> Any:
    return _as(rec, who, "replace", f"--field-manager={manager}", "-f", "-", body=obj)


def _get(cp: ControlPlane, name: str) -> dict[str, Any] | None:
    r = cp.kubectl("get", "imageverdict", name, "-o", "json")
    if r.returncode != 0:
        assert "NotFound" in r.stderr, r.stderr
        return None
    obj: dict[str, Any] = json.loads(r.stdout)
    return obj


def _refused(r: subprocess.CompletedProcess[str], message: str) -> bool:
    return r.returncode != 0 and POLICY in r.stderr and message in r.stderr


def _policy_in_force(cp: ControlPlane, rec: Recorders) -> None:
    """A ValidatingAdmissionPolicy takes effect a moment after it is created."""
    bad = _verdict(_digest(), rec.user(FIRST), dt.datetime.now(dt.UTC), source="probe")

    def refused() -> bool:
        r = _as(rec, FIRST, "create", "--dry-run=server", f"--field-manager={MANAGER}",
                "-f", "-", body=bad)  # fmt: skip
        return r.returncode != 0 and POLICY in r.stderr

    eventually(refused, within=30, what=f"the {POLICY} policy to be in force")


FUTURE = "within 5m of the API server's clock"


def test_a_recorder_cannot_create_a_verdict_dated_in_the_future(recorders: Recorders) -> None:
    now = dt.datetime.now(dt.UTC)
    user = recorders.user(FIRST)
    for seen in (dt.datetime(2099, 1, 1, tzinfo=dt.UTC), now + dt.timedelta(hours=1)):
        r = _create(recorders, FIRST, _verdict(_digest(), user, seen))
        assert _refused(r, FUTURE), output(r)
    # Nor far in the past (a clock that is wrong either way), nor in another format.
    r = _create(recorders, FIRST, _verdict(_digest(), user, now - dt.timedelta(days=2)))
    assert _refused(r, FUTURE), output(r)
    odd = _verdict(_digest(), user, now, lastSeen=now.strftime("%Y-%m-%dT%H:%M:%S.%f+00:00"))
    assert _refused(_create(recorders, FIRST, odd), FUTURE)
    # firstSeen is the creation's lastSeen.
    early = _verdict(_digest(), user, now, firstSeen="2001-01-01T00:00:00Z")
    r = _create(recorders, FIRST, early)
    assert _refused(r, "firstSeen is lastSeen when the verdict is created"), output(r)
    # The time of the write, as epguard scan --record writes it, is admitted.
    r = _create(recorders, FIRST, _verdict(_digest(), user, now))
    assert r.returncode == 0, output(r)


def test_a_recorders_verdict_is_its_spec_and_the_managed_by_label_alone(
    recorders: Recorders, control_plane: ControlPlane
) -> None:
    """Review helper: an open status held 1.3 MB objects of tiny keys (18.6 MiB each
    decoded) in every list the webhook and the controller read. The real API server
    prunes a status (the CRD's is closed) and the policy refuses one, and any other
    metadata than the managed-by label."""
    now = dt.datetime.now(dt.UTC)
    user = recorders.user(FIRST)
    alone = "is its spec and the app.kubernetes.io/managed-by label alone"
    for part, value in (
        ("status", {f"k{i}": i for i in range(50)}),
        ("annotations", {"x": "y"}),
        ("finalizers", ["tenant.example/keep"]),
    ):
        bloated = _verdict(_digest(), user, now)
        if part == "status":
            bloated["status"] = value
        else:
            bloated["metadata"][part] = value
        # Without kubectl's strict field validation (a client that asks for none, as the
        # Python client does): the fields are pruned, and the policy still refuses.
        r = _as(recorders, FIRST, "create", "--validate=false", f"--field-manager={MANAGER}",
                "-f", "-", body=bloated)  # fmt: skip
        assert _refused(r, alone), (part, output(r))
    # An admin's write keeps no status either: the CRD prunes it.
    admin = _verdict(_digest(), "admin", now)
    admin["status"] = {f"k{i}": i for i in range(50)}
    r = control_plane.kubectl("create", "--validate=false", "-f", "-", input=json.dumps(admin))
    assert r.returncode == 0, output(r)
    stored = _get(control_plane, admin["metadata"]["name"])
    assert stored is not None and not stored.get("status"), stored.get("status")
    control_plane.kubectl("delete", "imageverdict", admin["metadata"]["name"])  # fmt: skip


def test_a_recorder_cannot_label_its_verdict_as_a_namespaces_or_an_architectures(
    recorders: Recorders,
) -> None:
    """Review helper: scan verdicts labelled epguard.io/taught-by=<victim> counted against
    that namespace's share, so its probes taught nothing new."""
    now = dt.datetime.now(dt.UTC)
    for label in ("epguard.io/taught-by", "epguard.io/architecture"):
        labelled = _verdict(_digest(), recorders.user(FIRST), now)
        labelled["metadata"]["labels"][label] = "team-b"
        r = _create(recorders, FIRST, labelled)
        assert _refused(r, "carry neither epguard.io/taught-by nor"), output(r)


def test_a_recorder_cannot_move_its_verdict_into_the_future(
    control_plane: ControlPlane, recorders: Recorders
) -> None:
    user = recorders.user(FIRST)
    digest = _digest()
    name = "scan-" + digest.replace(":", "-")
    r = _create(recorders, FIRST, _verdict(digest, user, dt.datetime.now(dt.UTC)))
    assert r.returncode == 0, output(r)
    current = _get(control_plane, name)
    assert current is not None
    future = "2099-01-01T00:00:00Z"

    def moved(**meta: Any) -> dict[str, Any]:
        obj: dict[str, Any] = json.loads(json.dumps(current))
        obj["spec"]["lastSeen"] = future
        obj["metadata"].update(meta)
        return obj

    # Plainly; with a managedFields entry of its own that claims the future, under the
    # recorder's manager name (the API server stamps that entry with its own clock) or
    # under another (the server's entry for the writer joins it).
    forged = [{"manager": MANAGER, "operation": "Update", "apiVersion": "epguard.io/v1alpha1",
               "time": future, "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {}}}]  # fmt: skip
    attempts = {
        "plain": (moved(), MANAGER, FUTURE),
        "forged entry, same manager": (moved(managedFields=forged), MANAGER, FUTURE),
        "forged entry, other manager": (moved(managedFields=forged), "evil",
                                        "writes its verdicts alone"),
        "another manager": (moved(), "kubectl-edit", "writes its verdicts alone"),
    }  # fmt: skip
    for what, (obj, manager, message) in attempts.items():
        r = _replace(recorders, FIRST, obj, manager)
        assert _refused(r, message), (what, output(r))
    kept = _get(control_plane, name)
    assert kept is not None and kept["spec"]["lastSeen"] == current["spec"]["lastSeen"]

    # Re-recording now, as the recorder does (firstSeen carried), is admitted; changing
    # firstSeen is not.
    again = json.loads(json.dumps(kept))
    again["spec"].update(lastSeen=_stamp(dt.datetime.now(dt.UTC)), count=2)
    r = _replace(recorders, FIRST, {**again, "spec": {**again["spec"], "firstSeen": future}})
    assert _refused(r, "never changes after"), output(r)
    r = _replace(recorders, FIRST, again)
    assert r.returncode == 0, output(r)


def test_a_recorder_cannot_change_or_delete_another_recorders_verdict(
    control_plane: ControlPlane, recorders: Recorders
) -> None:
    digest = _digest()
    name = "scan-" + digest.replace(":", "-")
    r = _create(recorders, FIRST, _verdict(digest, recorders.user(FIRST), dt.datetime.now(dt.UTC)))
    assert r.returncode == 0, output(r)
    theirs = _get(control_plane, name)
    assert theirs is not None
    # Taking it over: the same verdict, recorded again under the second account's name.
    taken = json.loads(json.dumps(theirs))
    taken["spec"].update(recordedBy=recorders.user(SECOND),
                         lastSeen=_stamp(dt.datetime.now(dt.UTC)))  # fmt: skip
    mine = "may change or delete only the verdicts it recorded itself"
    r = _replace(recorders, SECOND, taken)
    assert _refused(r, mine), output(r)
    r = _as(recorders, SECOND, "delete", "imageverdict", name)
    assert _refused(r, mine), output(r)
    kept = _get(control_plane, name)
    assert kept is not None and kept["spec"]["recordedBy"] == recorders.user(FIRST)
    # Its own recorder still may.
    r = _as(recorders, FIRST, "delete", "imageverdict", name)
    assert r.returncode == 0, output(r)


def test_the_webhook_lets_a_newer_verdict_outrank_one_dated_in_the_future(
    control_plane: ControlPlane, epguard: Stack, namespace: str
) -> None:
    """A scan verdict dated 2099 (written by an admin here, as a recorder could before the
    policy checked times) then a newer Usable probe verdict for the same bytes: the
    webhook, reading both from the real watch, goes by the newer one."""
    digest = _digest()
    scan = _verdict(digest, "someone", dt.datetime(2099, 1, 1, tzinfo=dt.UTC))
    probe = _verdict(digest, "", dt.datetime.now(dt.UTC), source="probe", verdict="Usable")
    probe["metadata"] = {"name": digest.replace(":", "-"),
                         "labels": {"app.kubernetes.io/managed-by": "epguard-e2e"}}  # fmt: skip
    del probe["spec"]["recordedBy"]
    pinned = pod("pinned", namespace, worker(f"{IMAGE}@{digest}"))
    tagged = pod("tagged", namespace, worker(IMAGE))
    try:
        r = control_plane.kubectl("create", "-f", "-", input=json.dumps(scan))
        assert r.returncode == 0, output(r)
        eventually(lambda: denied_by_epguard(apply(control_plane, pinned, dry_run=True)),
                   within=30, what="the webhook to hold the scan verdict")  # fmt: skip
        time.sleep(1.1)  # the probe verdict's write is a later second on the server's clock
        probe["spec"]["lastSeen"] = probe["spec"]["firstSeen"] = _stamp(dt.datetime.now(dt.UTC))
        r = control_plane.kubectl("create", "-f", "-", input=json.dumps(probe))
        assert r.returncode == 0, output(r)
        for p in (pinned, tagged):

            def admitted(p: dict[str, Any] = p) -> bool:
                return apply(control_plane, p, dry_run=True).returncode == 0

            what = f"{p['metadata']['name']}: the newer verdict to answer"
            eventually(admitted, within=60, what=what)
    finally:
        for name in (scan["metadata"]["name"], probe["metadata"]["name"]):
            control_plane.kubectl("delete", "imageverdict", name, "--ignore-not-found")


PROBE_MESSAGE = (
    "epguard: mooncake elastic EP is unusable in this image: mooncake.pg was built for "
    "another torch\n"
    "versions: torch={torch} sglang=0.5.18 mooncake-transfer-engine={mooncake}\n"
    "fix: install the mooncake build for this torch"
)


def test_the_controller_verdict_of_a_probe_claiming_huge_versions_fits_the_crd(
    control_plane: ControlPlane, crd: None
) -> None:
    """An image's METADATA may claim any version; the probe reports it as it is, and the
    verdict the controller builds from that report must still be one the CRD takes."""
    message = PROBE_MESSAGE.format(torch="2." + "9" * 4000, mooncake="0." + "1" * 300)
    digest = _digest()
    status = {
        "name": "epguard-probe", "image": IMAGE, "imageID": f"{IMAGE}@{digest}",
        "restartCount": 0,
        "state": {"terminated": {"exitCode": 1, "message": message,
                                 "finishedAt": "2026-12-01T10:00:00Z"}},
    }  # fmt: skip
    pod = {
        "metadata": {"name": "w", "namespace": "ml", "uid": "u-1"},
        "spec": {"initContainers": [{
            "name": "epguard-probe", "image": IMAGE,
            "command": ["python3", "/epguard/probe", "--"],
            "args": ["python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "mooncake"],
        }]},
        "status": {"initContainerStatuses": [status]},
    }  # fmt: skip
    [outcome] = outcomes_of(pod)
    spec = verdict_spec(outcome, "ml/w", dt.datetime.now(dt.UTC), None, "u-1/x")
    name = verdict_name(outcome.image, outcome.digest)
    body = verdict_object(name, spec, "epguard-controller", None)
    r = control_plane.kubectl("create", "-f", "-", input=json.dumps(body))
    try:
        assert r.returncode == 0, output(r)
        stored = _get(control_plane, name)
        assert stored is not None
        versions = stored["spec"]["versions"]
        assert len(versions["torch"]) == MAX_VERSION and versions["torch"].endswith("…")
        assert versions["torch"].startswith("2.999")
        assert len(versions["mooncake"]) == MAX_VERSION
    finally:
        control_plane.kubectl("delete", "imageverdict", name, "--ignore-not-found")


def test_a_namespaces_share_of_verdicts_is_counted_from_the_labels_the_api_server_keeps(
    control_plane: ControlPlane, crd: None
) -> None:
    """controller.verdictsPerNamespace: the recorder counts the verdicts a namespace's
    probes taught by the label it writes on create, through the real API server."""
    from kubernetes import config as kube_config

    from epguard.webhook.controller.recorder import KubeRecorderApi

    api = KubeRecorderApi(kube_config.new_client_from_config(str(control_plane.kubeconfig)))
    mine, other = f"team-{uuid.uuid4().hex[:8]}", f"team-{uuid.uuid4().hex[:8]}"
    names = []
    try:
        for i, namespace in enumerate([mine, mine, mine, other]):
            digest = _digest()
            spec = {
                "image": IMAGE, "digest": digest, "verdict": "Unusable", "reason": "x",
                "report": "x", "versions": {}, "firstSeen": "2026-12-01T10:00:00Z",
                "lastSeen": "2026-12-01T10:00:00Z", "count": 1, "pod": f"{namespace}/w-{i}",
            }  # fmt: skip
            name = verdict_name(IMAGE, digest)
            api.create_verdict(verdict_object(name, spec, "epguard-controller", None, namespace))  # type: ignore[arg-type]
            names.append(name)
        assert api.count_taught(mine, 10) == 3
        assert api.count_taught(other, 10) == 1
        assert api.count_taught("nobody", 10) == 0
        # An update by another namespace's probe keeps the label of the one that taught it.
        stored = api.read_verdict(names[0])
        assert stored is not None
        api.replace_verdict(
            names[0], verdict_object(names[0], stored["spec"], "epguard-controller", stored, other)
        )
        assert api.count_taught(mine, 10) == 3
    finally:
        for name in names:
            control_plane.kubectl("delete", "imageverdict", name, "--ignore-not-found")
