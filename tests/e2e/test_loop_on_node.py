"""The loop on the real node, as a team meets it: a Deployment of SGLang workers on the
real worker image in a namespace opted in to injection. kube-controller-manager makes
the ReplicaSet and the pod, the kubelet runs the injected probe in the worker's image
and writes its termination into the pod's status, the controller (the chart's pod)
turns it into an ImageVerdict and Events, and the webhook refuses the next pod."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from devcluster import ControlPlane
from devcluster.images import BAD_WORKER
from epguard.webhook.engine.verdicts import verdict_name
from tests.e2e.e2e_kube import apply, denied_by_epguard, eventually, output, pod, worker
from tests.e2e.node_e2e import SharedCluster, opted_in_namespace, wait_probe, workload

pytestmark = [pytest.mark.e2e, pytest.mark.node]

PRINTER_COLUMNS = [
    "NAME",
    "IMAGE",
    "DIGEST",
    "VERDICT",
    "SOURCE",
    "SGLANG",
    "TORCH",
    "MOONCAKE",
    "LAST",
    "SEEN",
]


@pytest.fixture(scope="module")
def cluster(shared_node: SharedCluster) -> Iterator[ControlPlane]:
    yield shared_node.cluster()
    shared_node.tidy()


@pytest.fixture(scope="module")
def recorded(
    cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    with opted_in_namespace(cluster) as ns:
        models = tmp_path_factory.mktemp("models")
        r = apply(cluster, workload("Deployment", "sglang", ns, models))
        assert r.returncode == 0, r.stderr
        found = wait_probe(cluster, ns, ["-l", "app=sglang"])
        digest = found["status"]["imageID"].rsplit("@", 1)[-1]
        name = verdict_name(BAD_WORKER.ref, digest)
        verdict: dict[str, Any] = {}

        def written() -> bool:
            r = cluster.kubectl("get", "imageverdict", name, "-o", "json")
            if r.returncode == 0:
                verdict.update(json.loads(r.stdout))
            return r.returncode == 0

        eventually(written, within=60, what=f"the controller to write ImageVerdict {name}")
        yield {
            "namespace": ns,
            "pod": found["pod"]["metadata"]["name"],
            "replicaset": found["pod"]["metadata"]["ownerReferences"][0]["name"],
            "message": found["terminated"]["message"],
            "digest": digest,
            "verdict": verdict,
        }


def events(cp: ControlPlane, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
    r = cp.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "-o",
        "json",
        "--field-selector",
        f"involvedObject.kind={kind},involvedObject.name={name}",
    )
    assert r.returncode == 0, r.stderr
    items: list[dict[str, Any]] = json.loads(r.stdout)["items"]
    return [e for e in items if e["source"].get("component") == "epguard-controller"]


def test_the_image_verdict_holds_the_image_the_containerd_digest_the_reason_and_the_pod(
    recorded: dict[str, Any],
) -> None:
    spec = recorded["verdict"]["spec"]
    assert spec["image"] == BAD_WORKER.ref
    assert spec["digest"] == recorded["digest"]
    assert spec["verdict"] == "Unusable"
    assert recorded["message"].splitlines()[0].endswith(": " + spec["reason"])
    assert spec["pod"] == f"{recorded['namespace']}/{recorded['pod']}"
    # One per probe termination: the Deployment's pod may have retried the probe by now.
    assert spec["count"] >= 1


def test_kubectl_get_imageverdicts_reads_as_a_compatibility_table(
    cluster: ControlPlane, recorded: dict[str, Any]
) -> None:
    name = recorded["verdict"]["metadata"]["name"]
    out = cluster.kubectl("get", "imageverdicts", name, check=True).stdout
    header, row = out.splitlines()
    assert header.split() == PRINTER_COLUMNS
    assert row.split()[:5] == [name, BAD_WORKER.ref, recorded["digest"], "Unusable", "probe"]
    assert " 0.5.23 " in row and " 2.13.0+cu130 " in row
    assert "mooncake-transfer-engine 0.3.13.post1" in row
    assert re.search(r"\s\d+s$", row)  # LAST SEEN: seconds ago


def test_an_event_with_the_reason_is_posted_on_the_pod(
    cluster: ControlPlane, recorded: dict[str, Any]
) -> None:
    found = events(cluster, recorded["namespace"], "Pod", recorded["pod"])
    assert found and {e["reason"] for e in found} == {"MooncakeProbeFailed"}
    assert all(e["type"] == "Warning" for e in found)
    assert recorded["message"].splitlines()[0][:200] in found[0]["message"]


def test_the_same_event_is_posted_on_the_deployment_not_the_replicaset(
    cluster: ControlPlane, recorded: dict[str, Any]
) -> None:
    on_deployment = events(cluster, recorded["namespace"], "Deployment", "sglang")
    on_replicaset = events(cluster, recorded["namespace"], "ReplicaSet", recorded["replicaset"])
    assert on_deployment and {e["reason"] for e in on_deployment} == {"MooncakeProbeFailed"}
    pod_name = f"{recorded['namespace']}/{recorded['pod']}"
    assert f"epguard probe in pod {pod_name}" in on_deployment[0]["message"]
    assert on_replicaset == []


def test_kubectl_describe_pod_shows_the_termination_the_kubelet_wrote(
    cluster: ControlPlane, recorded: dict[str, Any]
) -> None:
    out = cluster.kubectl(
        "describe", "pod", recorded["pod"], "-n", recorded["namespace"], check=True
    ).stdout
    first = re.escape(recorded["message"].splitlines()[0])
    assert re.search(r"Reason:\s+Error\n\s+Message:\s+" + first, out)
    assert re.search(r"Exit Code:\s+1\n", out)
    assert re.search(r"Warning\s+MooncakeProbeFailed\s+.*epguard-controller", out)


def test_the_next_pod_on_that_image_is_refused_with_the_learned_reason_and_where(
    cluster: ControlPlane, recorded: dict[str, Any]
) -> None:
    next_pod = pod("sglang-next", recorded["namespace"], worker(BAD_WORKER.ref))
    eventually(
        lambda: denied_by_epguard(apply(cluster, next_pod, dry_run=True)),
        what="the webhook to learn the verdict",
    )
    r = apply(cluster, next_pod)
    assert denied_by_epguard(r), output(r)
    spec = recorded["verdict"]["spec"]
    # The backstop policy answers before the webhook (the API server evaluates policies
    # first) and says where only as "in this cluster" (docs/backstop.md); the webhook
    # names the pod.
    where = ("(seen failing in pod ", "(seen failing in this cluster")
    assert any(f"which this image cannot serve: {spec['reason']} {w}" in r.stderr for w in where)
    assert f"[epguard verdict {recorded['verdict']['metadata']['name']}]" in r.stderr


def test_a_pod_pinned_to_the_failing_digest_is_refused_too(
    cluster: ControlPlane, recorded: dict[str, Any]
) -> None:
    repo = BAD_WORKER.ref.rsplit(":", 1)[0]
    pinned = pod("sglang-pinned", recorded["namespace"], worker(f"{repo}@{recorded['digest']}"))
    eventually(
        lambda: denied_by_epguard(apply(cluster, pinned, dry_run=True)),
        what="the webhook to refuse the digest",
    )
    r = apply(cluster, pinned)
    assert denied_by_epguard(r), output(r)
    assert f"[epguard verdict {recorded['verdict']['metadata']['name']}]" in r.stderr
