"""The whole loop on the real node, with epguard installed by helm as the chart's pods:
the mutating webhook injects the probe, the kubelet runs it in the real worker image
(SGLang 0.5.23, torch 2.13.0+cu130, the CUDA 12 mooncake-transfer-engine 0.3.13.post1),
the pod stops in Init:Error with the termination message the kubelet wrote, the
model-download init container never starts, the controller's ImageVerdict is keyed by
the digest containerd reports, and the next workload on the image is refused at apply.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster import ControlPlane
from devcluster.images import BAD_WORKER, ENV_ONLY_WORKER, WorkerImage, images_dir
from tests.e2e.e2e_kube import apply, denied_by_epguard, eventually, wait_event
from tests.e2e.node_e2e import SharedCluster, opted_in_namespace, wait_probe, worker_pod, workload

pytestmark = [pytest.mark.e2e, pytest.mark.node]


@pytest.fixture(scope="module")
def cluster(shared_node: SharedCluster) -> Iterator[ControlPlane]:
    yield shared_node.cluster()
    shared_node.tidy()


@pytest.fixture
def opted_in(cluster: ControlPlane) -> Iterator[str]:
    with opted_in_namespace(cluster) as name:
        yield name


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


_PROBE_FAILED = ("Init:Error", "Init:CrashLoopBackOff")


def _shown_status(cp: ControlPlane, namespace: str, name: str) -> str:
    """The STATUS column of `kubectl get pod`, as an admin reads it."""
    out = cp.kubectl("get", "pod", name, "-n", namespace, "--no-headers").stdout.split()
    return out[2] if len(out) > 2 else ""


def _verdict_digests(cp: ControlPlane) -> list[str]:
    r = cp.kubectl("get", "imageverdicts", "-o", "json", check=True)
    return [v["spec"].get("digest", "") for v in json.loads(r.stdout)["items"]]


def test_a_worker_pod_stops_in_init_error_and_the_next_one_is_refused_at_apply(
    cluster: ControlPlane, opted_in: str, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    started = time.monotonic()
    r = apply(cluster, worker_pod("sglang-0", opted_in, models))
    assert r.returncode == 0, r.stderr
    found = wait_probe(cluster, opted_in, ["--field-selector=metadata.name=sglang-0"])
    elapsed = time.monotonic() - started
    _assert_stopped_before_download(found, models)
    print(f"apply -> termination message in pod status: {elapsed:.1f}s")
    # The pod's restartPolicy is Always, so the kubelet restarts the failed probe after a
    # back-off: between tries `kubectl get` shows Init:1/3 with a restart counted. What an
    # admin sees is one of the two failure states, reached within a back-off or two.
    eventually(
        lambda: _shown_status(cluster, opted_in, "sglang-0") in _PROBE_FAILED,
        within=60,
        what="kubectl get to show the failed probe",
    )
    described = cluster.kubectl("describe", "pod", "sglang-0", "-n", opted_in).stdout
    # Either the State or the Last State block carries it, depending on the back-off.
    shown = r"Message:\s+epguard: mooncake elastic EP is unusable in this image"
    assert re.search(shown, described)

    image_id = found["status"]["imageID"]
    digest = image_id.rsplit("@", 1)[-1]
    assert digest.startswith("sha256:")
    eventually(lambda: digest in _verdict_digests(cluster), within=60, what="the ImageVerdict")

    nxt = worker_pod("sglang-1", opted_in, models)
    eventually(
        lambda: denied_by_epguard(apply(cluster, nxt, dry_run=True)),
        within=60,
        what="the webhook to learn the verdict",
    )
    refused = apply(cluster, nxt)
    assert denied_by_epguard(refused) and "[epguard verdict " in refused.stderr
    deployment = apply(cluster, workload("Deployment", "sglang", opted_in, models))
    assert denied_by_epguard(deployment), deployment.stdout


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_a_workloads_pod_stops_in_init_error_before_its_model_download(
    cluster: ControlPlane, opted_in: str, tmp_path: Path, kind: str
) -> None:
    models = tmp_path / "models"
    r = apply(cluster, workload(kind, "sglang", opted_in, models))
    assert r.returncode == 0, r.stderr
    found = wait_probe(cluster, opted_in, ["-l", "app=sglang"])
    _assert_stopped_before_download(found, models)


def test_on_a_complete_image_the_missing_driver_is_told_in_the_pod_and_never_learned(
    cluster: ControlPlane, opted_in: str, tmp_path: Path
) -> None:
    # The CUDA 13 mooncake build beside CUDA 13 torch, rdma-core installed: nothing in the
    # image is wrong; this machine has no GPU, so no driver is mounted. That is a cause
    # of the pod or its node: the probe says "in this pod" and names only the driver, the
    # controller posts a Warning Event saying what to fix, and no ImageVerdict is made
    # (one such pod must not refuse a good image in every namespace).
    pod = worker_pod("sglang-env", opted_in, tmp_path / "models", ENV_ONLY_WORKER.ref)
    pod["spec"]["restartPolicy"] = "Never"
    r = apply(cluster, pod)
    assert r.returncode == 0, r.stderr
    found = wait_probe(cluster, opted_in, ["--field-selector=metadata.name=sglang-env"])
    first = found["terminated"]["message"].splitlines()[0]
    assert first.startswith("epguard: mooncake elastic EP is unusable in this pod: ")
    assert "libcuda.so.1 (NVIDIA driver not mounted in this container)" in first
    for image_fault in ("libcudart", "rdma-core", "libibverbs", "not built against"):
        assert image_fault not in first

    wait_event(cluster, opted_in, "sglang-env", "MooncakeProbeFailedInPod")
    verdicts = json.loads(cluster.kubectl("get", "imageverdicts", "-o", "json").stdout)["items"]
    learned = [v for v in verdicts if "sglang-env" in v["spec"].get("pod", "")]
    assert learned == [], learned


def test_a_pod_without_gpus_and_with_poisoned_env_never_creates_a_verdict(
    cluster: ControlPlane, opted_in: str, tmp_path: Path
) -> None:
    # The same complete image, from a pod that asks for no GPU and whose env carries
    # interpreter variables that once made the genuine probe report "torch does not
    # import": the probe runs without them and says so, the cause stays in the pod, and
    # nothing is learned about the image.
    pod = worker_pod("sglang-poisoned", opted_in, tmp_path / "models", ENV_ONLY_WORKER.ref)
    pod["spec"]["restartPolicy"] = "Never"
    worker = pod["spec"]["containers"][0]
    worker.pop("resources")
    worker["env"] = [
        {"name": "PYTHONWARNINGS", "value": "error"},
        {"name": "TORCH_LOGS", "value": "not_a_component"},
    ]
    r = apply(cluster, pod)
    assert r.returncode == 0, r.stderr
    found = wait_probe(cluster, opted_in, ["--field-selector=metadata.name=sglang-poisoned"])
    message = found["terminated"]["message"]
    assert message.startswith("epguard: mooncake elastic EP is unusable in this pod: ")
    assert "torch does not import" not in message
    assert "PYTHONWARNINGS" in message and "TORCH_LOGS" in message

    wait_event(cluster, opted_in, "sglang-poisoned", "MooncakeProbeFailedInPod")
    verdicts = json.loads(cluster.kubectl("get", "imageverdicts", "-o", "json").stdout)["items"]
    assert [v for v in verdicts if "sglang-poisoned" in v["spec"].get("pod", "")] == []


@pytest.mark.parametrize("image", [BAD_WORKER, ENV_ONLY_WORKER], ids=lambda i: i.name)
def test_the_scan_of_the_archive_says_what_the_pod_says_about_the_image(
    cluster: ControlPlane, opted_in: str, tmp_path: Path, image: WorkerImage
) -> None:
    # The archive make tools imported into containerd, scanned as a CI step would, and a
    # real pod on the same image: the same image cause (or none), for the same digest.
    archive = images_dir() / f"{image.name}.oci.tar"
    scanned = subprocess.run(
        [sys.executable, "-m", "epguard.webhook.command", "scan", str(archive), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    doc = json.loads(scanned.stdout)
    pod = worker_pod("sglang-scan", opted_in, tmp_path / "models", image.ref)
    pod["spec"]["restartPolicy"] = "Never"
    assert apply(cluster, pod).returncode == 0
    found = wait_probe(cluster, opted_in, ["--field-selector=metadata.name=sglang-scan"])
    first = found["terminated"]["message"].splitlines()[0]
    # Pulled from the node's registry: the kubelet reports the manifest digest, the one
    # the scan names (and pods pin).
    assert found["status"]["imageID"] == f"{image.ref.rsplit(':', 1)[0]}@{doc['digest']}"
    if image is BAD_WORKER:
        assert scanned.returncode == 1
        [cause] = [c for c in doc["causes"] if c["classification"] == "cuda-mismatch"]
        shared = cause["cause"].split("; also missing")[0]
        assert first.startswith("epguard: mooncake elastic EP is unusable in this image: " + shared)
    else:
        assert scanned.returncode == 0, doc["causes"]
        assert first.startswith("epguard: mooncake elastic EP is unusable in this pod: ")
