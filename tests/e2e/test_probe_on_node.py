"""The whole loop on the real node, with epguard installed by helm as the chart's pods:
the mutating webhook injects the probe, the kubelet runs it in the real worker image
(SGLang 0.5.23, torch 2.13.0+cu130, the CUDA 12 mooncake-transfer-engine 0.3.13.post1),
the pod stops in Init:Error with the termination message the kubelet wrote, the
model-download init container never starts, the controller's ImageVerdict is keyed by
the digest containerd reports, and the next workload on the image is refused at apply.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_kube import WORKER_ARGS, WORKER_COMMAND, apply, denied_by_epguard, eventually

from devcluster import ControlPlane
from devcluster.images import BAD_WORKER, BUSYBOX_IMAGE
from devcluster.stack import CHART_DIR, Stack, deploy_chart, start_cluster

pytestmark = pytest.mark.e2e

PROBE = "epguard-probe"
# The injected probe imports torch from a 5 GB layer on two shared cores.
PROBE_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    stack = Stack(run_dir=tmp_path_factory.mktemp("stack"), detached=False)
    try:
        start_cluster(stack)
        assert stack.control_plane is not None
        deploy_chart(stack, stack.control_plane, CHART_DIR, [])
        yield stack.control_plane
    finally:
        stack.stop()


@pytest.fixture
def opted_in(cluster: ControlPlane) -> Iterator[str]:
    """A fresh namespace opted in to probe injection, seen by the webhook, and no
    ImageVerdict left from an earlier test (each test learns its own). Deleted after
    the test, which frees the node's (fake) GPUs for the next one."""
    cluster.kubectl("delete", "imageverdicts", "--all", check=True)
    name = f"ml-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name, check=True)
    cluster.kubectl("label", "namespace", name, "epguard.io/inject=enabled", check=True)
    probe = _worker_pod("dry-run", name, Path("/nonexistent"))

    def injected_and_admitted() -> bool:
        r = cluster.kubectl(
            "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(probe)
        )
        return r.returncode == 0 and PROBE in r.stdout

    eventually(injected_and_admitted, within=60, what="the webhook to inject and admit")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=true", "--timeout=120s", timeout=180)


def _worker_spec(models: Path) -> dict[str, Any]:
    """A worker with a GPU request and a model-download init container that would leave
    a marker on a hostPath: the probe is injected before it."""
    return {
        "terminationGracePeriodSeconds": 1,
        "volumes": [
            {"name": "models", "hostPath": {"path": str(models), "type": "DirectoryOrCreate"}}
        ],
        "initContainers": [
            {
                "name": "model-download",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", "echo downloading > /models/started"],
                "volumeMounts": [{"name": "models", "mountPath": "/models"}],
            }
        ],
        "containers": [
            {
                "name": "worker",
                "image": BAD_WORKER.ref,
                "imagePullPolicy": "Never",
                "command": list(WORKER_COMMAND),
                "args": list(WORKER_ARGS),
                "resources": {"limits": {"nvidia.com/gpu": 8}},
                "volumeMounts": [{"name": "models", "mountPath": "/models"}],
            }
        ],
    }


def _worker_pod(name: str, namespace: str, models: Path) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": _worker_spec(models),
    }


def _workload(kind: str, name: str, namespace: str, models: Path) -> dict[str, Any]:
    labels = {"app": name}
    template = {"metadata": {"labels": labels}, "spec": _worker_spec(models)}
    if kind == "Deployment":
        spec = {"replicas": 1, "selector": {"matchLabels": labels}, "template": template}
        return {
            "apiVersion": "apps/v1",
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }
    template["spec"]["restartPolicy"] = "Never"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"backoffLimit": 0, "template": template},
    }


def _probe_status(cp: ControlPlane, namespace: str, selector: list[str]) -> dict[str, Any] | None:
    """The probe's container status once the kubelet recorded its termination (in
    ``state`` with restartPolicy Never, ``lastState`` once a restart is pending)."""
    r = cp.kubectl("get", "pods", "-n", namespace, *selector, "-o", "json")
    if r.returncode != 0:
        return None
    for pod in json.loads(r.stdout)["items"]:
        for s in pod.get("status", {}).get("initContainerStatuses", []):
            for state in (s.get("state", {}), s.get("lastState", {})):
                if s["name"] == PROBE and "terminated" in state:
                    return {"pod": pod, "status": s, "terminated": state["terminated"]}
    return None


def _wait_probe(cp: ControlPlane, namespace: str, selector: list[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def done() -> bool:
        result = _probe_status(cp, namespace, selector)
        if result:
            found.update(result)
        return bool(result)

    eventually(done, within=PROBE_TIMEOUT, what="the kubelet to record the probe's end", every=0.5)
    return found


def _assert_stopped_before_download(found: dict[str, Any], models: Path) -> None:
    term = found["terminated"]
    assert term["exitCode"] == 1
    message = term["message"]
    assert message.startswith("epguard: mooncake elastic EP is unusable in this image")
    assert "libcudart.so.12" in message
    statuses = {s["name"]: s for s in found["pod"]["status"]["initContainerStatuses"]}
    download = statuses["model-download"]
    assert "waiting" in download["state"] and not download.get("containerID")
    assert not (models / "started").exists()


def _verdict_digests(cp: ControlPlane) -> list[str]:
    r = cp.kubectl("get", "imageverdicts", "-o", "json", check=True)
    return [v["spec"].get("digest", "") for v in json.loads(r.stdout)["items"]]


def test_a_worker_pod_stops_in_init_error_and_the_next_one_is_refused_at_apply(
    cluster: ControlPlane, opted_in: str, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    started = time.monotonic()
    r = apply(cluster, _worker_pod("sglang-0", opted_in, models))
    assert r.returncode == 0, r.stderr
    found = _wait_probe(cluster, opted_in, ["--field-selector=metadata.name=sglang-0"])
    elapsed = time.monotonic() - started
    _assert_stopped_before_download(found, models)
    print(f"apply -> termination message in pod status: {elapsed:.1f}s")
    described = cluster.kubectl("describe", "pod", "sglang-0", "-n", opted_in).stdout
    assert "Init:Error" in cluster.kubectl("get", "pod", "sglang-0", "-n", opted_in).stdout
    assert "Message:  epguard: mooncake elastic EP is unusable in this image" in described

    image_id = found["status"]["imageID"]
    digest = image_id.rsplit("@", 1)[-1]
    assert digest.startswith("sha256:")
    eventually(lambda: digest in _verdict_digests(cluster), within=60, what="the ImageVerdict")

    nxt = _worker_pod("sglang-1", opted_in, models)
    eventually(
        lambda: denied_by_epguard(apply(cluster, nxt, dry_run=True)),
        within=60,
        what="the webhook to learn the verdict",
    )
    refused = apply(cluster, nxt)
    assert denied_by_epguard(refused) and "[epguard verdict " in refused.stderr
    deployment = apply(cluster, _workload("Deployment", "sglang", opted_in, models))
    assert denied_by_epguard(deployment), deployment.stdout


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_a_workloads_pod_stops_in_init_error_before_its_model_download(
    cluster: ControlPlane, opted_in: str, tmp_path: Path, kind: str
) -> None:
    models = tmp_path / "models"
    r = apply(cluster, _workload(kind, "sglang", opted_in, models))
    assert r.returncode == 0, r.stderr
    found = _wait_probe(cluster, opted_in, ["-l", "app=sglang"])
    _assert_stopped_before_download(found, models)
