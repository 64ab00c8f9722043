"""The preflight gate on the real node, with the chart as pods (its default
``preflight.mode: gate``): workers whose model arrives as an image volume (pulled from
the node's registry), a PersistentVolumeClaim and a hostPath -- each pulled or mounted by
the kubelet before any init container runs -- on an image nobody has judged.

* On the image that cannot work, 4 replicas start one preflight; its probe proves the
  cause from the image's files; every replica stays unscheduled (SchedulingGated, its
  ``epguard.io/Preflight`` condition and an Event saying why), the Deployment gets the
  Event too, the registry serves not one byte of the model, nothing of the other model
  volumes is mounted or touched, the ImageVerdict is recorded from the signed preflight,
  and the next pod on the image is refused at admission.
* On the image whose only fault here is the missing GPU, the preflight proves nothing,
  the gate comes off, the pod is scheduled, the kubelet pulls the whole model from the
  registry, and the injected probe runs on the node, where it finds the environment
  cause; nothing is learned about the image.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster import ControlPlane
from devcluster.images import BAD_WORKER, BUSYBOX_IMAGE, ENV_ONLY_WORKER, EPGUARD_IMAGE
from epguard.webhook.engine.injection import InjectionSettings
from epguard.webhook.engine.outcome import PROBE_CONTAINER
from epguard.webhook.engine.preflight import (
    CONDITION,
    GATE,
    PREFLIGHT_LABEL,
    PreflightSettings,
    key_of,
    preflight_pod,
)
from epguard.webhook.engine.verdicts import verdict_name as name_of_verdict
from tests.e2e.e2e_kube import apply, denied_by_epguard, eventually, output
from tests.e2e.node_e2e import (
    SharedCluster,
    fresh_namespace,
    node_of,
    opted_in_namespace,
    wait_probe,
    worker_pod,
    worker_spec,
)

pytestmark = [pytest.mark.e2e, pytest.mark.node]

# The preflight reads a 5.7 GB image's files on two shared cores.
PREFLIGHT_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def cluster(shared_node: SharedCluster) -> Iterator[ControlPlane]:
    yield shared_node.cluster()
    shared_node.tidy()


@pytest.fixture
def gated_namespace(cluster: ControlPlane) -> Iterator[str]:
    with opted_in_namespace(cluster, preflight="gate") as name:
        yield name


def deployment(
    name: str,
    namespace: str,
    image: str,
    models: Path,
    replicas: int,
    claim: bool = True,
    model_image: str | None = None,
) -> dict[str, Any]:
    labels = {"app": name}
    spec = worker_spec(models, image)
    if model_image is not None:
        # The weights as an OCI image volume: the kubelet pulls it in SyncPod, before
        # it starts any init container.
        spec["volumes"].append(
            {"name": "model", "image": {"reference": model_image, "pullPolicy": "IfNotPresent"}}
        )
        spec["containers"][0]["volumeMounts"].append(
            {"name": "model", "mountPath": "/model", "readOnly": True}
        )
    if claim:
        # The model also through a claim: bound and mounted on the node before any init
        # container, exactly what the init-container probe cannot stop.
        spec["volumes"].append({"name": "weights", "persistentVolumeClaim": {"claimName": name}})
        spec["containers"][0]["volumeMounts"].append({"name": "weights", "mountPath": "/weights"})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": spec},
        },
    }


def claim(cluster: ControlPlane, name: str, namespace: str, path: Path) -> None:
    """A local PersistentVolume on the node (a hostPath directory) and its claim."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "weights.bin").write_bytes(b"\0" * 4096)
    pv = {
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-{name}"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                 "storageClassName": "epguard-e2e", "hostPath": {"path": str(path)},
                 "claimRef": {"namespace": namespace, "name": name}},
    }  # fmt: skip
    pvc = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "epguard-e2e",
                 "resources": {"requests": {"storage": "1Gi"}}},
    }  # fmt: skip
    for obj in (pv, pvc):
        r = apply(cluster, obj)
        assert r.returncode == 0, output(r)


def pods(cluster: ControlPlane, namespace: str, selector: str) -> list[dict[str, Any]]:
    r = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json")
    assert r.returncode == 0, output(r)
    items: list[dict[str, Any]] = json.loads(r.stdout)["items"]
    return items


def condition(pod: dict[str, Any]) -> dict[str, Any] | None:
    for c in pod.get("status", {}).get("conditions", []):
        if c.get("type") == CONDITION:
            return dict(c)
    return None


