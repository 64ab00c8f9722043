"""The controller in HA and across an API server restart, through a real kube-apiserver.

Two controller replicas run with kopf peering, as the chart runs them: one handles
pod events, the other pauses, so a probe outcome is recorded once (count 1, one
Event), and the loops kopf does not pause (the preflight passes, the backstop's writer)
run on the replica kopf keeps active only. Then kube-apiserver is restarted (etcd and
every object kept) and the controller, without a restart of its own, records the next
outcome.

This test owns its control plane: restarting the session's API server would disturb
every other e2e test.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster import ControlPlane
from devcluster.process import ManagedProcess
from devcluster.stack import CHART_DIR, NAMESPACE, REPO_ROOT, _child_env, install_chart
from epguard.webhook.controller.architectures import ARCH_LABEL
from epguard.webhook.controller.owners import COMPONENT
from epguard.webhook.engine.outcome import PROBED_LABEL
from epguard.webhook.engine.signing import SIGNATURE_ANNOTATION, keyring_from_secret, sign
from epguard.webhook.engine.verdicts import MANAGED_BY_LABEL, verdict_name
from tests.control_plane import running_control_plane
from tests.e2e.e2e_kube import as_yaml, eventually
from tests.probe.probe_pods import pod_with_probe_status, run_real_probe

pytestmark = pytest.mark.e2e

PEERING = "epguard-e2e-ha"
RESUMED = "Resuming operations after the pause"
PAUSED = "Pausing operations in favour of"
RECORDED = "recorded Unusable for"
LEADS = "this replica leads"
FOLLOWS = "another replica leads"


NODE = "gpu-e2e-1"  # where the probes "ran": a Node object, no kubelet behind it


def create_node(cp: ControlPlane, name: str, arch: str | None) -> None:
    labels = {ARCH_LABEL: arch} if arch else {}
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
    cp.kubectl("create", "-f", "-", input=json.dumps(node), check=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with running_control_plane() as cp:
        install_chart(cp, CHART_DIR, [])
        create_node(cp, NODE, "amd64")
        # Listed first by name and unlabelled: the node selectors must pass it by (a list
        # of one that stopped at it would see one architecture where there are two).
        create_node(cp, "0-unlabelled", None)
        yield cp


@pytest.fixture(scope="module")
def controllers(
    cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ManagedProcess]]:
    logs = tmp_path_factory.mktemp("controllers")
    argv = [
        sys.executable, "-m", "epguard.webhook.controller",
        "--namespace", NAMESPACE,
        "--manage-certs", "false",
        "--peering", PEERING,
        "--liveness", "",
    ]  # fmt: skip
    procs = [
        ManagedProcess.spawn(
            f"controller-{i}",
            argv,
            logs / f"controller-{i}.log",
            # Checked often: the last test adds a node of a second architecture.
            env={**_child_env(cluster), "EPGUARD_ARCHITECTURE_CHECK_SECONDS": "1"},
            cwd=REPO_ROOT,
        )
        for i in range(2)
    ]
    try:
        # kopf starts every replica paused when peering is mandatory; the one with the
        # highest priority resumes, the other stays paused and says nothing more.
        eventually(
            lambda: any(RESUMED in p.log_tail(200) for p in procs),
            within=90,
            what="one replica to resume after the peering pause",
        )
        yield procs
    finally:
        for p in procs:
            p.stop()


def digest_for(image: str) -> str:
    """A distinct digest per image, so each test's verdict is its own object."""
    return "sha256:" + hashlib.sha256(image.encode()).hexdigest()


def probe_pod(
    name: str, namespace: str, image: str, labelled: bool = True, pull_policy: str = "Always"
) -> dict[str, Any]:
    pod = pod_with_probe_status("", 1, image=image, pull_policy=pull_policy)
    labels = {PROBED_LABEL: "true"} if labelled else {}
    pod["metadata"] = {"name": name, "namespace": namespace, "labels": labels}
    pod.pop("status")
    return pod


