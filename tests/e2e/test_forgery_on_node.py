"""A tenant attacks the learned verdicts, on the real node with the chart's pods.

The tenant is a user (``tenant-a``, by impersonation) who may only create, read, patch
and delete pods in its own namespaces. The victim image is the complete env-only worker
(a good image on a GPU node). Each attack is the one that once worked (issue 12):

* a pod that brings its own ``epguard-copy-probe`` and ``epguard-probe`` printing an
  Unusable verdict, labelled ``epguard.io/probed=true``: refused at admission;
* the same pod without ``--elastic-ep-backend`` (it once skipped the chart's
  matchConditions): refused at admission too, since it carries epguard's label; and
  where it gets past admission all the same (a namespace the admin excluded, here; or
  the webhook down under ``failurePolicy: Ignore``) it runs, the kubelet writes its
  forged message into the status, and the controller learns nothing from it (no
  ImageVerdict; a Warning Event says why);
* a forged Usable for a digest with an Unusable verdict: the verdict stays as it was;
* a genuinely injected pod whose probe image the tenant patches afterwards: refused.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster import ControlPlane
from devcluster.images import BAD_WORKER, ENV_ONLY_WORKER, EPGUARD_IMAGE
from epguard.probe.message import SCOPE, UNUSABLE, USABLE
from tests.e2e.e2e_kube import apply, as_yaml, eventually, wait_event
from tests.e2e.node_e2e import SharedCluster, fresh_namespace, wait_probe, worker_pod

pytestmark = [pytest.mark.e2e, pytest.mark.node]

TENANT = "tenant-a"
VICTIM = ENV_ONLY_WORKER.ref


@pytest.fixture(scope="module")
def cluster(shared_node: SharedCluster) -> Iterator[ControlPlane]:
    yield shared_node.cluster()
    shared_node.tidy()


def tenant_namespace(cp: ControlPlane, inject: bool = False) -> str:
    name = fresh_namespace(cp, f"tenant-{uuid.uuid4().hex[:6]}")
    if inject:
        cp.kubectl("label", "namespace", name, "epguard.io/inject=enabled", check=True)
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "pods", "namespace": name},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["pods"],
                "verbs": ["create", "get", "list", "watch", "patch", "delete"],
            }
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "pods", "namespace": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods"},
        "subjects": [{"kind": "User", "name": TENANT, "apiGroup": "rbac.authorization.k8s.io"}],
    }
    r = apply(cp, role, binding)
    assert r.returncode == 0, r.stderr
    return name


def as_tenant(cp: ControlPlane, *args: str, input: str | None = None) -> Any:
    return cp.kubectl(f"--as={TENANT}", *args, input=input)


def forged_pod(
    name: str, namespace: str, message: str, code: int, mention_flag: bool
) -> dict[str, Any]:
    """The forgery: the real epguard image copying nothing, and a "probe" in the victim's
    image that prints ``message`` as the probe's termination message."""
    worker_args = ["python3", "-m", "sglang.launch_server", "--model-path", "/m"]
    if mention_flag:
        worker_args += ["--elastic-ep-backend", "mooncake"]
    script = (
        "import sys; open('/dev/termination-log', 'w').write(sys.argv[1]); "
        f"raise SystemExit({code})"
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"epguard.io/probed": "true"}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "initContainers": [
                {
                    "name": "epguard-copy-probe",
                    "image": EPGUARD_IMAGE,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python3", "-c", "pass"],
                },
                {
                    "name": "epguard-probe",
                    "image": VICTIM,
                    "imagePullPolicy": "IfNotPresent",
                    # The probe call's shape: "…/probe -- WORKER_ARGV".
                    "command": ["python3", "-c", script, message, "/epguard/probe", "--"],
                    "args": worker_args,
                },
            ],
            "containers": [
                {
                    "name": "worker",
                    "image": VICTIM,
                    "imagePullPolicy": "IfNotPresent",
                    "command": worker_args,
                }
            ],
        },
    }


