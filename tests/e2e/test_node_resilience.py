"""epguard's pods under disruption on the real node: a webhook pod deleted, a rolling
restart of the webhook Deployment, the controller restarted mid-recording."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster import ControlPlane
from devcluster.images import BUSYBOX_IMAGE
from tests.e2e.e2e_kube import apply, eventually, plain, pod, wait_event, worker
from tests.e2e.node_e2e import (
    SharedCluster,
    fresh_namespace,
    opted_in_namespace,
    wait_probe,
    worker_pod,
)

pytestmark = [pytest.mark.e2e, pytest.mark.node]

RELEASE_NS = "epguard-system"


@pytest.fixture(scope="module")
def cluster(shared_node: SharedCluster) -> Iterator[ControlPlane]:
    yield shared_node.cluster()
    shared_node.tidy()


def _answered_by_epguard(result: Any) -> bool:
    # Every shipped rule warns about this public image, so a judged pod carries
    # epguard's warning; with failurePolicy Ignore an unjudged one carries nothing.
    out = result.stdout + result.stderr
    return result.returncode == 0 and "[epguard rule " in out


class Load:
    """Creates pods (server-side dry runs) in a loop until stopped; keeps every result."""

    def __init__(self, cp: ControlPlane, namespace: str, make: Any) -> None:
        self.cp, self.namespace, self.make = cp, namespace, make
        self.results: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            self.results.append(apply(self.cp, self.make(f"p{i}", self.namespace), dry_run=True))
            i += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def _elastic(name: str, namespace: str) -> dict[str, Any]:
    return pod(name, namespace, worker("lmsysorg/sglang:v0.5.23-cu129"))


def _ordinary(name: str, namespace: str) -> dict[str, Any]:
    return pod(name, namespace, plain(BUSYBOX_IMAGE))


def _webhook_pods(cp: ControlPlane) -> list[str]:
    r = cp.kubectl(
        "get",
        "pods",
        "-n",
        RELEASE_NS,
        "-l",
        "app.kubernetes.io/component=webhook",
        "-o",
        "name",
        check=True,
    )
    return r.stdout.split()


def test_ordinary_pods_are_admitted_throughout_while_a_webhook_pod_is_deleted(
    cluster: ControlPlane,
) -> None:
    fresh_namespace(cluster, "disrupt-delete")
    with (
        Load(cluster, "disrupt-delete", _ordinary) as ordinary,
        Load(cluster, "disrupt-delete", _elastic) as elastic,
    ):
        time.sleep(2)
        victim = _webhook_pods(cluster)[0]
        r = cluster.kubectl("delete", "-n", RELEASE_NS, victim, "--wait=false")
        assert r.returncode == 0, r.stderr
        r = cluster.kubectl(
            "rollout",
            "status",
            "-n",
            RELEASE_NS,
            "deployment/epguard-webhook",
            "--timeout=120s",
        )
        assert r.returncode == 0, r.stderr
        time.sleep(2)
    assert len(ordinary.results) > 5
    failed = [r.stderr for r in ordinary.results if r.returncode != 0]
    assert not failed, failed[:3]
    # The elastic-EP pods went to the surviving replica (failurePolicy Ignore would
    # admit any that found none); most must have been judged.
    judged = sum(_answered_by_epguard(r) for r in elastic.results)
    print(f"elastic-EP pods judged while a replica was deleted: {judged}/{len(elastic.results)}")
    assert judged >= len(elastic.results) // 2


def test_a_rolling_restart_of_the_webhook_under_load_fails_no_admission(
    cluster: ControlPlane,
) -> None:
    fresh_namespace(cluster, "disrupt-rollout")
    with Load(cluster, "disrupt-rollout", _elastic) as load:
        time.sleep(2)
        r = cluster.kubectl("rollout", "restart", "-n", RELEASE_NS, "deployment/epguard-webhook")
        assert r.returncode == 0, r.stderr
        r = cluster.kubectl(
            "rollout", "status", "-n", RELEASE_NS, "deployment/epguard-webhook", "--timeout=180s"
        )
        assert r.returncode == 0, r.stderr
        time.sleep(2)
    assert len(load.results) > 5
    unjudged = [r.stdout + r.stderr for r in load.results if not _answered_by_epguard(r)]
    print(f"rolling restart: {len(load.results) - len(unjudged)}/{len(load.results)} judged")
    assert not unjudged, unjudged[:3]


def test_the_controller_restarted_mid_recording_records_the_outcome_once(
    cluster: ControlPlane, tmp_path: Path
) -> None:
    with opted_in_namespace(cluster) as ns:
        # Never: one probe run, so exactly one outcome to record.
        pod = worker_pod("sglang-0", ns, tmp_path / "models")
        pod["spec"]["restartPolicy"] = "Never"
        r = apply(cluster, pod)
        assert r.returncode == 0, r.stderr
        # Restart every controller replica while the probe runs and its outcome lands.
        r = cluster.kubectl(
            "delete",
            "pods",
            "-n",
            RELEASE_NS,
            "-l",
            "app.kubernetes.io/component=controller",
            "--wait=false",
        )
        assert r.returncode == 0, r.stderr
        wait_probe(cluster, ns, ["--field-selector=metadata.name=sglang-0"])

        def events() -> list[dict[str, Any]]:
            r = cluster.kubectl(
                "get",
                "events",
                "-n",
                ns,
                "-o",
                "json",
                "--field-selector=involvedObject.name=sglang-0,reason=MooncakeProbeFailed",
            )
            items: list[dict[str, Any]] = json.loads(r.stdout)["items"]
            return items

        eventually(lambda: bool(events()), within=120, what="the controller's Event")
        verdicts = json.loads(cluster.kubectl("get", "imageverdicts", "-o", "json").stdout)
        time.sleep(5)  # a second recording, if any, would land by now
        assert len(verdicts["items"]) == 1
        assert sum(e.get("count", 1) for e in events()) == 1


def test_a_broken_rules_configmap_that_got_past_admission_survives_a_restart(
    cluster: ControlPlane,
) -> None:
    # The rules edit check is failurePolicy Ignore (an epguard outage must never keep an
    # admin from editing the rules), so with the webhook down a broken edit lands. The
    # same ConfigMap is the file the webhook starts from: it must come up Ready on its
    # built-in rules, say why on the ConfigMap, and keep judging.
    get = ["get", "deployment", "epguard-webhook", "-n", RELEASE_NS, "-o", "json"]
    replicas = json.loads(cluster.kubectl(*get, check=True).stdout)["spec"]["replicas"]
    r = cluster.kubectl("get", "configmap", "epguard-rules", "-n", RELEASE_NS, "-o", "json")
    original = json.loads(r.stdout)["data"]["rules.yaml"]
    scale = ["scale", "deployment", "epguard-webhook", "-n", RELEASE_NS]
    cluster.kubectl(*scale, "--replicas=0", check=True)
    eventually(lambda: not _webhook_pods(cluster), within=120, what="the webhook pods to go")
    broken = json.dumps({"data": {"rules.yaml": "rules:\n  - {id: a, action: explode\n"}})
    patch = ["patch", "configmap", "epguard-rules", "-n", RELEASE_NS, "--type=merge", "-p"]
    try:
        r = cluster.kubectl(*patch, broken)
        assert r.returncode == 0, r.stderr  # nobody checked it
        cluster.kubectl(*scale, f"--replicas={replicas}", check=True)
        r = cluster.kubectl(
            "rollout", "status", "-n", RELEASE_NS, "deployment/epguard-webhook", "--timeout=180s"
        )
        assert r.returncode == 0, r.stderr  # Ready, not in a crash loop
        pods = json.loads(
            cluster.kubectl(
                "get", "pods", "-n", RELEASE_NS, "-l", "app.kubernetes.io/component=webhook",
                "-o", "json", check=True,
            ).stdout
        )["items"]  # fmt: skip
        assert all(s["restartCount"] == 0 for p in pods for s in p["status"]["containerStatuses"])

        wait_event(cluster, RELEASE_NS, "epguard-rules", "EpguardRulesFileRejected")
        ns = fresh_namespace(cluster, "broken-rules")
        eventually(
            lambda: _answered_by_epguard(apply(cluster, _elastic("p", ns), dry_run=True)),
            within=30,
            what="the restarted webhook to judge on its built-in rules",
        )
    finally:
        restore = json.dumps({"data": {"rules.yaml": original}})
        cluster.kubectl(*patch, restore, check=True)
