"""Probe injection through the real API server: the chart's MutatingWebhookConfiguration
calls the local webhook's /mutate, and the stored pod carries the probe first.

There is no kube-controller-manager here, so no workload makes pods by itself; each
workload shape's pod is built from its template the way its controller would (same
spec, same annotations) and created with real kubectl.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from devcluster import ControlPlane
from devcluster.stack import Stack
from tests.e2e.e2e_kube import GOOD_IMAGE, as_yaml, eventually, plain, worker, workload

pytestmark = pytest.mark.e2e

GPU = {"limits": {"nvidia.com/gpu": "8"}, "requests": {"nvidia.com/gpu": "8"}}
INJECT = {"epguard.io/inject": "enabled"}


def pod_from_template(name: str, namespace: str, template: Mapping[str, Any]) -> dict[str, Any]:
    meta = dict(template.get("metadata") or {})
    meta.update(name=name, namespace=namespace)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def with_gpus(spec: Mapping[str, Any]) -> dict[str, Any]:
    containers = [{**c, "resources": GPU} for c in spec["containers"]]
    return {**spec, "containers": containers}


def templates_of(kind: str, namespace: str) -> list[dict[str, Any]]:
    """The pod template(s) a workload of ``kind`` makes its worker pods from."""
    obj = workload(kind, "w", namespace, GOOD_IMAGE)
    spec = obj["spec"]
    if kind == "CronJob":
        return [spec["jobTemplate"]["spec"]["template"]]
    if kind == "LeaderWorkerSet":
        return [spec["leaderWorkerTemplate"]["workerTemplate"]]
    if kind == "DynamoGraphDeployment":
        main = spec["services"]["decode"]["extraPodSpec"]["mainContainer"]
        return [{"metadata": {}, "spec": {"containers": [main]}}]
    if kind == "DynamoGraphDeployment/v1beta1":
        return [spec["components"][0]["podTemplate"]]
    return [spec["template"]]


def create(cp: ControlPlane, obj: Mapping[str, Any], dry_run: bool = False) -> dict[str, Any]:
    args = ["create", "-f", "-", "-o", "json"] + (["--dry-run=server"] if dry_run else [])
    r = cp.kubectl(*args, input=as_yaml(obj))
    assert r.returncode == 0, r.stderr
    created: dict[str, Any] = json.loads(r.stdout)
    return created


def init_names(pod: Mapping[str, Any]) -> list[str]:
    return [c["name"] for c in pod["spec"].get("initContainers", [])]


@pytest.fixture
def inject_namespace(control_plane: ControlPlane, epguard: Stack, namespace: str) -> str:
    """A namespace opted in by label, once the webhook's namespace watch has seen it."""
    control_plane.kubectl("label", "namespace", namespace, "epguard.io/inject=enabled", check=True)
    probe = pod_from_template(
        "probe-wait", namespace, {"metadata": {}, "spec": {"containers": [worker(GOOD_IMAGE)]}}
    )
    eventually(
        lambda: "epguard-probe" in init_names(create(control_plane, probe, dry_run=True)),
        what="the webhook to see the namespace's inject label",
    )
    return namespace


@pytest.mark.parametrize(
    "kind",
    [
        "Deployment",
        "StatefulSet",
        "DaemonSet",
        "ReplicaSet",
        "Job",
        "CronJob",
        "LeaderWorkerSet",
        "DynamoGraphDeployment",
        "DynamoGraphDeployment/v1beta1",
    ],
)
def test_pods_of_every_workload_shape_get_the_probe_first_with_the_worker_gpus(
    control_plane: ControlPlane, inject_namespace: str, kind: str
) -> None:
    [template] = templates_of(kind, inject_namespace)
    download = {"name": "download-model", "image": "busybox:1.36", "command": ["true"]}
    spec = with_gpus(template["spec"])
    spec["initContainers"] = [download]
    name = "w-" + kind.lower().replace("/", "-")
    stored = create(
        control_plane, pod_from_template(name, inject_namespace, {**template, "spec": spec})
    )
    assert init_names(stored) == ["epguard-copy-probe", "epguard-probe", "download-model"]
    probe = stored["spec"]["initContainers"][1]
    worker_container = stored["spec"]["containers"][0]
    assert probe["image"] == worker_container["image"]
    assert probe["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert probe["terminationMessagePolicy"] == "FallbackToLogsOnError"
    argv = probe["command"][probe["command"].index("--") + 1 :]
    assert argv == worker_container.get("command", []) + worker_container.get("args", [])
    assert any(v["name"] == "epguard-probe" for v in stored["spec"]["volumes"])
    # The label the controller's pod watch selects on, beside the template's own labels.
    assert stored["metadata"]["labels"]["epguard.io/probed"] == "true"
    for key, value in (template.get("metadata") or {}).get("labels", {}).items():
        assert stored["metadata"]["labels"][key] == value


def test_a_pod_annotation_opts_in_where_the_namespace_did_not(
    control_plane: ControlPlane, epguard: Stack, namespace: str
) -> None:
    annotated = pod_from_template(
        "annotated",
        namespace,
        {"metadata": {"annotations": INJECT}, "spec": {"containers": [worker(GOOD_IMAGE)]}},
    )
    bare = pod_from_template("bare", namespace, {"metadata": {}, "spec": annotated["spec"]})
    # Injection is best effort (failurePolicy Ignore, 5 s timeout): on a loaded 2-core
    # machine the API server's first call on a fresh connection has been seen to time
    # out, which admits the pod unchanged. Wait until a dry run shows the injection.
    eventually(
        lambda: "epguard-probe" in init_names(create(control_plane, annotated, dry_run=True)),
        what="the annotation opt-in to inject",
    )
    assert init_names(create(control_plane, annotated))[:2] == [
        "epguard-copy-probe",
        "epguard-probe",
    ]
    assert init_names(create(control_plane, bare)) == []


def test_pods_without_the_flag_are_never_injected(
    control_plane: ControlPlane, inject_namespace: str
) -> None:
    web = pod_from_template(
        "web", inject_namespace, {"metadata": {}, "spec": {"containers": [plain()]}}
    )
    assert init_names(create(control_plane, web)) == []


def test_a_pod_that_already_carries_the_probe_is_stored_as_written(
    control_plane: ControlPlane, inject_namespace: str
) -> None:
    first = create(
        control_plane,
        pod_from_template(
            "first",
            inject_namespace,
            {"metadata": {}, "spec": {"containers": [worker(GOOD_IMAGE)]}},
        ),
    )
    spec = {k: first["spec"][k] for k in ("initContainers", "containers", "volumes")}
    again = create(
        control_plane, pod_from_template("again", inject_namespace, {"metadata": {}, "spec": spec})
    )
    assert init_names(again) == init_names(first)