UNUSABLE_MESSAGE = (
    f"{UNUSABLE}mooncake.pg cannot load: no pg_2_13_0 extension for torch 2.13.0\n"
    f"{SCOPE}image (forged)\nversions: torch=2.13.0 sglang=0.5.20\nfix: none"
)
USABLE_MESSAGE = f"{USABLE}mooncake.pg loads\nversions: torch=2.13.0 sglang=0.5.20"


def verdicts(cp: ControlPlane) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(
        cp.kubectl("get", "imageverdicts", "-o", "json", check=True).stdout
    )["items"]
    return items


def run_forgery(cp: ControlPlane, message: str, code: int) -> tuple[str, dict[str, Any]]:
    """Create the forged pod where no webhook looks at it; wait for the kubelet to record
    its end and for the controller to say it learned nothing. (namespace, probe status)"""
    ns = tenant_namespace(cp)
    name = f"forged-{uuid.uuid4().hex[:4]}"
    forged = as_yaml(forged_pod(name, ns, message, code, False))
    # Without the flag it is still sent to the webhook (epguard's label), and refused.
    r = as_tenant(cp, "create", "-f", "-", input=forged)
    assert r.returncode != 0 and "carry no epguard.io/probe-signature" in r.stderr, r.stderr
    # Past admission all the same: the admin excludes the namespace from epguard's webhooks.
    cp.kubectl("label", "namespace", ns, "epguard.io/ignore=true", check=True)
    r = as_tenant(cp, "create", "-f", "-", input=forged)
    assert r.returncode == 0, r.stderr
    found = wait_probe(cp, ns, [f"--field-selector=metadata.name={name}"])
    assert found["terminated"]["exitCode"] == code
    assert found["terminated"]["message"] == message  # the kubelet wrote the forgery
    events = wait_event(cp, ns, name, "EpguardProbeNotTrusted")
    assert "carry no epguard.io/probe-signature" in events[0]["message"]
    return ns, found


def test_a_pod_bringing_its_own_probe_is_refused_at_admission(cluster: ControlPlane) -> None:
    ns = tenant_namespace(cluster)
    pod = as_yaml(forged_pod("forged", ns, UNUSABLE_MESSAGE, 1, mention_flag=True))
    result: dict[str, Any] = {}

    def refused() -> bool:  # the webhook refuses once it holds the controller's key
        r = as_tenant(cluster, "create", "-f", "-", input=pod)
        result["r"] = r
        if r.returncode == 0:
            as_tenant(cluster, "delete", "pod", "forged", "-n", ns, "--wait=false")
        return r.returncode != 0

    eventually(refused, within=60, what="the webhook to refuse a forged probe")
    err = result["r"].stderr
    assert "epguard refuses pod" in err and "carry no epguard.io/probe-signature" in err
    assert "epguard-*" in err


def test_a_forged_unusable_that_ran_unseen_by_the_webhook_teaches_nothing(
    cluster: ControlPlane,
) -> None:
    _, found = run_forgery(cluster, UNUSABLE_MESSAGE, 1)
    digest = found["status"]["imageID"].rsplit("@", 1)[-1]
    assert digest.startswith("sha256:")
    assert [v for v in verdicts(cluster) if v["spec"].get("digest") == digest] == []
    # And the victim's pods are still admitted.
    victim_ns = fresh_namespace(cluster, f"victim-{uuid.uuid4().hex[:6]}")
    victim = worker_pod("victim", victim_ns, Path("/nonexistent"), VICTIM)
    r = apply(cluster, victim, dry_run=True)
    assert r.returncode == 0, r.stderr