def signed(cp: ControlPlane, obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    """``obj`` signed as /mutate signs what it injects, with the key the controllers keep
    in the Secret they created: this control plane runs no webhook, and the controller
    learns only from signed probes (webhook/engine/signing.py)."""
    got: dict[str, Any] = {}

    def key_exists() -> bool:
        r = cp.kubectl("get", "secret", "epguard-probe-key", "-n", NAMESPACE, "-o", "json")
        if r.returncode == 0:
            got.update(json.loads(r.stdout))
        return r.returncode == 0

    eventually(key_exists, within=60, what="the controller to create the probe-signing key")
    ring = keyring_from_secret(got)
    annotations = obj["metadata"].setdefault("annotations", {})
    # Signed now: the controller learns only from a pod created soon after its signing.
    annotations[SIGNATURE_ANNOTATION] = sign(ring.current, namespace, obj, dt.datetime.now(dt.UTC))
    return obj


def fail_probe(
    cp: ControlPlane,
    name: str,
    namespace: str,
    image: str,
    message: str,
    labelled: bool = True,
    node: str = NODE,
    pull_policy: str = "Always",
    exit_code: int = 1,
) -> None:
    """Create the (signed) pod, bound to ``node``, and write its probe's termination as
    the kubelet would."""
    obj = signed(cp, probe_pod(name, namespace, image, labelled, pull_policy), namespace)
    obj["spec"]["nodeName"] = node
    create_terminated(cp, obj, message, exit_code, digest_for(image))


def create_terminated(
    cp: ControlPlane, obj: dict[str, Any], message: str, exit_code: int, digest: str
) -> None:
    """Create ``obj`` and write its probe's termination (the bytes ``digest``) as the
    kubelet would: as the node it is bound to (the chart's epguard-probe-status lets no
    one else write an epguard container's status; this control plane has no kubelet, so
    the write is made under its name, with the admin's rights)."""
    node = obj["spec"].setdefault("nodeName", NODE)
    r = cp.kubectl("create", "-f", "-", input=as_yaml(obj))
    assert r.returncode == 0, r.stderr
    image = obj["spec"]["initContainers"][1]["image"]
    image_id = f"{image.rsplit(':', 1)[0]}@{digest}"
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    status = pod_with_probe_status(
        message, exit_code, image=image, image_id=image_id, started_at=now, finished_at=now
    )["status"]
    name, namespace = obj["metadata"]["name"], obj["metadata"]["namespace"]
    r = cp.kubectl(
        f"--as=system:node:{node}", "--as-group=system:masters", "patch", "pod", name,
        "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def verdict_count(cp: ControlPlane, name: str) -> int:
    r = cp.kubectl("get", "imageverdict", name, "-o", "json")
    return int(json.loads(r.stdout)["spec"]["count"]) if r.returncode == 0 else 0


def probe_events(cp: ControlPlane, namespace: str, pod: str) -> int:
    r = cp.kubectl(
        "get", "events", "-n", namespace, "-o", "json",
        "--field-selector", f"involvedObject.name={pod},reason=MooncakeProbeFailed",
    )  # fmt: skip
    return len(json.loads(r.stdout)["items"])


def test_a_probe_that_did_not_resolve_its_tag_teaches_the_digest_only(
    cluster: ControlPlane, controllers: list[ManagedProcess], tmp_path: Path
) -> None:
    """IfNotPresent: the node ran its own copy of the tag, maybe an old build. The real
    controller, through the real API server, names the verdict after the digest alone
    and writes ``name@digest`` as its image: nothing answers for the tag."""
    cluster.kubectl("create", "namespace", "stale", check=True)
    _, message = run_real_probe(tmp_path)
    image = "registry.example.com/e2e/sglang:stale-1"
    fail_probe(cluster, "worker-stale", "stale", image, message, pull_policy="IfNotPresent")
    digest = digest_for(image)
    name = digest.replace(":", "-")
    eventually(lambda: verdict_count(cluster, name) >= 1, within=60, what="the ImageVerdict")
    got = json.loads(cluster.kubectl("get", "imageverdict", name, "-o", "json", check=True).stdout)
    assert got["spec"]["image"] == f"registry.example.com/e2e/sglang@{digest}"
    assert verdict_count(cluster, verdict_name(image, digest)) == 0


def test_a_gated_workers_probe_answers_for_the_tag_its_preflight_pulled(
    cluster: ControlPlane, controllers: list[ManagedProcess]
) -> None:
    """The preflight (Always) finds the tag's bytes and proves nothing from its files; the
    worker, pulling IfNotPresent, runs the same bytes and passes: its verdict answers for
    the tag, so the next pods on the tag are not gated again."""
    cluster.kubectl("create", "namespace", "resolved", check=True)
    image = "registry.example.com/e2e/sglang:resolved-1"
    cleared = "epguard: no image cause in this image's files: the GPU node decides"
    fail_probe(cluster, "preflight-r", "resolved", image, cleared, exit_code=0)
    usable = (
        "epguard: mooncake elastic EP is usable: mooncake.pg imports after torch\n"
        "versions: torch=2.13.0+cu130 sglang=0.5.18 mooncake-transfer-engine-cuda13=0.3.13.post1"
    )
    # The preflight's event reaches the controller first (as on a node: minutes apart).
    time.sleep(2)
    fail_probe(cluster, "worker-r", "resolved", image, usable, pull_policy="IfNotPresent",
               exit_code=0)  # fmt: skip
    name = verdict_name(image, digest_for(image))
    eventually(lambda: verdict_count(cluster, name) >= 1, within=60, what="the tag's verdict")
    got = json.loads(cluster.kubectl("get", "imageverdict", name, "-o", "json", check=True).stdout)
    assert got["spec"]["image"] == image and got["spec"]["verdict"] == "Usable"


def test_one_signature_teaches_once_across_pods(
    cluster: ControlPlane, controllers: list[ManagedProcess], tmp_path: Path
) -> None:
    """Issue 21.1: each signature counts once. A tenant copies an injected pod, signature
    and all, into a second pod within FRESH_SECONDS; only the first pod's probe is
    evidence, whatever the second's status says. Before, the controller kept its ledger
    in each pod's own copy of kopf's memo, so the copy verified too (the unit tests,
    sharing one memo, never saw it)."""
    cluster.kubectl("create", "namespace", "replay", check=True)
    _, message = run_real_probe(tmp_path)
    image = "registry.example.com/e2e/sglang:replay-1"
    first = signed(cluster, probe_pod("first", "replay", image), "replay")
    first["spec"]["nodeName"] = NODE
    second = json.loads(json.dumps(first))
    second["metadata"]["name"] = "second"
    other = "sha256:" + "5e" * 32
    create_terminated(cluster, first, message, 1, digest_for(image))
    name = verdict_name(image, digest_for(image))
    eventually(lambda: verdict_count(cluster, name) >= 1, within=60, what="the first's verdict")
    create_terminated(cluster, second, message, 1, other)

    def refused() -> bool:
        r = cluster.kubectl(
            "get", "events", "-n", "replay", "-o", "json",
            "--field-selector", "involvedObject.name=second,reason=EpguardProbeNotTrusted",
        )  # fmt: skip
        return any("used by pod uid" in e["message"] for e in json.loads(r.stdout)["items"])

    eventually(refused, within=60, what="the copied signature refused")
    assert verdict_count(cluster, verdict_name(image, other)) == 0


def test_two_replicas_record_a_probe_outcome_once(
    cluster: ControlPlane, controllers: list[ManagedProcess], tmp_path: Path
) -> None:
    cluster.kubectl("create", "namespace", "ha", check=True)
    _, message = run_real_probe(tmp_path)
    image = "registry.example.com/e2e/sglang:ha-1"
    fail_probe(cluster, "worker-ha", "ha", image, message)
    name = verdict_name(image, digest_for(image))
    eventually(lambda: verdict_count(cluster, name) >= 1, within=60, what="the ImageVerdict")
    eventually(lambda: probe_events(cluster, "ha", "worker-ha") >= 1, what="the pod's Event")
    # A later pod event (any status change) re-delivers the termination to whichever
    # replica is active; it must not be counted again.
    cluster.kubectl("label", "pod", "worker-ha", "-n", "ha", "touched=yes", check=True)
    cluster.kubectl("annotate", "pod", "worker-ha", "-n", "ha", "touched=again", check=True)
    eventually(
        lambda: (
            "touched" in cluster.kubectl("get", "pod", "worker-ha", "-n", "ha", "-o", "json").stdout
        ),
        what="the pod update",
    )
    assert verdict_count(cluster, name) == 1
    assert probe_events(cluster, "ha", "worker-ha") == 1
    assert all(p.alive() for p in controllers)
    # This pod's line: other tests of the module record too, on whichever replica led.
    handled = [p.name for p in controllers if f"{RECORDED} {image} from pod ha/" in p.log_tail(500)]
    assert len(handled) == 1, f"replicas that recorded the outcome: {handled}"
    # The other replica is paused: it never resumed, or it paused again after resuming
    # (both can resume for a moment at start, before each sees the other's priority).
    for p in controllers:
        if p.name in handled:
            continue
        log = p.log_tail(500)
        assert RESUMED not in log or log.rindex(PAUSED) > log.rindex(RESUMED), log


def _last_says(log: str, on: str, off: str) -> bool:
    """The later of two log lines is ``on``."""
    return on in log and (off not in log or log.rindex(on) > log.rindex(off))


def test_the_loops_kopf_does_not_pause_run_on_the_replica_it_keeps_active(
    cluster: ControlPlane, controllers: list[ManagedProcess]
) -> None:
    """kopf pauses only its own watches on the other replica; the preflight passes and
    the backstop's writer ask leadership.Leadership, which reads kopf's rule from the same
    peering object. Both replicas agree with kopf: the one it resumed leads them, the
    other does not (before, both ran every pass and every sync)."""

    def agree() -> bool:
        logs = [p.log_tail(5000) for p in controllers]
        active = [_last_says(log, RESUMED, PAUSED) for log in logs]
        leading = [_last_says(log, LEADS, FOLLOWS) for log in logs]
        return active.count(True) == 1 and leading == active

    eventually(agree, within=60, what="each replica to lead the loops exactly when kopf runs it")
    follower = next(p for p in controllers if not _last_says(p.log_tail(5000), LEADS, FOLLOWS))
    assert FOLLOWS in follower.log_tail(5000)


def test_the_controller_records_again_after_the_api_server_restarts(
    cluster: ControlPlane, controllers: list[ManagedProcess], tmp_path: Path
) -> None:
    cluster.kubectl("create", "namespace", "restart", check=True)
    cluster.restart_apiserver()
    _, message = run_real_probe(tmp_path)
    image = "registry.example.com/e2e/sglang:restart-1"
    fail_probe(cluster, "worker-after-restart", "restart", image, message)
    name = verdict_name(image, digest_for(image))
    eventually(
        lambda: verdict_count(cluster, name) == 1,
        within=120,
        what="the ImageVerdict recorded by a controller that lived through the restart",
    )
    assert all(p.alive() for p in controllers)


def _depth(text: str) -> int:
    """How deep ``text`` (JSON) nests, without decoding it."""
    depth = most = 0
    for ch in text:
        if ch in "{[":
            depth += 1
            most = max(most, depth)
        elif ch in "}]":
            depth -= 1
    return most


def test_a_pod_nested_past_pythons_default_depth_is_one_more_pod(
    cluster: ControlPlane, controllers: list[ManagedProcess], tmp_path: Path
) -> None:
    """Found by a review helper: ``metadata.managedFields[].fieldsV1`` is free-form JSON a
    tenant may PATCH into its own pod 9,000 levels deep, and the API server stores and
    serves it (Go's decoder allows 10,000). Python decodes 1,000 by default: kopf's pod
    watcher raised RecursionError on it and stayed dead (no probe outcome recorded
    anywhere again), and every preflight pass's list of pods failed."""
    cluster.kubectl("create", "namespace", "deep", check=True)
    image = "registry.example.com/e2e/sglang:deep-0"
    obj = signed(cluster, probe_pod("deep", "deep", image), "deep")
    obj["spec"]["schedulingGates"] = [{"name": "epguard.io/preflight"}]  # a pass lists it
    r = cluster.kubectl("create", "-f", "-", input=as_yaml(obj))
    assert r.returncode == 0, r.stderr
    levels = 9_000
    fields = '{"f:a":' * levels + "{}" + "}" * levels
    patch = (
        '{"metadata":{"managedFields":[{"manager":"tenant","operation":"Update",'
        f'"apiVersion":"v1","fieldsType":"FieldsV1","fieldsV1":{fields}}}]}}}}'
    )
    path = tmp_path / "deep.json"
    path.write_text(patch)
    r = cluster.kubectl(
        "patch", "pod", "deep", "-n", "deep", "--type=merge", "--patch-file", str(path)
    )
    assert r.returncode == 0, r.stderr
    served = cluster.kubectl("get", "--raw", "/api/v1/namespaces/deep/pods/deep")
    assert served.returncode == 0 and _depth(served.stdout) > levels, served.stderr[-400:]
    try:
        # A later probe outcome is recorded: the pod watcher lived through the event.
        _, message = run_real_probe(tmp_path)
        later = "registry.example.com/e2e/sglang:deep-1"
        fail_probe(cluster, "worker-after-deep", "deep", later, message)
        eventually(
            lambda: verdict_count(cluster, verdict_name(later, digest_for(later))) == 1,
            within=90,
            what="the ImageVerdict of a probe that ended after the deep pod's events",
        )
        # And no list or watch of pods failed on it (each preflight pass lists the gated
        # pod, kopf's watch delivered its change).
        for p in controllers:
            assert p.alive(), p.log_tail(80)
            tail = p.log_tail(400)
            assert "RecursionError" not in tail and "has failed" not in tail, tail
    finally:
        cluster.kubectl("delete", "namespace", "deep", "--wait=false")


def test_the_controller_watches_only_pods_labelled_by_injection(
    cluster: ControlPlane, controllers: list[ManagedProcess], tmp_path: Path
) -> None:
    cluster.kubectl("create", "namespace", "selector", check=True)
    _, message = run_real_probe(tmp_path)
    unlabelled = "registry.example.com/e2e/sglang:unlabelled-1"
    labelled = "registry.example.com/e2e/sglang:labelled-1"
    fail_probe(cluster, "hand-written", "selector", unlabelled, message, labelled=False)
    fail_probe(cluster, "injected", "selector", labelled, message)
    # The watch delivers events in order: once the later, labelled pod is recorded, the
    # earlier one would have been too, had the controller been watching it.
    eventually(
        lambda: verdict_count(cluster, verdict_name(labelled, digest_for(labelled))) == 1,
        within=60,
        what="the labelled pod's ImageVerdict",
    )
    assert verdict_count(cluster, verdict_name(unlabelled, digest_for(unlabelled))) == 0


def _exists(cp: ControlPlane, name: str) -> bool:
    return cp.kubectl("get", "imageverdict", name).returncode == 0


def test_a_node_of_a_second_architecture_forgets_what_probes_taught_and_stops_learning(
    cluster: ControlPlane, controllers: list[ManagedProcess], tmp_path: Path
) -> None:
    """A verdict is per digest, the same for every platform of a multi-platform image,
    while a probe judged one platform's files (controller/architectures.py). Once a node
    of another architecture joins, the verdicts probes taught are deleted (a scan's
    stay), and a probe teaches nothing more: its pod and owner say why. The arm64 node
    is deleted at the end, so the module's other tests learn again."""
    cluster.kubectl("create", "namespace", "arch", check=True)
    _, message = run_real_probe(tmp_path)
    taught = "registry.example.com/e2e/sglang:arch-1"
    fail_probe(cluster, "on-amd64", "arch", taught, message)
    name = verdict_name(taught, digest_for(taught))
    eventually(lambda: verdict_count(cluster, name) == 1, within=60, what="the ImageVerdict")
    stored = json.loads(cluster.kubectl("get", "imageverdict", name, "-o", "json").stdout)
    assert stored["spec"]["architecture"] == "amd64"
    scanned = verdict_name("registry.example.com/e2e/sglang:arch-scan", "sha256:" + "ab" * 32,
                           source="scan")  # fmt: skip
    scan_verdict = {
        "apiVersion": "epguard.io/v1alpha1", "kind": "ImageVerdict",
        "metadata": {"name": scanned, "labels": {MANAGED_BY_LABEL: "epguard-scan"}},
        "spec": {"image": "registry.example.com/e2e/sglang:arch-scan",
                 "digest": "sha256:" + "ab" * 32, "verdict": "Unusable", "reason": "x",
                 "report": "x", "versions": {}, "firstSeen": "2026-12-01T10:00:00Z",
                 "lastSeen": "2026-12-01T10:00:00Z", "count": 1, "source": "scan"},
    }  # fmt: skip
    cluster.kubectl("create", "-f", "-", input=json.dumps(scan_verdict), check=True)
    # A scan's verdict under the controller's label: still the scan's (spec.source).
    relabelled = json.loads(json.dumps(scan_verdict))
    relabelled["metadata"] = {"name": scanned + "-x", "labels": {MANAGED_BY_LABEL: COMPONENT}}
    cluster.kubectl("create", "-f", "-", input=json.dumps(relabelled), check=True)
    # One architecture, checked every second: nothing is forgotten.
    for _ in range(3):
        time.sleep(1)
        assert _exists(cluster, name)
    create_node(cluster, "gh200-e2e-1", "arm64")
    try:
        eventually(lambda: not _exists(cluster, name), within=30, what="the verdict deleted")
        assert _exists(cluster, scanned) and _exists(cluster, scanned + "-x")
        learned_not = "registry.example.com/e2e/sglang:arch-2"
        fail_probe(cluster, "on-arm64", "arch", learned_not, message, node="gh200-e2e-1")

        def said_why() -> bool:
            r = cluster.kubectl(
                "get", "events", "-n", "arch", "-o", "json", "--field-selector",
                "involvedObject.name=on-arm64,reason=EpguardVerdictNotLearned",
            )  # fmt: skip
            items = json.loads(r.stdout)["items"] if r.returncode == 0 else []
            return any("more than one architecture" in e["message"] for e in items)

        eventually(said_why, within=60, what="the Event saying why nothing is learned")
        assert probe_events(cluster, "arch", "on-arm64") == 1
        assert not _exists(cluster, verdict_name(learned_not, digest_for(learned_not)))
    finally:  # the module's other tests learn again, in whatever order they run
        cluster.kubectl("delete", "node", "gh200-e2e-1", "--ignore-not-found")
