"""The real node (devcluster.node): a kubelet on containerd + runc with a CNI bridge,
kube-scheduler, kube-controller-manager and kube-proxy, joined to a real control plane.

Everything here is written by the real components: the pod status (termination
message included) by the kubelet, the binding by the scheduler, the ReplicaSet and
its pods by kube-controller-manager, the Service's iptables rules by kube-proxy.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from devcluster import ControlPlane, ociimage
from devcluster.images import BUSYBOX_IMAGE, build_busybox
from devcluster.node import NODE_NAME, Node, node_ip
from tests.e2e.e2e_kube import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.node]

BUSYBOX = {"image": BUSYBOX_IMAGE, "imagePullPolicy": "IfNotPresent"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, machine_to_itself: None) -> Iterator[Node]:
    cp = ControlPlane(node_ip=node_ip())
    cp.start()
    node = Node(cp, tmp_path_factory.mktemp("node"))
    try:
        node.start(images=[build_busybox()])
        yield node
    finally:
        node.stop()
        cp.stop()


@pytest.fixture(scope="module")
def cluster(node: Node) -> ControlPlane:
    return node.cp


def apply(cp: ControlPlane, obj: dict[str, Any]) -> None:
    r = cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))
    assert r.returncode == 0, r.stderr


def get(cp: ControlPlane, *args: str) -> dict[str, Any]:
    r = cp.kubectl("get", *args, "-o", "json")
    assert r.returncode == 0, r.stderr
    data: dict[str, Any] = json.loads(r.stdout)
    return data


def wait_for(what: str, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.2)


def test_the_node_registers_ready_with_the_pinned_kubelet(cluster: ControlPlane) -> None:
    node = get(cluster, "node", NODE_NAME)
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.35.4"
    assert info["containerRuntimeVersion"].startswith("containerd://")
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready[0]["status"] == "True"
    # kube-controller-manager's node-lifecycle controller removes the not-ready taint,
    # a few seconds after the kubelet reports Ready (its monitor period is 5 s).
    eventually(
        lambda: not get(cluster, "node", NODE_NAME)["spec"].get("taints"),
        within=30,
        what="the node-lifecycle controller to lift the not-ready taint",
    )


def test_the_kubelet_pulls_an_image_built_here_from_the_nodes_registry(node: Node) -> None:
    # Nothing is imported into containerd: an image it lacks is pulled by name
    # (localhost/epguard/...) from the node's registry, every blob of it counted in the
    # registry's access log, and the kubelet reports the archive's manifest digest.
    [(name, digest)] = ociimage.archive_images(build_busybox()).items()
    node.forget_image(name)
    assert name not in node.image_digests()
    since = node.registry.log_offset()
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "pulled", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", **BUSYBOX, "command": ["true"]}],
        },
    }
    apply(node.cp, pod)

    def finished() -> dict[str, Any] | None:
        statuses = get(node.cp, "pod", "pulled").get("status", {}).get("containerStatuses", [])
        return statuses[0] if statuses and "terminated" in statuses[0]["state"] else None

    status = wait_for("the pulled pod to finish", finished)
    assert status["state"]["terminated"]["exitCode"] == 0
    assert status["imageID"] == f"{name.rsplit(':', 1)[0]}@{digest}"
    assert node.image_digests()[name] == digest
    manifest = json.loads(node.ctr("content", "get", digest))
    served = node.registry.blob_gets(since)
    for layer in manifest["layers"]:
        assert served[layer["digest"]].bytes == layer["size"]
    events = node.cp.kubectl("get", "events", "--field-selector=involvedObject.name=pulled").stdout
    assert f'Pulling image "{name}"' in events and "Successfully pulled image" in events


def test_a_failing_init_container_stops_the_pod_with_the_message_the_kubelet_wrote(
    cluster: ControlPlane,
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "init-fails", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "initContainers": [
                {
                    "name": "check",
                    **BUSYBOX,
                    "command": [
                        "sh",
                        "-c",
                        "echo 'epguard: unusable because X' > /dev/termination-log; exit 1",
                    ],
                },
                {"name": "download", **BUSYBOX, "command": ["sh", "-c", "echo never"]},
            ],
            "containers": [{"name": "main", **BUSYBOX, "command": ["sleep", "3600"]}],
        },
    }
    started = time.monotonic()
    apply(cluster, pod)

    def terminated() -> dict[str, Any] | None:
        statuses = get(cluster, "pod", "init-fails").get("status", {})
        for s in statuses.get("initContainerStatuses", []):
            if s["name"] == "check" and "terminated" in s["state"]:
                return statuses
        return None

    status = wait_for("the init container to terminate", terminated)
    elapsed = time.monotonic() - started
    check, download = status["initContainerStatuses"]
    assert check["state"]["terminated"]["message"] == "epguard: unusable because X\n"
    assert check["state"]["terminated"]["exitCode"] == 1
    assert check["containerID"].startswith("containerd://")
    # The next init container never started: no container was created for it.
    assert "waiting" in download["state"] and not download.get("containerID")
    assert elapsed < 30, f"apply -> termination message took {elapsed:.1f}s"
    described = cluster.kubectl("describe", "pod", "init-fails").stdout
    assert "Message:  epguard: unusable because X" in described


def test_a_deployment_gets_a_running_pod_from_the_controllers_and_the_scheduler(
    cluster: ControlPlane,
) -> None:
    labels = {"app": "web"}
    apply(
        cluster,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "terminationGracePeriodSeconds": 1,
                        "containers": [
                            {
                                "name": "httpd",
                                **BUSYBOX,
                                "command": [
                                    "sh",
                                    "-c",
                                    "mkdir -p /www && echo hello-from-pod "
                                    "> /www/index.html && exec httpd -f -p 8080 -h /www",
                                ],
                                "ports": [{"containerPort": 8080}],
                            }
                        ],
                    },
                },
            },
        },
    )
    apply(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )
    r = cluster.kubectl("rollout", "status", "deployment/web", "--timeout=90s")
    assert r.returncode == 0, r.stdout + r.stderr
    cluster_ip = get(cluster, "service", "web")["spec"]["clusterIP"]

    # From the host through kube-proxy's rules to the pod on the bridge network.
    def fetch() -> str:
        # No proxy: the address is the Service's, on this machine.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://{cluster_ip}/", timeout=2) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    assert "hello-from-pod" in wait_for("the Service to answer", fetch, timeout=30)


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service(
    cluster: ControlPlane,
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "api-client", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "nc",
                    **BUSYBOX,
                    "command": [
                        "sh",
                        "-c",
                        "nc -w 3 $KUBERNETES_SERVICE_HOST "
                        "$KUBERNETES_SERVICE_PORT </dev/null && cat "
                        "/var/run/secrets/kubernetes.io/serviceaccount/namespace",
                    ],
                }
            ],
        },
    }
    apply(cluster, pod)
    phase = wait_for(
        "the pod to finish",
        lambda: (
            get(cluster, "pod", "api-client").get("status", {}).get("phase")
            in ("Succeeded", "Failed")
            and get(cluster, "pod", "api-client")["status"]["phase"]
        ),
    )
    # kubectl logs goes through the API server to the kubelet's own port.
    logs = cluster.kubectl("logs", "api-client").stdout
    assert phase == "Succeeded", logs
    # The projected service-account token volume was mounted (kube-controller-manager's
    # token and root-CA publishers ran).
    assert logs.strip() == "default"