def test_a_forged_usable_never_clears_an_unusable_verdict(cluster: ControlPlane) -> None:
    # The digest the victim image runs as (from a first forgery, which teaches nothing).
    _, found = run_forgery(cluster, UNUSABLE_MESSAGE, 1)
    digest = found["status"]["imageID"].rsplit("@", 1)[-1]
    name = digest.replace(":", "-")
    verdict = {
        "apiVersion": "epguard.io/v1alpha1",
        "kind": "ImageVerdict",
        "metadata": {"name": name},
        "spec": {
            "image": VICTIM,
            "digest": digest,
            "verdict": "Unusable",
            "reason": "recorded by the admin for this test",
            "count": 1,
        },
    }
    assert apply(cluster, verdict).returncode == 0
    try:
        before = json.loads(cluster.kubectl("get", "imageverdict", name, "-o", "json").stdout)
        run_forgery(cluster, USABLE_MESSAGE, 0)
        after = json.loads(cluster.kubectl("get", "imageverdict", name, "-o", "json").stdout)
        assert after["spec"]["verdict"] == "Unusable"
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    finally:
        cluster.kubectl("delete", "imageverdict", name, "--ignore-not-found")


def test_patching_the_injected_probes_image_is_refused(cluster: ControlPlane) -> None:
    ns = tenant_namespace(cluster, inject=True)
    pod = worker_pod("injected", ns, Path("/nonexistent"), VICTIM)
    pod["spec"].pop("volumes")
    pod["spec"].pop("initContainers")
    pod["spec"]["containers"][0].pop("volumeMounts")
    created: dict[str, Any] = {}

    def signed() -> bool:
        r = as_tenant(cluster, "create", "-o", "json", "-f", "-", input=as_yaml(pod))
        if r.returncode != 0:
            return False
        obj = json.loads(r.stdout)
        if "epguard.io/probe-signature" in obj["metadata"].get("annotations", {}):
            created.update(obj)
            return True
        as_tenant(cluster, "delete", "pod", "injected", "-n", ns, "--wait=true")
        return False

    eventually(signed, within=60, what="the webhook to inject a signed probe")
    names = [c["name"] for c in created["spec"]["initContainers"]]
    index = names.index("epguard-probe")
    patch = [
        {"op": "replace", "path": f"/spec/initContainers/{index}/image", "value": BAD_WORKER.ref}
    ]
    r = as_tenant(
        cluster, "patch", "pod", "injected", "-n", ns, "--type=json", "-p", json.dumps(patch)
    )
    assert r.returncode != 0
    # The chart's policy epguard-probe-parts refuses it in the API server, before the
    # webhook is asked (its own refusal, "… differ from what epguard signed", is tested
    # in tests/admission, and holds where the policy is not installed).
    assert "epguard refuses a change to the image of container epguard-probe" in r.stderr, (
        r.stderr
    )
    now = json.loads(cluster.kubectl("get", "pod", "injected", "-n", ns, "-o", "json").stdout)
    assert now["spec"]["initContainers"][index]["image"] == VICTIM


