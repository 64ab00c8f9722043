"""The one-node cluster of the node e2e tests: ``make up`` (devcluster.stack), with
epguard installed by helm as the chart's pods, shared by the session's node modules."""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from devcluster import ControlPlane
from devcluster.images import BAD_WORKER, BUSYBOX_IMAGE
from devcluster.node import Node, host_snapshot
from devcluster.stack import Stack
from tests.e2e.e2e_kube import WORKER_ARGS, WORKER_COMMAND, eventually

REPO_ROOT = Path(__file__).resolve().parents[2]


def devcluster_cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m devcluster --run-dir RUN_DIR ARGS`` (``make up`` / ``down`` / ``status``)."""
    return subprocess.run(
        [sys.executable, "-m", "devcluster", "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=900,
    )


class SharedCluster:
    """The cluster that the node modules leaving it as they found it share: started on
    first use by ``make up`` itself (``python -m devcluster up``: detached, epguard
    installed by helm as the chart's pods), stopped by ``make down`` at the session's end
    or before a module starts a node of its own (the machine has one: its ports, its
    containerd, its registry). A start is ~30 s of the node phase on two cores, so the
    test of ``up`` and ``down`` (tests/devcluster/test_up_down.py) checks this start and
    this stop rather than making its own: ``up`` and ``before`` (the host snapshot taken
    just before it) are kept for it, and ``stop`` returns what ``down`` said."""

    def __init__(self, run_dir: Callable[[], Path]) -> None:
        self._new_run_dir = run_dir
        self._cluster: ControlPlane | None = None
        self._namespaces: set[str] = set()
        self.run_dir: Path | None = None
        self.up: subprocess.CompletedProcess[str] | None = None
        self.before: dict[str, Any] | None = None

    def cluster(self) -> ControlPlane:
        if self._cluster is None:
            run_dir = self._new_run_dir()
            self.before = host_snapshot()
            # Recorded before `up` runs, so that an `up` killed midway (a test timeout, a
            # Ctrl-C) is still stopped; and a normal interpreter exit that skipped the
            # session's finalizers still runs `down` (the processes are detached: they
            # outlive this one).
            self.run_dir = run_dir
            atexit.register(self.stop)
            self.up = devcluster_cli(run_dir, "up")
            stack = Stack.load(run_dir)
            if self.up.returncode != 0 or stack is None or stack.control_plane is None:
                down = self.stop()
                raise RuntimeError(
                    f"make up failed ({self.up.returncode}):\n{self.up.stdout[-4000:]}\n"
                    f"{self.up.stderr[-4000:]}\nmake down: {down and down.stderr[-2000:]}"
                )
            self._cluster = stack.control_plane
            self._namespaces = set(_namespaces(self._cluster))
        return self._cluster

    def tidy(self) -> None:
        """After a module: every namespace it made deleted (its pods hold the node's fake
        GPUs and run probes) and every ImageVerdict it learned forgotten."""
        if self._cluster is None:
            return
        made = sorted(set(_namespaces(self._cluster)) - self._namespaces)
        if made:
            self._cluster.kubectl(
                "delete",
                "namespace",
                *made,
                "--ignore-not-found",
                "--wait=true",
                "--timeout=180s",
                check=True,
            )
        self._cluster.kubectl("delete", "imageverdicts", "--all", check=True)

    def stop(self) -> subprocess.CompletedProcess[str] | None:
        """``make down``, if this started a cluster that is not stopped yet."""
        run_dir, self.run_dir, self._cluster = self.run_dir, None, None
        atexit.unregister(self.stop)
        return devcluster_cli(run_dir, "down") if run_dir is not None else None


def _namespaces(cluster: ControlPlane) -> list[str]:
    r = cluster.kubectl("get", "namespaces", "-o", "name", check=True)
    return [line.removeprefix("namespace/") for line in r.stdout.split()]


def node_of(cluster: ControlPlane) -> Node:
    """The node of a cluster that ``make up`` started (start_cluster puts its work
    directory beside the control plane's): its registry, its containerd."""
    return Node(cluster, cluster.workdir.parent / "node")


PROBE = "epguard-probe"
# The injected probe imports torch from a 5 GB layer on two shared cores.
PROBE_TIMEOUT = 300.0


def worker_spec(models: Path, image: str = BAD_WORKER.ref) -> dict[str, Any]:
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
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", "echo downloading > /models/started"],
                "volumeMounts": [{"name": "models", "mountPath": "/models"}],
            }
        ],
        "containers": [
            {
                "name": "worker",
                "image": image,
                # The injected probe pulls as the worker does, and only a pull that
                # resolved the tag teaches a verdict under it (outcome.verdict_image);
                # the registry holds the tag, so this asks it for the manifest only.
                "imagePullPolicy": "Always",
                "command": list(WORKER_COMMAND),
                "args": list(WORKER_ARGS),
                "resources": {"limits": {"nvidia.com/gpu": 8}},
                "volumeMounts": [{"name": "models", "mountPath": "/models"}],
            }
        ],
    }