def events_about(cluster: ControlPlane, namespace: str, kind: str, name: str) -> list[str]:
    r = cluster.kubectl(
        "get", "events", "-n", namespace, "-o", "json",
        f"--field-selector=involvedObject.kind={kind},involvedObject.name={name}",
    )  # fmt: skip
    return [f"{e.get('reason')}: {e.get('message')}" for e in json.loads(r.stdout)["items"]]


def test_a_bad_image_is_never_scheduled_and_its_model_never_mounted(
    cluster: ControlPlane, gated_namespace: str, tmp_path: Path
) -> None:
    ns = gated_namespace
    models, weights = tmp_path / "models", tmp_path / "weights"
    claim(cluster, "sglang", ns, weights)
    node = node_of(cluster)
    model = node.registry.model_ref
    node.forget_image(model)  # so that a pull would show in the registry's log
    since = node.registry.log_offset()
    r = apply(
        cluster, deployment("sglang", ns, BAD_WORKER.ref, models, replicas=4, model_image=model)
    )
    assert r.returncode == 0, output(r)
    eventually(lambda: len(pods(cluster, ns, "app=sglang")) == 4, within=60,
               what="the ReplicaSet to make 4 pods")  # fmt: skip

    def held() -> bool:
        found = pods(cluster, ns, "app=sglang")
        return len(found) == 4 and all(
            (c := condition(p)) is not None and c["reason"] == "ImageUnusable" for p in found
        )

    eventually(held, within=PREFLIGHT_TIMEOUT, what="the preflight to hold every replica",
               every=1.0)  # fmt: skip
    preflights = pods(cluster, ns, f"{PREFLIGHT_LABEL}=true")
    assert len(preflights) == 1, [p["metadata"]["name"] for p in preflights]
    message = condition(pods(cluster, ns, "app=sglang")[0])["message"]  # type: ignore[index]
    assert "unusable in this image" in message
    for p in pods(cluster, ns, "app=sglang"):
        assert GATE in [g["name"] for g in p["spec"].get("schedulingGates", [])]
        assert not p["spec"].get("nodeName"), "a gated pod was scheduled"
        assert not p["status"].get("initContainerStatuses"), "something ran in a gated pod"
    # `kubectl get pod` says why it waits; nothing of the model was touched.
    r = cluster.kubectl("get", "pods", "-n", ns, "-l", "app=sglang", "--no-headers")
    assert r.stdout.count("SchedulingGated") == 4, r.stdout
    assert not (models / "started").exists() and sorted(p.name for p in weights.iterdir()) == [
        "weights.bin"
    ]
    # The registry served nothing of the model: its access log has no GET of its blobs.
    served = node.registry.blob_gets(since)
    assert not set(served) & set(node.registry.model_layers()), served
    # The probe's message where people look: each pod and the Deployment.
    name = pods(cluster, ns, "app=sglang")[0]["metadata"]["name"]
    assert any("unusable in this image" in e for e in events_about(cluster, ns, "Pod", name))
    on_owner = lambda: events_about(cluster, ns, "Deployment", "sglang")  # noqa: E731
    eventually(lambda: any("ImageUnusable" in e for e in on_owner()), within=30,
               what="the Event on the Deployment")  # fmt: skip
    # The verdict, from the signed preflight, keyed by the digest the runtime reported.
    image_id = preflights[0]["status"]["initContainerStatuses"][1]["imageID"]
    digest = image_id.rsplit("@", 1)[-1]
    verdict_name = name_of_verdict(BAD_WORKER.ref, digest)

    def recorded() -> bool:
        r = cluster.kubectl("get", "imageverdict", verdict_name, "-o", "json")
        return r.returncode == 0 and json.loads(r.stdout)["spec"]["verdict"] == "Unusable"

    eventually(recorded, within=60, what=f"ImageVerdict {verdict_name}")

    # And the next pod on the image is refused before anything is gated or scheduled, once
    # the webhook's watch has the verdict (a pod created in between is gated and held at
    # once by the finished preflight's answer).
    def refused() -> bool:
        r = cluster.kubectl("create", "--dry-run=server", "-f", "-",
                            input=json.dumps(worker_pod("next", ns, models)))  # fmt: skip
        return denied_by_epguard(r)

    eventually(refused, within=30, what="the next pod refused at admission", every=0.5)


