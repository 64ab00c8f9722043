"""`epguard scan --record` through a real kube-apiserver, as the chart sets it up.

The chart's scan-recorder objects (ClusterRole, binding, ValidatingAdmissionPolicy) are
rendered by the real helm from ``scanRecorder.serviceAccounts`` and applied; the
recorder is a real ServiceAccount with a TokenRequest token, as a CI pipeline's would
be; the image is the real worker archive `make tools` builds (the CUDA 12 mooncake
beside CUDA 13 torch). Then: the named account records and the webhook refuses a pod
on that digest (and tag) before anything is scheduled; another account is forbidden;
the named account cannot write anything but its own scan verdicts; a passing scan takes
back the scan's verdict of its bytes.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devcluster import ControlPlane, binaries
from devcluster.images import BAD_WORKER, ENV_ONLY_WORKER, images_dir
from devcluster.stack import Stack
from epguard.webhook.scan import record
from tests.chart.chartlib import CHART, NAMESPACE, RELEASE, run_helm
from tests.e2e.e2e_kube import denied_by_epguard, eventually, exists, output, pod, worker
from tests.scan.scan_harness import EPGUARD

pytestmark = [pytest.mark.e2e, pytest.mark.realpkg, pytest.mark.bulk]

POLICY = "epguard-scan-recorder"
ALLOWED, OTHER = "image-scanner", "someone-else"


@dataclass
class Recorders:
    namespace: str
    allowed: Path  # kubeconfig of the ServiceAccount the chart names
    other: Path  # kubeconfig of a ServiceAccount it does not

    def user(self, name: str = ALLOWED) -> str:
        return f"system:serviceaccount:{self.namespace}:{name}"


def _scan(archive: Path, kubeconfig: Path, image: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(EPGUARD), "scan", str(archive), "--format", "json", "--record",
         "--image", image, "--kubeconfig", str(kubeconfig)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _archive(name: str) -> Path:
    path = images_dir() / f"{name}.oci.tar"
    if not path.is_file():
        pytest.fail(f"{path} missing: run `make tools`", pytrace=False)
    return path


def _verdict(cp: ControlPlane, name: str) -> dict[str, Any] | None:
    r = cp.kubectl("get", "imageverdict", name, "-o", "json")
    if r.returncode != 0:
        assert "NotFound" in r.stderr, r.stderr
        return None
    obj: dict[str, Any] = json.loads(r.stdout)
    return obj


def _as(
    cp: ControlPlane, kubeconfig: Path, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """The real kubectl with the ServiceAccount's kubeconfig instead of the admin's, and the
    recorder's field manager on writes (as epguard scan --record sends it)."""
    if args and args[0] in ("create", "replace"):
        args = (args[0], f"--field-manager={record.MANAGER}", *args[1:])
    return subprocess.run(
        [str(binaries.find("kubectl")), "--kubeconfig", str(kubeconfig), *args],
        input=input, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture(scope="module")
def recorders(
    control_plane: ControlPlane, epguard: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Recorders]:
    ns = f"e2e-ci-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", ns, check=True)
    for sa in (ALLOWED, OTHER):
        control_plane.kubectl("create", "serviceaccount", sa, "-n", ns, check=True)
    accounts = json.dumps([{"namespace": ns, "name": ALLOWED}])
    rendered = run_helm(
        "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
        "--show-only", "templates/rbac-scan-recorder.yaml",
        "--set-json", f"scanRecorder.serviceAccounts={accounts}",
    ).stdout  # fmt: skip
    r = control_plane.kubectl("apply", "-f", "-", input=rendered)
    assert r.returncode == 0, output(r)
    d = tmp_path_factory.mktemp("recorders")
    yield Recorders(
        namespace=ns,
        allowed=control_plane.service_account_kubeconfig(ns, ALLOWED, d / "allowed"),
        other=control_plane.service_account_kubeconfig(ns, OTHER, d / "other"),
    )
    control_plane.kubectl("delete", "-f", "-", "--ignore-not-found", input=rendered)
    # The verdicts the tests wrote would refuse these images for the rest of the session.
    control_plane.kubectl(
        "delete", "imageverdicts", "-l", "app.kubernetes.io/managed-by=epguard-scan",
        "--ignore-not-found",
    )  # fmt: skip