def worker_pod(
    name: str, namespace: str, models: Path, image: str = BAD_WORKER.ref
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": worker_spec(models, image),
    }


def workload(kind: str, name: str, namespace: str, models: Path) -> dict[str, Any]:
    labels = {"app": name}
    template = {"metadata": {"labels": labels}, "spec": worker_spec(models)}
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


def probe_status(cp: ControlPlane, namespace: str, selector: list[str]) -> dict[str, Any] | None:
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


def wait_probe(cp: ControlPlane, namespace: str, selector: list[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def done() -> bool:
        result = probe_status(cp, namespace, selector)
        if result:
            found.update(result)
        return bool(result)

    eventually(done, within=PROBE_TIMEOUT, what="the kubelet to record the probe's end", every=0.5)
    return found


@contextmanager
def opted_in_namespace(cluster: ControlPlane, preflight: str = "off") -> Iterator[str]:
    """A fresh namespace opted in to probe injection, seen by the webhook, and no
    ImageVerdict left from an earlier test (each test learns its own). Its pods are
    deleted after the test, which frees the node's (fake) GPUs for the next one, and then
    the namespace.

    ``preflight`` is the namespace's epguard.io/preflight label: "off" by default, since
    most tests here are about the probe the kubelet runs in the pod;
    test_preflight_on_node.py passes "gate" (the chart's default)."""
    cluster.kubectl("delete", "imageverdicts", "--all", check=True)
    name = f"ml-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name, check=True)
    labels = ("epguard.io/inject=enabled", f"epguard.io/preflight={preflight}")
    cluster.kubectl("label", "namespace", name, *labels, check=True)
    probe = worker_pod("dry-run", name, Path("/nonexistent"))
    seen = PROBE if preflight == "off" else '"epguard.io/preflight"'

    def injected_and_admitted() -> bool:
        r = cluster.kubectl(
            "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(probe)
        )
        return r.returncode == 0 and PROBE in r.stdout and seen in r.stdout

    eventually(injected_and_admitted, within=60, what="the webhook to inject and admit")
    yield name
    # Its pods first, waited for: gone, they free the node's (fake) GPUs for the next test
    # (2-3 s). The namespace itself is not waited for (its finalization took ~10 s of
    # every test's teardown); SharedCluster.tidy waits for it at the module's end.
    cluster.kubectl("delete", "pods", "--all", "-n", name, "--wait=true", "--timeout=120s",
                    timeout=180)  # fmt: skip
    cluster.kubectl("delete", "namespace", name, "--wait=false")


def fresh_namespace(cluster: ControlPlane, name: str) -> str:
    """Create namespace ``name`` and wait for its default ServiceAccount (pods need it)."""
    cluster.kubectl("create", "namespace", name, check=True)
    eventually(
        lambda: cluster.kubectl("get", "sa", "default", "-n", name).returncode == 0,
        what=f"the default ServiceAccount of {name}",
    )
    return name