def test_a_preflight_whose_probe_volume_is_the_epguard_image_proves_the_cause_alone(
    cluster: ControlPlane, tmp_path: Path
) -> None:
    """preflight.probeVolume: image on the real kubelet and containerd 2: the preflight
    the engine builds for the bad worker, with the epguard image mounted read-only as the
    probe's volume, runs its one init container, the probe from the image's own
    directory, which proves the bad worker's cause from its files. The chart installed
    here keeps the default (copy); the pod is created by the admin, without epguard's
    labels, in a namespace epguard ignores (the controller's own creates and the policy
    that holds them to this shape: test_preflight_policy.py)."""
    ns = fresh_namespace(cluster, f"iv-{uuid.uuid4().hex[:6]}")
    cluster.kubectl("label", "namespace", ns, "epguard.io/ignore=true", check=True)
    spec = worker_spec(tmp_path / "models", BAD_WORKER.ref)
    settings = PreflightSettings(InjectionSettings(EPGUARD_IMAGE), probe_volume="image")
    pod = preflight_pod(ns, spec, key_of(ns, spec, BAD_WORKER.ref), settings)
    assert pod is not None
    pod["metadata"]["labels"] = {"test": "probe-volume"}
    r = apply(cluster, pod)
    assert r.returncode == 0, output(r)
    found = wait_probe(cluster, ns, ["-l", "test=probe-volume"])
    term = found["terminated"]
    assert term["exitCode"] == 1, term
    assert term["message"].startswith("epguard: mooncake elastic EP is unusable in this image")
    assert "libcudart.so.12" in term["message"]
    statuses = found["pod"]["status"]["initContainerStatuses"]
    assert [s["name"] for s in statuses] == [PROBE_CONTAINER]
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_an_image_whose_files_prove_nothing_is_ungated_and_probed_on_the_node(
    cluster: ControlPlane, gated_namespace: str, tmp_path: Path
) -> None:
    ns = gated_namespace
    claim(cluster, "envonly", ns, tmp_path / "weights")
    node = node_of(cluster)
    model = node.registry.model_ref
    node.forget_image(model)
    since = node.registry.log_offset()
    workload = deployment("envonly", ns, ENV_ONLY_WORKER.ref, tmp_path / "m", 1, model_image=model)
    r = apply(cluster, workload)
    assert r.returncode == 0, output(r)

    def scheduled() -> bool:
        found = pods(cluster, ns, "app=envonly")
        return len(found) == 1 and bool(found[0]["spec"].get("nodeName"))

    eventually(scheduled, within=PREFLIGHT_TIMEOUT, what="the gate to come off", every=1.0)
    (pod,) = pods(cluster, ns, "app=envonly")
    assert GATE not in [g["name"] for g in pod["spec"].get("schedulingGates", [])]
    cond = condition(pod)
    assert cond is not None and cond["status"] == "True" and cond["reason"] == "PreflightPassed"
    assert "no image cause in this image's files" in cond["message"]
    # The injected probe then runs on the node: the GPU driver is what is missing here.
    found = wait_probe(cluster, ns, ["-l", "app=envonly"])
    assert "unusable in this pod" in found["terminated"]["message"]
    # Only once the gate was off did the kubelet pull the model: every layer, whole.
    served = node.registry.blob_gets(since)
    sizes = node.registry.model_layer_sizes()
    assert all(served[d].bytes >= size for d, size in sizes.items()), (served, sizes)
    r = cluster.kubectl("get", "imageverdicts", "-o", "json")
    assert json.loads(r.stdout)["items"] == [], "a files-only pass or a node's cause was learned"


def test_a_tenant_can_remove_its_own_gate_and_learns_nothing_by_it(
    cluster: ControlPlane, gated_namespace: str, tmp_path: Path
) -> None:
    """A tenant may always remove the gate from its own pod (then the pod runs unjudged,
    with the in-pod probe only); epguard records nothing from that."""
    ns = gated_namespace
    r = apply(cluster, worker_pod("mine", ns, tmp_path / "m", ENV_ONLY_WORKER.ref))
    assert r.returncode == 0, output(r)
    got = json.loads(cluster.kubectl("get", "pod", "mine", "-n", ns, "-o", "json").stdout)
    index = [g["name"] for g in got["spec"]["schedulingGates"]].index(GATE)
    r = cluster.kubectl(
        "patch", "pod", "mine", "-n", ns, "--type=json",
        "-p", json.dumps([{"op": "remove", "path": f"/spec/schedulingGates/{index}"}]),
    )  # fmt: skip
    assert r.returncode == 0, output(r)
    eventually(
        lambda: bool(json.loads(cluster.kubectl(
            "get", "pod", "mine", "-n", ns, "-o", "json").stdout)["spec"].get("nodeName")),
        within=60, what="the ungated pod to be scheduled",
    )  # fmt: skip
    # A preflight nobody waits on any more is not left behind.
    eventually(lambda: pods(cluster, ns, f"{PREFLIGHT_LABEL}=true") == [], within=60,
               what="the controller to delete the preflight nobody waits on")  # fmt: skip
    r = cluster.kubectl("get", "imageverdicts", "-o", "json")
    assert json.loads(r.stdout)["items"] == []


