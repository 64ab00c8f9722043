"""No exec or attach into epguard's containers, and no change to their images, through a
real kube-apiserver: the chart's policies (rendered by the real helm, applied with the
real kubectl) refuse ``kubectl exec`` and ``kubectl attach`` into ``epguard-*``
containers, and an UPDATE that changes an ``epguard-*`` container's image, for every
user (cluster admins, and a tenant allowed ``pods/exec`` and ``update`` as the ``edit``
role does) and leave every other container alone. A probe's outcome becomes a verdict for every
tenant; a tenant that could exec into its own pod's running probe could delete a file
of the image in the container (or write its termination message) and so forge a
verdict on any image.

The pods here are never scheduled (no node): the API server answers an exec it admits
with "does not have a host assigned", after admission, so a refusal by the policy and
an admitted request tell themselves apart by their message."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from devcluster import ControlPlane
from tests.chart.chartlib import CHART, NAMESPACE, RELEASE, run_helm
from tests.control_plane import running_control_plane
from tests.e2e.e2e_kube import eventually, output

pytestmark = pytest.mark.e2e

POLICY = "epguard-probe-exec"
PARTS = "epguard-probe-parts"
STATUS = "epguard-probe-status"
NODE_NAME = "gpu-1"
DIGEST = "docker.io/lmsysorg/sglang@sha256:" + "a" * 64
TENANT = "team-a"
TENANT_USER = "alice"
ADMITTED = "does not have a host assigned"


def _pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": TENANT},
        "spec": {
            "initContainers": [
                {"name": "epguard-copy-probe", "image": "registry.example/epguard:1"},
                {"name": "epguard-probe", "image": "registry.example/sglang:1"},
            ],
            "containers": [{"name": "worker", "image": "registry.example/sglang:1"}],
        },
    }


@pytest.fixture(scope="module")
def cp() -> Iterator[ControlPlane]:
    with running_control_plane() as cp:
        cp.kubectl("create", "namespace", TENANT, check=True)
        # What the default edit role grants for this (the bare control plane has no
        # controller-manager to aggregate it).
        cp.kubectl("create", "role", "exec", "--verb=get,create,update,patch", "-n", TENANT,
                   "--resource=pods,pods/exec,pods/attach", check=True)  # fmt: skip
        cp.kubectl("create", "rolebinding", "alice-exec", "--role=exec",
                   f"--user={TENANT_USER}", "-n", TENANT, check=True)  # fmt: skip
        # A namespace owner's role that grants pods/status (not the built-in edit or admin),
        # and what a kubelet may write (the bare control plane runs no node authorizer).
        cp.kubectl("create", "role", "status", "--verb=get,patch,update", "-n", TENANT,
                   "--resource=pods/status", check=True)  # fmt: skip
        for who in (TENANT_USER, f"system:node:{NODE_NAME}", "system:node:gpu-2"):
            cp.kubectl("create", "rolebinding", f"status-{who.replace(':', '-')}",
                       "--role=status", f"--user={who}", "-n", TENANT, check=True)  # fmt: skip
        rendered = run_helm(
            "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
            "--set", "injection.image=registry.example/epguard:1",
            "--show-only", "templates/probe-exec-policy.yaml",
            "--show-only", "templates/probe-parts-policy.yaml",
        ).stdout  # fmt: skip
        r = cp.kubectl("apply", "-f", "-", input=rendered)
        assert r.returncode == 0, output(r)
        r = cp.kubectl("create", "-f", "-", input=json.dumps(_pod("w")))
        assert r.returncode == 0, output(r)
        eventually(lambda: POLICY in output(_exec(cp, "epguard-probe")), within=30,
                   what=f"the {POLICY} policy to be in force")  # fmt: skip
        eventually(lambda: PARTS in output(_set_image(cp, "epguard-probe", "x/y:1", dry=True)),
                   within=30, what=f"the {PARTS} policy to be in force")  # fmt: skip
        yield cp


def _exec(cp: ControlPlane, container: str, *as_user: str) -> subprocess.CompletedProcess[str]:
    return cp.kubectl(*as_user, "exec", "-n", TENANT, "w", "-c", container, "--", "true")


@pytest.mark.parametrize("container", ["epguard-probe", "epguard-copy-probe"])
@pytest.mark.parametrize("who", ["cluster-admin", "a tenant who may exec"])
def test_exec_into_an_epguard_container_is_refused_for_everyone(
    cp: ControlPlane, container: str, who: str
) -> None:
    as_user = () if who == "cluster-admin" else (f"--as={TENANT_USER}",)
    r = _exec(cp, container, *as_user)
    assert r.returncode != 0
    said = output(r)
    assert POLICY in said and f"epguard refuses exec into container {container}" in said, said
    assert f"of pod {TENANT}/w" in said and ADMITTED not in said


def test_attach_to_the_probe_is_refused(cp: ControlPlane) -> None:
    r = cp.kubectl("attach", "-n", TENANT, "w", "-c", "epguard-probe", f"--as={TENANT_USER}")
    assert r.returncode != 0
    assert "epguard refuses attach into container epguard-probe" in output(r), output(r)


def test_exec_into_the_worker_and_without_a_container_passes_the_policy(cp: ControlPlane) -> None:
    for args in (("-c", "worker"), ()):
        r = cp.kubectl(f"--as={TENANT_USER}", "exec", "-n", TENANT, "w", *args, "--", "true")
        assert r.returncode != 0  # no node: the API server cannot run it
        assert POLICY not in output(r) and ADMITTED in output(r), output(r)


def _set_image(
    cp: ControlPlane, container: str, image: str, *as_user: str, pod: str = "w", dry: bool = False
) -> subprocess.CompletedProcess[str]:
    return cp.kubectl(*as_user, "set", "image", "-n", TENANT, f"pod/{pod}",
                      f"{container}={image}", *(["--dry-run=server"] if dry else []))  # fmt: skip


@pytest.mark.parametrize("container", ["epguard-probe", "epguard-copy-probe"])
@pytest.mark.parametrize("who", ["cluster-admin", "a tenant who may update pods"])
def test_changing_an_epguard_containers_image_is_refused_for_everyone(
    cp: ControlPlane, container: str, who: str
) -> None:
    """The swap a webhook outage would have let through: the probe's image pointed at one
    that prints a verdict, then put back (the signature verifies again)."""
    as_user = () if who == "cluster-admin" else (f"--as={TENANT_USER}",)
    r = _set_image(cp, container, "registry.example/tenant/fake-probe:1", *as_user)
    assert r.returncode != 0
    said = output(r)
    assert PARTS in said, said
    assert f"epguard refuses a change to the image of container {container}" in said, said
    got = cp.kubectl("get", "pod", "-n", TENANT, "w", "-o", "json", check=True).stdout
    images = {c["name"]: c["image"] for c in json.loads(got)["spec"]["initContainers"]}
    assert images[container] != "registry.example/tenant/fake-probe:1"


def test_the_workers_image_and_pods_without_epguard_containers_pass_the_policy(
    cp: ControlPlane,
) -> None:
    r = _set_image(cp, "worker", "registry.example/sglang:2", f"--as={TENANT_USER}", dry=True)
    assert r.returncode == 0, output(r)
    plain = _pod("plain")
    plain["spec"]["initContainers"] = [{"name": "setup", "image": "registry.example/setup:1"}]
    r = cp.kubectl("create", "-f", "-", input=json.dumps(plain))
    assert r.returncode == 0, output(r)
    r = _set_image(cp, "setup", "registry.example/setup:2", f"--as={TENANT_USER}", pod="plain")
    assert r.returncode == 0, output(r)
    r = cp.kubectl(f"--as={TENANT_USER}", "label", "-n", TENANT, "pod/w", "team=a")
    assert r.returncode == 0, output(r)  # an update that leaves epguard's images as they are


@pytest.mark.parametrize(
    "change", [["epguard.io/probed-"], ["epguard.io/probed=no", "--overwrite"]]
)
def test_the_probed_label_of_a_pod_with_epguard_containers_cannot_change(
    cp: ControlPlane, change: list[str]
) -> None:
    """Found by a review helper on 3c638ec: with the webhook down (this control plane
    runs none), a tenant removed the label, which takes the pod out of the controller's
    watch and drops kopf's memory of it, then put it back: every run it still showed was
    new again, and a verdict past its last 20 runs renewed. Other labels stay free."""
    labelled = _pod("labelled")
    labelled["metadata"]["labels"] = {"epguard.io/probed": "true"}
    r = cp.kubectl("create", "-f", "-", input=json.dumps(labelled))
    assert r.returncode == 0, output(r)
    r = cp.kubectl(f"--as={TENANT_USER}", "label", "-n", TENANT, "pod", "labelled", *change)
    assert r.returncode != 0
    said = output(r)
    assert PARTS in said and "epguard refuses a change to the label epguard.io/probed" in said
    r = cp.kubectl(f"--as={TENANT_USER}", "label", "-n", TENANT, "pod", "labelled", "team=a")
    assert r.returncode == 0, output(r)
    cp.kubectl("delete", "pod", "-n", TENANT, "labelled", "--wait=false", check=True)


def _on_node(name: str) -> dict[str, Any]:
    pod = _pod(name)
    pod["spec"]["nodeName"] = NODE_NAME  # no such node: the pod is never started
    return pod


def _patch_status(
    cp: ControlPlane, pod: str, status: dict[str, Any], user: str
) -> subprocess.CompletedProcess[str]:
    return cp.kubectl(f"--as={user}", "patch", "pod", pod, "-n", TENANT, "--subresource=status",
                      "--type=merge", "-p", json.dumps({"status": status}))  # fmt: skip


def _probe_status(code: int, image_id: str) -> dict[str, Any]:
    return {"initContainerStatuses": [
        {"name": "epguard-copy-probe", "image": "registry.example/epguard:1", "imageID": "",
         "ready": False, "restartCount": 0, "state": {"terminated": {"exitCode": 0}}},
        {"name": "epguard-probe", "image": "registry.example/sglang:1", "imageID": image_id,
         "ready": False, "restartCount": 0,
         "state": {"terminated": {"exitCode": code, "message": "epguard: unusable in this image"}}},
    ]}  # fmt: skip


def test_only_the_pods_node_may_say_how_its_epguard_containers_ran(cp: ControlPlane) -> None:
    """Found by a review helper: the controller learns a verdict for every namespace from
    a signed pod's epguard-probe status (its exit, message and imageID), which anyone
    granted pods/status could write: a popular image's digest refused everywhere."""
    r = cp.kubectl("create", "-f", "-", input=json.dumps(_on_node("reported")))
    assert r.returncode == 0, output(r)
    try:
        forged = _probe_status(1, DIGEST)
        eventually(lambda: STATUS in output(_patch_status(cp, "reported", forged, TENANT_USER)),
                   within=30, what=f"the {STATUS} policy to be in force")  # fmt: skip
        r = _patch_status(cp, "reported", forged, TENANT_USER)
        assert r.returncode != 0
        said = output(r)
        assert f"of pod {TENANT}/reported by {TENANT_USER}" in said, said
        assert "only the node the pod runs on reports how they ran" in said, said
        # Another node is no better; the pod's own node writes it.
        r = _patch_status(cp, "reported", forged, "system:node:gpu-2")
        assert r.returncode != 0 and STATUS in output(r), output(r)
        r = _patch_status(cp, "reported", forged, f"system:node:{NODE_NAME}")
        assert r.returncode == 0, output(r)
        got = json.loads(cp.kubectl("get", "pod", "reported", "-n", TENANT, "-o", "json",
                                    check=True).stdout)  # fmt: skip
        assert got["status"]["initContainerStatuses"][1]["imageID"] == DIGEST
        # Nor may the tenant change or take away what the node said.
        r = _patch_status(cp, "reported", _probe_status(0, DIGEST), TENANT_USER)
        assert r.returncode != 0 and STATUS in output(r), output(r)
        # The rest of the status is the tenant's as before (a readiness gate's condition).
        cond = {"conditions": [{"type": "example.com/ready", "status": "True"}]}
        r = _patch_status(cp, "reported", cond, TENANT_USER)
        assert r.returncode == 0, output(r)
    finally:
        cp.kubectl("delete", "pod", "-n", TENANT, "reported", "--wait=false")


def test_the_probed_label_cannot_change_through_pods_status(cp: ControlPlane) -> None:
    """pods/status keeps labels writable: the route around the epguard-probe-parts label
    rule on pods (review helper)."""
    labelled = _pod("status-labelled")
    labelled["metadata"]["labels"] = {"epguard.io/probed": "true"}
    r = cp.kubectl("create", "-f", "-", input=json.dumps(labelled))
    assert r.returncode == 0, output(r)
    try:
        remove = '[{"op":"remove","path":"/metadata/labels/epguard.io~1probed"}]'
        r = cp.kubectl(f"--as={TENANT_USER}", "patch", "pod", "status-labelled", "-n", TENANT,
                       "--subresource=status", "--type=json", "-p", remove)  # fmt: skip
        assert r.returncode != 0
        said = output(r)
        assert PARTS in said and "epguard refuses a change to the label epguard.io/probed" in said
    finally:
        cp.kubectl("delete", "pod", "-n", TENANT, "status-labelled", "--wait=false")