def test_signed_parts_replayed_around_a_neighbour_teach_nothing(cluster: ControlPlane) -> None:
    """Issue 21.1 on the node: the tenant copies the signed parts of a genuinely injected
    pod into a hand-made one (no injection annotation, so /mutate never sees it) and puts
    its own init container between epguard-copy-probe and epguard-probe, rewriting the
    probe on the probe's volume. The pod is admitted with a warning, the rewritten probe
    prints its forged Unusable, and the controller learns nothing from it."""
    ns = tenant_namespace(cluster)
    genuine = worker_pod("genuine", ns, Path("/nonexistent"), VICTIM)
    genuine["metadata"]["annotations"] = {"epguard.io/inject": "enabled"}
    genuine["spec"].pop("volumes")
    genuine["spec"].pop("initContainers")
    genuine["spec"]["containers"][0].pop("volumeMounts")
    genuine["spec"]["containers"][0].pop("resources")  # this node has no GPU to schedule on
    created: dict[str, Any] = {}

    def signed() -> bool:
        r = as_tenant(cluster, "create", "--dry-run=server", "-o", "json", "-f", "-",
                      input=as_yaml(genuine))  # fmt: skip
        if r.returncode != 0:
            return False
        obj = json.loads(r.stdout)
        created.update(obj)
        return "epguard.io/probe-signature" in obj["metadata"].get("annotations", {})

    eventually(signed, within=60, what="the webhook to inject a signed probe")
    meta = created["metadata"]
    hand = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "replayed",
            "namespace": ns,
            "labels": meta["labels"],
            "annotations": {"epguard.io/probe-signature": meta["annotations"][
                "epguard.io/probe-signature"]},
        },
        # What the tenant copies: the signed parts and its worker (without the service
        # account token mount the API server added to the dry run).
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            # Else the API server mounts the token into epguard's containers too.
            "automountServiceAccountToken": False,
            "initContainers": created["spec"]["initContainers"],
            "containers": [
                {k: v for k, v in c.items() if k != "volumeMounts"}
                for c in created["spec"]["containers"]
            ],
            "volumes": [v for v in created["spec"]["volumes"] if v["name"] == "epguard-probe"],
        },
    }  # fmt: skip
    forged = f"open('/dev/termination-log', 'w').write({UNUSABLE_MESSAGE!r}); raise SystemExit(1)"
    rewrite = f"open('/epguard/probe/__main__.py', 'w').write({forged!r})"
    hand["spec"]["initContainers"].insert(
        1,
        {
            "name": "rewrite",
            "image": EPGUARD_IMAGE,
            "imagePullPolicy": "IfNotPresent",
            "command": ["python3", "-c", rewrite],
            "volumeMounts": [{"name": "epguard-probe", "mountPath": "/epguard"}],
        },
    )
    r = as_tenant(cluster, "create", "-f", "-", input=as_yaml(hand))
    assert r.returncode == 0, r.stderr
    assert "will not be learned" in r.stderr  # kubectl prints the webhook's warning
    found = wait_probe(cluster, ns, ["--field-selector=metadata.name=replayed"])
    assert found["terminated"]["exitCode"] == 1
    assert found["terminated"]["message"] == UNUSABLE_MESSAGE  # the rewritten probe ran
    events = wait_event(cluster, ns, "replayed", "EpguardProbeNotTrusted")
    assert "mounts the epguard-probe volume" in events[0]["message"]
    digest = found["status"]["imageID"].rsplit("@", 1)[-1]
    assert [v for v in verdicts(cluster) if v["spec"].get("digest") == digest] == []


def test_swapping_a_probed_workers_image_in_place_is_refused(cluster: ControlPlane) -> None:
    """Issue 21.3 on the node: the probe checked the image the pod was created with; an
    UPDATE that changes the worker's image under it is refused (enforce mode), naming the
    fix, and the pod keeps its image."""
    ns = tenant_namespace(cluster, inject=True)
    pod = worker_pod("swapped", ns, Path("/nonexistent"), VICTIM)
    pod["spec"].pop("volumes")
    pod["spec"].pop("initContainers")
    pod["spec"]["containers"][0].pop("volumeMounts")

    def created() -> bool:
        r = as_tenant(cluster, "create", "-o", "json", "-f", "-", input=as_yaml(pod))
        if r.returncode != 0:
            return False
        if "epguard.io/probe-signature" in json.loads(r.stdout)["metadata"].get("annotations", {}):
            return True
        as_tenant(cluster, "delete", "pod", "swapped", "-n", ns, "--wait=true")
        return False

    eventually(created, within=60, what="the webhook to inject a signed probe")
    patch = [{"op": "replace", "path": "/spec/containers/0/image", "value": BAD_WORKER.ref}]
    r = as_tenant(
        cluster, "patch", "pod", "swapped", "-n", ns, "--type=json", "-p", json.dumps(patch)
    )
    assert r.returncode != 0
    assert "probe checked another image" in r.stderr and "stale-probe" in r.stderr
    now = json.loads(cluster.kubectl("get", "pod", "swapped", "-n", ns, "-o", "json").stdout)
    assert now["spec"]["containers"][0]["image"] == VICTIM