def test_four_workloads_on_three_images_start_one_preflight_each_through_a_controller_restart(
    cluster: ControlPlane, tmp_path: Path
) -> None:
    """4 Deployments in 2 namespaces on 3 images, the controller's pods killed while the
    preflights run: exactly one preflight per (namespace, image), and every gate decided:
    the bad image held, the files-clean one let go, and an image without python3 (its
    preflight cannot run) let go with a Warning (preflight.onError=open)."""
    with opted_in_namespace(cluster, "gate") as a, opted_in_namespace(cluster, "gate") as b:
        plan = [
            (a, "bad-1", BAD_WORKER.ref, 2),
            (a, "bad-2", BAD_WORKER.ref, 1),
            (a, "clean", ENV_ONLY_WORKER.ref, 1),
            (b, "nopython", BUSYBOX_IMAGE, 1),
        ]
        for ns, name, image, replicas in plan:
            r = apply(cluster, deployment(name, ns, image, tmp_path / name, replicas, claim=False))
            assert r.returncode == 0, output(r)
        controllers = "app.kubernetes.io/component=controller"
        r = cluster.kubectl(
            "delete", "pods", "-n", "epguard-system", "-l", controllers, "--wait=false"
        )  # fmt: skip
        assert r.returncode == 0, output(r)

        def decided() -> bool:
            for ns, name, _, replicas in plan:
                found = pods(cluster, ns, f"app={name}")
                if len(found) != replicas:
                    return False
                for p in found:
                    c = condition(p)
                    if c is None or c["reason"] == "PreflightRunning":
                        return False
            return True

        eventually(decided, within=PREFLIGHT_TIMEOUT, what="every gate decided", every=2.0)
        images = {
            ns: sorted(p["spec"]["initContainers"][1]["image"]
                       for p in pods(cluster, ns, f"{PREFLIGHT_LABEL}=true"))
            for ns in (a, b)
        }  # fmt: skip
        assert images == {
            a: sorted([BAD_WORKER.ref, ENV_ONLY_WORKER.ref]),
            b: [BUSYBOX_IMAGE],
        }, images
        reasons = {
            name: {condition(p)["reason"] for p in pods(cluster, ns, f"app={name}")}  # type: ignore[index]
            for ns, name, _, _ in plan
        }
        assert reasons == {
            "bad-1": {"ImageUnusable"},
            "bad-2": {"ImageUnusable"},
            "clean": {"PreflightPassed"},
            "nopython": {"PreflightFailedGateOpened"},
        }, reasons
        (opened,) = pods(cluster, b, "app=nopython")
        assert not [g for g in opened["spec"].get("schedulingGates", []) if g["name"] == GATE]