def _policy_in_force(cp: ControlPlane, rec: Recorders) -> None:
    """A ValidatingAdmissionPolicy takes effect a moment after it is created: wait until
    a write it refuses is refused."""
    bad = _scan_verdict("sha256:" + "e" * 64, rec.user(), source="probe")

    def refused() -> bool:
        r = _as(cp, rec.allowed, "create", "--dry-run=server", "-f", "-", input=json.dumps(bad))
        return r.returncode != 0 and POLICY in r.stderr

    eventually(refused, within=30, what=f"the {POLICY} policy to be in force")


def _scan_verdict(digest: str, by: str, **spec: Any) -> dict[str, Any]:
    """A scan verdict written by hand, dated now as the recorder dates its own (the policy
    checks the times against the API server's clock: test_verdict_writes.py)."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body: dict[str, Any] = {
        "image": BAD_WORKER.ref, "digest": digest, "verdict": "Unusable",
        "reason": "written by hand", "source": "scan", "recordedBy": by,
        "firstSeen": now, "lastSeen": now,
    }  # fmt: skip
    body.update(spec)
    return {
        "apiVersion": "epguard.io/v1alpha1", "kind": "ImageVerdict",
        "metadata": {"name": "scan-" + digest.replace(":", "-"),
                     "labels": {"app.kubernetes.io/managed-by": "epguard-scan"}},
        "spec": body,
    }  # fmt: skip


def test_the_named_account_records_and_the_webhook_refuses_the_image(
    control_plane: ControlPlane, recorders: Recorders, namespace: str
) -> None:
    r = _scan(_archive(BAD_WORKER.name), recorders.allowed, BAD_WORKER.ref)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    digest, cause = doc["digest"], doc["causes"][0]
    name = "scan-" + digest.replace(":", "-")
    assert f"ImageVerdict {name} created as {recorders.user()}" in r.stderr
    v = _verdict(control_plane, name)
    assert v is not None
    spec = v["spec"]
    assert (spec["source"], spec["verdict"], spec["digest"]) == ("scan", "Unusable", digest)
    assert spec["recordedBy"] == recorders.user() and spec["count"] == 1
    assert spec["reason"] == cause["cause"].splitlines()[0]
    assert v["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "epguard-scan"

    # Pinned by digest, and by tag: refused at admission, so no pod object, nothing scheduled.
    for i, image in enumerate((f"{BAD_WORKER.ref}@{digest}", BAD_WORKER.ref)):
        p = pod(f"worker-{i}", namespace, worker(image))

        def refused(p: dict[str, Any] = p) -> bool:
            res = control_plane.kubectl("create", "-f", "-", input=json.dumps(p))
            return denied_by_epguard(res) and f"[epguard verdict {name}]" in res.stderr

        eventually(refused, within=30, what=f"{image} to be refused by the scan verdict")
        assert not exists(control_plane, "pod", f"worker-{i}", namespace)
    res = control_plane.kubectl("create", "-f", "-", input=json.dumps(pod("w", namespace,
                                worker(f"{BAD_WORKER.ref}@{digest}"))))  # fmt: skip
    assert "found in the image's files by epguard scan, recorded by " + recorders.user() in (
        res.stderr
    )
    assert "cuda" in res.stderr.lower(), res.stderr  # the cause, as the scan said it

    # Recording again counts the run.
    again = _scan(_archive(BAD_WORKER.name), recorders.allowed, BAD_WORKER.ref)
    assert again.returncode == 1 and f"ImageVerdict {name} updated" in again.stderr
    v2 = _verdict(control_plane, name)
    assert v2 is not None and v2["spec"]["count"] == 2
    assert v2["spec"]["firstSeen"] == spec["firstSeen"]


def test_an_account_the_chart_does_not_name_is_forbidden(
    control_plane: ControlPlane, recorders: Recorders
) -> None:
    before = control_plane.kubectl("get", "imageverdicts", "-o", "name").stdout
    r = _scan(_archive(BAD_WORKER.name), recorders.other, f"{BAD_WORKER.ref}-other")
    assert r.returncode == 3, r.stderr
    assert json.loads(r.stdout)["exit"] == 1  # the report is still printed, whole
    assert "not recorded" in r.stderr and f"forbidden for {recorders.user(OTHER)}" in r.stderr
    assert "scanRecorder.serviceAccounts" in r.stderr
    assert control_plane.kubectl("get", "imageverdicts", "-o", "name").stdout == before


def test_the_named_account_writes_nothing_but_its_own_scan_verdicts(
    control_plane: ControlPlane, recorders: Recorders
) -> None:
    _policy_in_force(control_plane, recorders)
    digest = "sha256:" + uuid.uuid4().hex * 2
    user = recorders.user()
    forged = {
        "a probe's verdict": (_scan_verdict(digest, user, source="probe"),
                              "spec.source: scan"),
        "another caller's name": (_scan_verdict(digest, "system:serviceaccount:x:admin"),
                                  "recordedBy must be the recorder's own username"),
        "a Usable verdict": (_scan_verdict(digest, user, verdict="Usable"),
                             "never usable"),
        "a name that is not its digest": (
            {**_scan_verdict(digest, user), "metadata": {"name": "scan-sha256-" + "1" * 64}},
            "named scan-<spec.digest>"),
    }  # fmt: skip
    for what, (obj, message) in forged.items():
        r = _as(control_plane, recorders.allowed, "create", "-f", "-", input=json.dumps(obj))
        assert r.returncode != 0 and message in r.stderr, (what, output(r))
        assert POLICY in r.stderr, what

    # A probe's verdict (written by the admin here, by the controller in a cluster) can be
    # neither changed nor deleted by the recorder.
    probe_name = digest.replace(":", "-")
    probe_verdict = _scan_verdict(digest, user, source="probe")
    probe_verdict["metadata"] = {"name": probe_name}
    del probe_verdict["spec"]["recordedBy"]
    created = control_plane.kubectl("create", "-f", "-", input=json.dumps(probe_verdict))
    assert created.returncode == 0, output(created)
    try:
        patched = _as(control_plane, recorders.allowed, "get", "imageverdict", probe_name,
                      "-o", "json")  # fmt: skip
        assert patched.returncode == 0, output(patched)
        obj = json.loads(patched.stdout)
        obj["spec"]["verdict"] = "Usable"
        r = _as(control_plane, recorders.allowed, "replace", "-f", "-", input=json.dumps(obj))
        # (Its name is not scan-<digest>, which the policy says first.)
        assert r.returncode != 0 and POLICY in r.stderr, output(r)
        r = _as(control_plane, recorders.allowed, "delete", "imageverdict", probe_name)
        assert r.returncode != 0 and "never a probe's" in r.stderr, output(r)
        kept = _verdict(control_plane, probe_name)
        assert kept is not None and kept["spec"]["verdict"] == "Unusable"
    finally:
        control_plane.kubectl("delete", "imageverdict", probe_name, "--ignore-not-found")

    # The other account may not even try (RBAC, before any policy).
    r = _as(control_plane, recorders.other, "create", "-f", "-",
            input=json.dumps(_scan_verdict(digest, recorders.user(OTHER))))  # fmt: skip
    assert r.returncode != 0 and "forbidden" in r.stderr.lower(), output(r)


def test_a_passing_scan_takes_back_the_scan_verdict_of_its_bytes(
    control_plane: ControlPlane, recorders: Recorders
) -> None:
    archive = _archive(ENV_ONLY_WORKER.name)
    first = _scan(archive, recorders.allowed, ENV_ONLY_WORKER.ref)
    assert first.returncode == 0, first.stderr
    assert "nothing recorded (no image cause" in first.stderr
    digest = json.loads(first.stdout)["digest"]
    name = "scan-" + digest.replace(":", "-")
    assert _verdict(control_plane, name) is None
    # A scan verdict for these bytes, as an older epguard might have recorded it: the
    # policy admits it (it is exactly a recorder's write), and the passing scan deletes it.
    _policy_in_force(control_plane, recorders)
    stale = _scan_verdict(digest, recorders.user(), image=ENV_ONLY_WORKER.ref)
    r = _as(control_plane, recorders.allowed, "create", "-f", "-", input=json.dumps(stale))
    assert r.returncode == 0, output(r)
    second = _scan(archive, recorders.allowed, ENV_ONLY_WORKER.ref)
    assert second.returncode == 0, second.stderr
    assert f"ImageVerdict {name} deleted as {recorders.user()}" in second.stderr
    assert _verdict(control_plane, name) is None
