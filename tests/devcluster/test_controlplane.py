"""The local control plane itself: real kubectl against a real kube-apiserver and etcd."""

from __future__ import annotations

import json
import ssl
import subprocess
import threading
import time

import httpx
import pytest
import yaml

from devcluster import ControlPlane
from devcluster.process import running
from devcluster.stack import Stack

pytestmark = pytest.mark.e2e


def _pod(name: str, namespace: str, image: str) -> str:
    # No serviceAccountName and no automountServiceAccountToken: a plain Pod as a
    # user writes it. It is admitted only because the ServiceAccount admission
    # plugin is off (no controller creates `default` ServiceAccounts here).
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"containers": [{"name": "main", "image": image}]},
        }
    )


def test_a_namespace_created_with_kubectl_is_listed(control_plane: ControlPlane) -> None:
    control_plane.kubectl("create", "namespace", "e2e-listed", check=True)

    out = control_plane.kubectl("get", "namespaces", "-o", "name", check=True).stdout

    assert "namespace/e2e-listed" in out.split()


def test_a_plain_pod_applied_with_kubectl_is_stored_and_read_back(
    control_plane: ControlPlane, namespace: str
) -> None:
    applied = control_plane.kubectl("apply", "-f", "-", input=_pod("web", namespace, "nginx:1.27"))
    assert applied.returncode == 0, applied.stderr
    assert "pod/web created" in applied.stdout

    pod = json.loads(
        control_plane.kubectl("get", "pod", "web", "-n", namespace, "-o", "json", check=True).stdout
    )

    assert pod["spec"]["containers"][0]["image"] == "nginx:1.27"
    # Defaulted by the API server, so the object really went through it.
    assert pod["spec"]["restartPolicy"] == "Always"
    assert pod["status"]["phase"] == "Pending"  # nothing schedules it: no kubelet here


def test_an_anonymous_client_is_refused_by_rbac(control_plane: ControlPlane) -> None:
    verify = ssl.create_default_context(cafile=str(control_plane.ca_file))
    with httpx.Client(verify=verify, trust_env=False) as client:
        r = client.get(f"{control_plane.server}/api/v1/namespaces")

    assert r.status_code == 403
    assert 'User "system:anonymous"' in r.json()["message"]


_POLICY = """
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {name: e2e-no-bad-registry}
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules:
    - apiGroups: [""]
      apiVersions: [v1]
      operations: [CREATE, UPDATE]
      resources: [pods]
  validations:
  - expression: "object.spec.containers.all(c, !c.image.startsWith('bad.example/'))"
    message: images from bad.example are not allowed
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {name: e2e-no-bad-registry}
spec:
  policyName: e2e-no-bad-registry
  validationActions: [Deny]
  matchResources:
    namespaceSelector:
      matchLabels: {epguard-e2e: NAMESPACE}
"""


def test_a_validating_admission_policy_denies_a_matching_pod_and_admits_others(
    control_plane: ControlPlane, namespace: str
) -> None:
    control_plane.kubectl(
        "apply", "-f", "-", input=_POLICY.replace("NAMESPACE", namespace), check=True
    )
    bad = _pod("bad", namespace, "bad.example/app:1")

    # The API server loads policies through an informer: the binding takes effect
    # a moment after it is stored. Dry runs probe for that without creating anything.
    deadline = time.monotonic() + 60
    while True:
        probe = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=bad)
        if probe.returncode != 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    denied = control_plane.kubectl("apply", "-f", "-", input=bad)
    admitted = control_plane.kubectl(
        "apply", "-f", "-", input=_pod("good", namespace, "good.example/app:1")
    )

    assert denied.returncode != 0
    assert "images from bad.example are not allowed" in denied.stderr
    assert "ValidatingAdmissionPolicy 'e2e-no-bad-registry'" in denied.stderr
    assert admitted.returncode == 0, admitted.stderr
    gone = control_plane.kubectl("get", "pod", "bad", "-n", namespace)
    assert "NotFound" in gone.stderr


def _gone(pid: int) -> bool:
    return not running(pid)


def test_stopping_a_control_plane_leaves_no_process_and_no_files_behind() -> None:
    cp = ControlPlane()
    cp.start()
    pids = [p.pid for p in cp.processes]
    dirs = [cp.workdir, cp.data_dir]
    assert cp.kubectl("get", "--raw", "/readyz").stdout == "ok"

    cp.stop()

    assert len(pids) == 2
    assert all(_gone(pid) for pid in pids)
    assert not any(d is not None and d.exists() for d in dirs)


def _elastic_pod(name: str, namespace: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "containers": [
                    {
                        "name": "worker",
                        "image": "lmsysorg/sglang:v0.5.23-cu129",
                        "command": ["python3", "-m", "sglang.launch_server"],
                        "args": ["--elastic-ep-backend", "mooncake"],
                    }
                ]
            },
        }
    )


def _answered_by_epguard(result: subprocess.CompletedProcess[str]) -> bool:
    # Whatever the rules say about the image (deny, warn, or "add the probe"), the
    # webhook's answer names epguard. A failed call names it too, in the webhook's
    # name, when failurePolicy is Fail; with Ignore it leaves no trace at all.
    out = result.stdout + result.stderr
    return "epguard" in out and "failed calling webhook" not in out


def test_the_api_server_calls_the_local_epguard_webhook_only_for_elastic_ep_pods(
    control_plane: ControlPlane, epguard: Stack, namespace: str
) -> None:
    judged = control_plane.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=_elastic_pod("worker", namespace)
    )
    ordinary = control_plane.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=_pod("web", namespace, "nginx:1.27")
    )

    assert _answered_by_epguard(judged), judged
    assert ordinary.returncode == 0, ordinary.stderr
    assert "epguard" not in ordinary.stdout + ordinary.stderr
    assert all(p.alive() for p in epguard.extras)


def test_rotating_the_webhook_certificate_while_pods_are_judged_fails_no_admission(
    control_plane: ControlPlane, epguard: Stack, namespace: str
) -> None:
    stop = threading.Event()
    results: list[subprocess.CompletedProcess[str]] = []

    def judge_pods() -> None:
        pod = _elastic_pod("worker", namespace)
        while not stop.is_set():
            results.append(control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=pod))

    worker = threading.Thread(target=judge_pods)
    worker.start()
    try:
        served = []
        for _ in range(2):
            epguard.rotate_webhook_tls(control_plane)
            served.append(epguard.webhook_tls.cert_file.read_bytes())
    finally:
        stop.set()
        worker.join()

    failed = [r for r in results if not _answered_by_epguard(r)]
    assert len(results) > 1
    assert failed == []
    assert served[0] != served[1]
    assert epguard.webhook_tls.bundle_file.read_bytes().count(b"BEGIN CERTIFICATE") == 1