def test_an_image_no_one_can_pull_says_why_its_pods_wait_and_learns_nothing(
    cluster: ControlPlane, gated_namespace: str, tmp_path: Path
) -> None:
    """Bad input: a worker on an image the (real) registry does not hold, and one on an
    image behind a registry that wants credentials the namespace has no pull secret for
    (the node's private registry: 401 without them). Neither preflight can pull; each
    waiting pod's condition says so while the deadline runs, and nothing is recorded
    about an image nobody could read. Both at once: each waits on the kubelet's pull
    error, ~14 s here."""
    ns = gated_namespace
    node = node_of(cluster)
    cases = {
        "ghost": (node.registry, "epguard/not-pushed", 404),
        "private": (node.private_registry, "team/sglang-private", 401),
    }
    since = {name: registry.log_offset() for name, (registry, _, _) in cases.items()}
    for name, (registry, repository, _) in cases.items():
        pod = worker_pod(name, ns, tmp_path / name, f"{registry.host}/{repository}:1")
        pod["metadata"]["labels"] = {"case": name}
        pod["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"
        r = apply(cluster, pod)
        assert r.returncode == 0, output(r)

    def says_why(name: str) -> bool:
        (p,) = pods(cluster, ns, f"case={name},!{PREFLIGHT_LABEL}")
        c = condition(p)
        return (
            c is not None
            and c["reason"] == "PreflightRunning"
            and ("ErrImagePull" in c["message"] or "ImagePullBackOff" in c["message"])
        )

    eventually(
        lambda: all(says_why(name) for name in cases),
        within=120,
        what="the pull errors in the pods' conditions",
        every=1.0,
    )
    for name, (registry, repository, status) in cases.items():
        (p,) = pods(cluster, ns, f"case={name},!{PREFLIGHT_LABEL}")
        assert GATE in [g["name"] for g in p["spec"]["schedulingGates"]]
        assert not p["spec"].get("nodeName")
        # The registry was asked, and answered: no such manifest, or not without
        # credentials.
        log = registry.log.read_bytes()[since[name] :].decode()
        assert f'"HEAD /v2/{repository}/manifests/1 HTTP/1.1" {status}' in log, log[-2000:]
    r = cluster.kubectl("get", "imageverdicts", "-o", "json")
    assert json.loads(r.stdout)["items"] == []


def test_swapping_a_gated_pods_worker_image_in_place_is_refused(
    cluster: ControlPlane, gated_namespace: str, tmp_path: Path
) -> None:
    """An UPDATE that changes the image of a gated pod: its injected probe (and the
    preflight the pod waits on) were for the old image, so epguard refuses the swap
    (stale-probe) and the pod stays what was judged."""
    ns = gated_namespace
    r = apply(cluster, worker_pod("swap", ns, tmp_path / "m", ENV_ONLY_WORKER.ref))
    assert r.returncode == 0, output(r)
    got = json.loads(cluster.kubectl("get", "pod", "swap", "-n", ns, "-o", "json").stdout)
    assert GATE in [g["name"] for g in got["spec"]["schedulingGates"]]
    r = cluster.kubectl("set", "image", "pod/swap", "-n", ns, f"worker={BAD_WORKER.ref}")
    assert denied_by_epguard(r) and "stale-probe" in r.stderr, output(r)
    got = json.loads(cluster.kubectl("get", "pod", "swap", "-n", ns, "-o", "json").stdout)
    assert got["spec"]["containers"][0]["image"] == ENV_ONLY_WORKER.ref


def test_with_the_webhook_down_a_pod_is_created_ungated_and_unprobed(
    cluster: ControlPlane, gated_namespace: str, tmp_path: Path
) -> None:
    """What an outage of the webhook costs (docs/preflight.md): injection is best effort
    (failurePolicy Ignore), so a worker created meanwhile gets neither the gate nor the
    probe -- only the backstop policy (known-bad images) still applies. Once the webhook
    is back, the next pod is gated again."""
    ns = gated_namespace
    webhook = ["-n", "epguard-system", "deployment/epguard-webhook"]
    r = cluster.kubectl("scale", *webhook, "--replicas=0")
    assert r.returncode == 0, output(r)
    try:
        eventually(lambda: pods(cluster, "epguard-system",
                                "app.kubernetes.io/component=webhook") == [],
                   within=60, what="the webhook's pods to go")  # fmt: skip
        during = worker_pod("during", ns, tmp_path / "m", ENV_ONLY_WORKER.ref)
        during["spec"]["restartPolicy"] = "Never"  # it runs unjudged: once is enough
        r = apply(cluster, during)
        assert r.returncode == 0, output(r)
        got = json.loads(cluster.kubectl("get", "pod", "during", "-n", ns, "-o", "json").stdout)
        assert not got["spec"].get("schedulingGates")
        assert [c["name"] for c in got["spec"].get("initContainers", [])] == ["model-download"]
    finally:
        r = cluster.kubectl("scale", *webhook, "--replicas=2")
        assert r.returncode == 0, output(r)
        r = cluster.kubectl("rollout", "status", *webhook, "--timeout=120s")
        assert r.returncode == 0, output(r)

    def gated_again() -> bool:
        name = f"after-{len(pods(cluster, ns, '!' + PREFLIGHT_LABEL))}"
        r = cluster.kubectl(
            "create", "--dry-run=server", "-o", "json", "-f", "-",
            input=json.dumps(worker_pod(name, ns, tmp_path / "m", ENV_ONLY_WORKER.ref)),
        )  # fmt: skip
        return r.returncode == 0 and GATE in r.stdout

    eventually(gated_again, within=60, what="the webhook to gate pods again", every=1.0)
