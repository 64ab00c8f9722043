"""The preflight gate's pure half: the gate's patches, one key per (namespace, image,
pull secrets, service account), and the preflight pod built from a gated worker."""

from __future__ import annotations

import copy
import datetime as dt
import json
from dataclasses import replace
from typing import Any

import jsonpatch
import pytest
import yaml

from epguard.webhook.engine.imageref import parse as parse_ref
from epguard.webhook.engine.injection import COPY_CONTAINER, InjectionSettings
from epguard.webhook.engine.namespaces import PREFLIGHT_KEY, NamespaceIndex, settings_from_labels
from epguard.webhook.engine.outcome import PROBE_CONTAINER, PROBED_LABEL
from epguard.webhook.engine.preflight import (
    GATE,
    KEY_LABEL,
    PreflightResult,
    PreflightSettings,
    disruption,
    gate_patch,
    is_gated,
    key_of,
    preflight_pod,
    preflight_result,
    preflight_status,
    shaped_as_preflight,
    signed,
    ungate_patch,
    unjudged,
)
from epguard.webhook.engine.signing import (
    FORMAT,
    SIGNATURE_ANNOTATION,
    exposure,
    new_keyring,
    verify,
)
from epguard.webhook.engine.verdicts import Verdict, VerdictStore
from tests import realmanifests

VERSION = "1.35.0"  # the local node's Kubernetes
IMAGE = "registry.example/sglang:v0.5.18-cu130"
SETTINGS = PreflightSettings(InjectionSettings(epguard_image="registry.example/epguard:1"), 300)


def worker_spec(**extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "serviceAccountName": "sglang",
        "imagePullSecrets": [{"name": "b"}, {"name": "a"}],
        "nodeSelector": {"gpu": "h200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                    ]
                }
            }
        },
        "containers": [
            {
                "name": "worker",
                "image": IMAGE,
                "command": ["python3", "-m", "sglang.launch_server"],
                "args": ["--model-path", "/models/m", "--elastic-ep-backend", "mooncake"],
                "resources": {"limits": {"nvidia.com/gpu": "8", "memory": "1Ti"}},
                "env": [
                    {
                        "name": "HF_TOKEN",
                        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}},
                    }
                ],
                "volumeMounts": [
                    {"name": "model", "mountPath": "/models"},
                    {"name": "cache", "mountPath": "/cache"},
                ],
            },
            {"name": "sidecar", "image": "busybox", "command": ["sleep", "inf"]},
        ],
        "volumes": [
            {"name": "model", "image": {"reference": "registry.example/models/m:1"}},
            {"name": "cache", "persistentVolumeClaim": {"claimName": "model-cache"}},
        ],
    }
    spec.update(extra)
    return spec


def test_the_key_is_what_decides_the_pull() -> None:
    base = key_of("team-a", worker_spec(), IMAGE)
    # As a set: order and duplicates do not matter.
    assert base == key_of(
        "team-a", worker_spec(imagePullSecrets=[{"name": "b"}, {"name": "a"}]), IMAGE
    )
    assert base == key_of(
        "team-a", worker_spec(imagePullSecrets=[{"name": "a"}, {"name": "b"}, {"name": "a"}]), IMAGE
    )
    others = [
        key_of("team-b", worker_spec(), IMAGE),
        key_of("team-a", worker_spec(), IMAGE + "x"),
        key_of("team-a", worker_spec(imagePullSecrets=[{"name": "a"}]), IMAGE),
        key_of("team-a", worker_spec(serviceAccountName="other"), IMAGE),
    ]
    assert len({base.hash, *(k.hash for k in others)}) == 5
    assert key_of("t", {}, IMAGE).service_account == "default"
    assert len(base.pod_name) <= 63 and base.pod_name.startswith("epguard-preflight-")


def test_the_key_hash_does_not_depend_on_separators_in_names() -> None:
    # ("a", "b,c") and ("a,b", "c") must not collide through a joined string.
    one = key_of("ns", {"imagePullSecrets": [{"name": "a"}, {"name": "b,c"}]}, "img")
    two = key_of("ns", {"imagePullSecrets": [{"name": "a,b"}, {"name": "c"}]}, "img")
    assert one.hash != two.hash and one != two


def test_a_key_keeps_no_pull_secret_name() -> None:
    # 50,000 names were kept by every key of every waiting pod (4 MB each in a pass).
    names = [{"name": f"s-{i:05}-{'x' * 40}"} for i in range(50_000)]
    key = key_of("ns", {"imagePullSecrets": names}, "img")
    assert len(repr(key)) < 300
    assert key != key_of("ns", {"imagePullSecrets": names[:-1]}, "img")


def test_the_gate_is_added_once_beside_other_gates() -> None:
    pod = {"spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}}
    gated = jsonpatch.apply_patch(pod, gate_patch(pod["spec"]))
    assert gated["spec"]["schedulingGates"] == [
        {"name": "kueue.x-k8s.io/admission"},
        {"name": GATE},
    ]
    assert is_gated(gated) and not is_gated(pod)
    assert gate_patch(gated["spec"]) == []
    bare: dict[str, Any] = {"spec": {}}
    assert jsonpatch.apply_patch(bare, gate_patch(bare["spec"]))["spec"]["schedulingGates"] == [
        {"name": GATE}
    ]


def test_ungating_removes_epguards_gate_only() -> None:
    pod = {"spec": {"schedulingGates": [{"name": "a"}, {"name": GATE}, {"name": "b"}]}}
    out = jsonpatch.apply_patch(pod, ungate_patch(pod))
    assert out["spec"]["schedulingGates"] == [{"name": "a"}, {"name": "b"}]
    assert ungate_patch(out) == []
    assert ungate_patch({"spec": {"schedulingGates": "not a list"}}) == []


def test_ungating_fails_on_another_pod_under_the_same_name() -> None:
    listed = {"metadata": {"uid": "u-1"}, "spec": {"schedulingGates": [{"name": GATE}]}}
    patch = ungate_patch(listed)
    made_again = {"metadata": {"uid": "u-2"}, "spec": {"schedulingGates": [{"name": GATE}]}}
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(made_again, patch)
    assert jsonpatch.apply_patch(listed, patch)["spec"]["schedulingGates"] == []


def test_ungating_fails_rather_than_remove_a_gate_that_moved() -> None:
    pod = {"spec": {"schedulingGates": [{"name": "a"}, {"name": GATE}]}}
    patch = ungate_patch(pod)
    moved = {"spec": {"schedulingGates": [{"name": GATE}, {"name": "a"}]}}
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(moved, patch)


@pytest.mark.parametrize(
    ("value", "mode"),
    [("gate", "gate"), ("off", "off"), (" Gate ", "gate"), ("on", None), ("", None), (3, None)],
)
def test_a_namespace_says_gate_or_off_or_nothing(value: object, mode: str | None) -> None:
    assert settings_from_labels({PREFLIGHT_KEY: value}).preflight == mode
    index = NamespaceIndex()
    index.upsert("team", {PREFLIGHT_KEY: value})
    assert index.get("team").preflight == mode
    assert len(index) == (mode is not None)


def preflight(spec: dict[str, Any] | None = None, **settings: Any) -> dict[str, Any]:
    spec = worker_spec() if spec is None else spec
    pod = preflight_pod(
        "team-a",
        spec,
        key_of("team-a", spec, IMAGE),
        PreflightSettings(SETTINGS.injection, 300, **settings),
    )
    assert pod is not None
    return pod


def test_the_preflight_judges_files_with_the_workers_pull_and_placement() -> None:
    spec = worker_spec()
    pod = preflight(spec)
    p = pod["spec"]
    assert pod["metadata"]["name"] == key_of("team-a", spec, IMAGE).pod_name
    assert pod["metadata"]["labels"][PROBED_LABEL] == "true"
    assert pod["metadata"]["labels"][KEY_LABEL] == key_of("team-a", spec, IMAGE).hash
    assert p["restartPolicy"] == "Never" and p["activeDeadlineSeconds"] == 300
    assert p["serviceAccountName"] == "sglang"
    assert p["imagePullSecrets"] == [{"name": "a"}, {"name": "b"}]
    for field in ("nodeSelector", "tolerations", "affinity"):
        assert p[field] == spec[field]
    assert [c["name"] for c in p["initContainers"]] == [COPY_CONTAINER, PROBE_CONTAINER]
    probe = p["initContainers"][1]
    assert probe["image"] == IMAGE
    cmd = probe["command"]
    assert "--files-only" in cmd and "--level" not in cmd
    assert cmd[cmd.index("--") + 1 :] == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/m",
        "--elastic-ep-backend",
        "mooncake",
    ]


@pytest.mark.parametrize(
    ("worker", "preflight_pulls"),
    [(None, "Always"), ("IfNotPresent", "Always"), ("Always", "Always"), ("Never", "Never")],
)
def test_the_preflight_pulls_the_tag_as_the_registry_has_it_now(
    worker: str | None, preflight_pulls: str
) -> None:
    """A verdict is learned under a tag only from a pull that resolved it: a node's old
    copy of the tag is not what the tag names now. A worker that never pulls only ever
    runs what its node holds, and so does its preflight; an image pinned by digest has
    no tag to resolve, and keeps the worker's policy (a node that cannot reach the
    registry still judges what it holds)."""
    spec = worker_spec()
    if worker is not None:
        spec["containers"][0]["imagePullPolicy"] = worker
    probe = preflight(spec)["spec"]["initContainers"][1]
    assert probe["imagePullPolicy"] == preflight_pulls
    pinned = IMAGE.split(":")[0] + "@sha256:" + "ab" * 32
    spec["containers"][0]["image"] = pinned
    pod = preflight_pod("team-a", spec, key_of("team-a", spec, pinned), SETTINGS)
    assert pod is not None
    assert pod["spec"]["initContainers"][1].get("imagePullPolicy", None) == worker
    assert worker is not None or "imagePullPolicy" not in pod["spec"]["initContainers"][1]


def test_the_preflight_mounts_none_of_the_workers_volumes_and_holds_no_gpu() -> None:
    p = preflight()["spec"]
    assert [v["name"] for v in p["volumes"]] == ["epguard-probe"]
    for c in p["initContainers"] + p["containers"]:
        assert {m["name"] for m in c.get("volumeMounts", [])} <= {"epguard-probe"}
        for part in c.get("resources", {}).values():
            assert set(part) <= {"cpu", "memory"}, c["name"]
    assert p["automountServiceAccountToken"] is False


def test_with_the_image_as_its_probe_volume_the_preflight_runs_one_init_container() -> None:
    """preflight.probeVolume: image -- the epguard image mounted read-only as the probe's
    volume, the probe run from the image's own directory under it: no copy container,
    the rest as with copy (a signed, verifiable preflight of the same worker)."""
    copied = preflight()["spec"]
    pod = preflight(probe_volume="image")
    p = pod["spec"]
    assert [c["name"] for c in p["initContainers"]] == [PROBE_CONTAINER]
    assert p["volumes"] == [
        {
            "name": "epguard-probe",
            "image": {"reference": "registry.example/epguard:1", "pullPolicy": "IfNotPresent"},
        }
    ]
    probe, before = p["initContainers"][0], copied["initContainers"][1]
    assert probe["command"][2] == "/epguard/opt/epguard/probe"
    assert before["command"][2] == "/epguard/probe"
    assert {**probe, "command": before["command"]} == before
    assert probe["volumeMounts"] == [
        {"name": "epguard-probe", "mountPath": "/epguard", "readOnly": True}
    ]
    assert p["containers"] == copied["containers"]
    assert shaped_as_preflight(pod)
    ring = new_keyring(dt.datetime.now(dt.UTC))
    made = signed(pod, ring.keys[0], dt.datetime.now(dt.UTC))
    assert exposure(made) is None and verify(ring, "team-a", made).ok
    tampered = copy.deepcopy(made)
    tampered["spec"]["volumes"][0]["image"]["reference"] = "attacker/epguard:1"
    assert not verify(ring, "team-a", tampered).ok


def test_with_the_image_as_its_probe_volume_the_workers_own_words_are_kept() -> None:
    # Only the probe's path moves: a worker argument that names the same path is the
    # worker's, and the probe must read it as the worker wrote it (found by a review
    # helper: every word equal to the path was rewritten).
    spec = worker_spec()
    spec["containers"][0]["args"] += ["--config", "/epguard/probe"]
    (probe,) = preflight(spec, probe_volume="image")["spec"]["initContainers"]
    cmd = probe["command"]
    assert cmd[2] == "/epguard/opt/epguard/probe"
    assert cmd[cmd.index("--") + 1 :][-2:] == ["--config", "/epguard/probe"]


def test_a_preflight_may_ask_for_the_workers_gpus() -> None:
    probe = preflight(gpus="worker")["spec"]["initContainers"][1]
    assert probe["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_no_preflight_when_no_container_on_the_image_asks_for_mooncake() -> None:
    spec = worker_spec()
    spec["containers"][0]["args"] = ["--model-path", "/models/m"]
    assert preflight_pod("t", spec, key_of("t", spec, IMAGE), SETTINGS) is None
    assert preflight_pod("t", spec, key_of("t", spec, "busybox"), SETTINGS) is None


def test_the_preflight_probes_the_worker_that_asks_for_mooncake_on_its_line() -> None:
    """A container of the same image whose flag's value admission cannot see is probed in
    the pod, never by the preflight: its probe, without the pod's variables, would find
    nothing to judge and let the gated pods go unjudged."""
    spec = worker_spec()
    settled = spec["containers"][0]
    unseen = {
        **settled,
        "name": "sidecar",
        "args": ["--model-path", "/m", "--elastic-ep-backend", "$(EP)"],
        "env": [{"name": "EP", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "ep"}}}],
    }
    spec["containers"] = [unseen, settled]
    probe = preflight(spec)["spec"]["initContainers"][1]
    cmd = probe["command"]
    assert cmd[cmd.index("--") + 1 :] == [*settled.get("command", []), *settled["args"]]
    spec["containers"] = [unseen]  # nothing the preflight could judge
    assert preflight_pod("t", spec, key_of("t", spec, IMAGE), SETTINGS) is None


def test_two_workers_on_one_image_make_a_preflight_built_as_one() -> None:
    """Planned together, their probes were named epguard-probe-<worker>: the chart's policy
    refused that preflight, and the controller did not take it for its own (found by a
    review helper)."""
    spec = worker_spec()
    first = spec["containers"][0]
    spec["containers"] = [first, {**first, "name": "second"}]
    pod = preflight(spec)
    names = [c["name"] for c in pod["spec"]["initContainers"]]
    assert names == [COPY_CONTAINER, PROBE_CONTAINER]
    assert shaped_as_preflight(pod)


def test_a_signed_preflight_verifies_and_exposes_nothing() -> None:
    ring = new_keyring(dt.datetime.now(dt.UTC))
    pod = signed(preflight(), ring.keys[0], dt.datetime.now(dt.UTC))
    assert exposure(pod) is None
    assert verify(ring, "team-a", pod).ok
    assert not verify(ring, "team-b", pod).ok  # bound to its namespace
    tampered = copy.deepcopy(pod)
    tampered["spec"]["initContainers"][1]["image"] = "attacker/other:1"
    assert not verify(ring, "team-a", tampered).ok


@pytest.mark.parametrize("stamp", ["\u00b2", "\u0663", "\uff11", "12\u00b2", "", "-1", " 1"])
def test_a_signature_whose_time_is_not_ascii_digits_is_malformed(stamp: str) -> None:
    # str.isdigit() is true of "²" (int() refuses it) and of Arabic-Indic and full-width
    # digits: a tenant's forged preflight with one made every gatekeeper pass raise.
    ring = new_keyring(dt.datetime.now(dt.UTC))
    pod = signed(preflight(), ring.keys[0], dt.datetime.now(dt.UTC))
    _, key_id, _, mac = pod["metadata"]["annotations"][SIGNATURE_ANNOTATION].split(":")
    pod["metadata"]["annotations"][SIGNATURE_ANNOTATION] = f"{FORMAT}:{key_id}:{stamp}:{mac}"
    checked = verify(ring, "team-a", pod)
    assert not checked.ok and "malformed" in checked.reason


def _pod_templates() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for m in realmanifests.manifests():
        if not m.requests_mooncake:
            continue
        for doc in m.documents:
            for spec in _pod_specs(doc):
                out.append((m.file, spec))
    return out


def _pod_specs(node: Any) -> list[dict[str, Any]]:
    """Every mapping under ``node`` that holds a ``containers`` list: the pod specs of
    any kind, without knowing its paths."""
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            found.append(node)
        for value in node.values():
            found.extend(_pod_specs(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(_pod_specs(value))
    return found


def test_every_real_mooncake_worker_gets_a_valid_preflight() -> None:
    """Public manifests: each pod spec with a mooncake container gives a preflight pod
    the Kubernetes 1.35 schema accepts, with the worker's argv after ``--``."""
    from kubernetes_validate import utils as kv  # type: ignore[import-untyped]

    realmanifests.require()
    assert VERSION in kv.all_versions()
    built = 0
    for file, spec in _pod_templates():
        for c in spec["containers"]:
            if not isinstance(c, dict) or not isinstance(c.get("image"), str):
                continue
            for settings in (SETTINGS, replace(SETTINGS, probe_volume="image")):
                pod = preflight_pod("ns", spec, key_of("ns", spec, c["image"]), settings)
                if pod is None:
                    continue
                built += 1
                try:
                    kv.validate(yaml.safe_load(yaml.safe_dump(pod)), VERSION, strict=True)
                except kv.ValidationError as e:
                    pytest.fail(f"{file} ({settings.probe_volume}): {e}")
    assert built >= 5


NOW = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.UTC)
BAD = (
    "epguard: mooncake elastic EP is unusable in this image: torch 2.13.0 has no "
    "mooncake backend\nscope: image (the image's files)\nfix: rebuild the image"
)


def status_pod(*inits: dict[str, Any], age: int = 10, **status: Any) -> dict[str, Any]:
    created = (NOW - dt.timedelta(seconds=age)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "metadata": {"creationTimestamp": created},
        "status": {"phase": "Pending", "initContainerStatuses": list(inits), **status},
    }


def terminated(code: int, message: str = "", name: str = PROBE_CONTAINER) -> dict[str, Any]:
    return {
        "name": name,
        "state": {
            "terminated": {
                "exitCode": code,
                "message": message,
                "reason": "Error" if code else "Completed",
            }
        },
    }


def waiting(reason: str, message: str = "", name: str = PROBE_CONTAINER) -> dict[str, Any]:
    return {"name": name, "state": {"waiting": {"reason": reason, "message": message}}}


def test_an_image_cause_keeps_the_gate_with_the_probes_first_line() -> None:
    r = preflight_result(
        status_pod(terminated(0, name=COPY_CONTAINER), terminated(1, BAD)), NOW, 300
    )
    assert r.phase == "unusable"
    assert r.message == BAD.splitlines()[0]


def test_nothing_proven_clears_the_gate() -> None:
    clear = "epguard: no image cause in this image's files: left for the GPU node: the driver"
    r = preflight_result(status_pod(terminated(0, clear)), NOW, 300)
    assert r.phase == "clear" and r.message == clear


@pytest.mark.parametrize(
    "message",
    [
        "epguard: mooncake elastic EP is unusable in this pod: no NVIDIA driver",
        "epguard: probe internal error: KeyError: 'x'",
        "",
        BAD.replace("scope: image", "scope: environment"),  # contradicts itself
    ],
)
def test_a_failure_that_is_not_an_image_cause_cannot_judge(message: str) -> None:
    r = preflight_result(status_pod(terminated(1, message)), NOW, 300)
    assert r.phase == "failed"
    assert "exit code 1" in r.message


def test_a_probe_that_cannot_start_cannot_judge() -> None:
    # No python3 in the image: the runtime fails the exec (exit 127/128, no message).
    r = preflight_result(status_pod(terminated(128, "")), NOW, 300)
    assert r.phase == "failed" and "exit code 128" in r.message and "Error" in r.message


def test_a_pull_error_is_waited_on_until_the_deadline() -> None:
    pull = waiting("ErrImagePull", "pull access denied for x")
    running = preflight_result(status_pod(pull, age=10), NOW, 300)
    assert running.phase == "running"
    assert running.stalled == (
        f"container {PROBE_CONTAINER} is waiting: ErrImagePull: pull access denied for x"
    )
    late = preflight_result(status_pod(pull, age=301), NOW, 300)
    assert late.phase == "failed"
    assert "did not finish within 300 s" in late.message and "ErrImagePull" in late.message


def test_an_unschedulable_preflight_fails_at_the_deadline_counted_from_creation() -> None:
    unscheduled = {
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/1 nodes",
            }
        ]
    }
    assert preflight_result(status_pod(age=5, **unscheduled), NOW, 300).stalled == (
        "not scheduled: Unschedulable 0/1 nodes"
    )
    late = preflight_result(status_pod(age=400, **unscheduled), NOW, 300)
    assert late.phase == "failed" and "Unschedulable" in late.message


def test_the_kubelets_deadline_fails_the_preflight() -> None:
    pod = status_pod(
        waiting("PodInitializing"),
        phase="Failed",
        reason="DeadlineExceeded",
        message="Pod was active on the node longer than the specified deadline",
    )
    r = preflight_result(pod, NOW, 300)
    assert r.phase == "failed" and "DeadlineExceeded" in r.message


def test_a_starting_preflight_is_running_and_not_stalled() -> None:
    r = preflight_result(status_pod(waiting("PodInitializing")), NOW, 300)
    assert r == PreflightResult("running", "", "")
    assert preflight_result({"status": "junk", "metadata": []}, NOW, 300).phase == "running"


def test_a_huge_message_is_cut_for_the_pod_condition() -> None:
    r = preflight_result(status_pod(terminated(1, "x" * 100_000)), NOW, 300)
    assert r.phase == "failed" and len(r.message) <= 1024


_UNSCHEDULED = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/1 nodes"}  # fmt: skip
_STATUSES = [
    status_pod(terminated(0, name=COPY_CONTAINER), terminated(1, BAD)),
    status_pod(terminated(0, "epguard: no image cause in this image's files: left for the GPU")),
    status_pod(terminated(1, "epguard: probe internal error: KeyError: 'x'")),
    status_pod(terminated(128, "")),
    status_pod(waiting("ErrImagePull", "pull access denied for x"), age=10),
    status_pod(waiting("ErrImagePull", "pull access denied for x"), age=301),
    status_pod(age=5, conditions=[_UNSCHEDULED]),
    status_pod(age=400, conditions=[_UNSCHEDULED]),
    status_pod(waiting("PodInitializing"), phase="Failed", reason="DeadlineExceeded",
               message="Pod was active on the node longer than the specified deadline"),
    status_pod(phase="Failed", reason="Evicted", message="The node was low on ephemeral-storage."),
    status_pod(conditions=[{"type": "DisruptionTarget", "status": "True",
                            "reason": "PreemptionByScheduler"}]),
    status_pod(terminated(1, BAD + "\n" + "x" * 3000)),
]  # fmt: skip


@pytest.mark.parametrize("pod", _STATUSES)
def test_what_is_kept_of_a_preflights_status_says_what_the_whole_status_says(
    pod: dict[str, Any],
) -> None:
    """The controller keeps only preflight_status of each preflight it lists (the whole
    status of a retained preflight was ~38 KB: review helper); every reading of it
    must be the same."""
    slim = {"metadata": pod["metadata"], "status": preflight_status(pod)}
    assert preflight_result(slim, NOW, 300) == preflight_result(pod, NOW, 300)
    assert disruption(slim) == disruption(pod)
    ends = [c["state"].get("terminated", {}).get("finishedAt")
            for c in slim["status"].get("initContainerStatuses", [])]  # fmt: skip
    assert ends == [c["state"].get("terminated", {}).get("finishedAt")
                    for c in pod["status"].get("initContainerStatuses", [])]  # fmt: skip


def test_what_is_kept_of_a_bloated_preflight_status_is_small() -> None:
    ref = "registry.example/" + "a" * 4000 + ":v1"
    pod = status_pod(
        *[{**terminated(0, "m" * 100_000, name=f"c{i}"), "image": ref, "imageID": ref}
          for i in range(500)],
        conditions=[{**_UNSCHEDULED, "message": "n" * 100_000} for _ in range(500)],
        containerStatuses=[{**waiting("ErrImagePull", "p" * 100_000), "image": ref}] * 500,
        message="s" * 100_000,
        podIPs=[{"ip": "10.0.0.1"}] * 1000,
    )  # fmt: skip
    kept = json.dumps(preflight_status(pod))
    assert len(kept) < 40_000, len(kept)
    assert ref not in kept


def _verdict(image: str, usable: bool, seen: dt.datetime, digest: str | None = None) -> Verdict:
    return Verdict(
        object_name=f"v-{image}-{digest}",
        image=image,
        ref=parse_ref(image),
        digest=digest,
        usable=usable,
        reason="x",
        last_seen=seen,
        pod=None,
    )


def test_only_a_usable_verdict_by_pinned_digest_or_fresh_tag_clears_an_image() -> None:
    digest = "sha256:" + "ab" * 32
    store = VerdictStore(tag_ttl=dt.timedelta(hours=24))
    store.upsert(_verdict("r.example/good:1", True, NOW - dt.timedelta(hours=1)), NOW)
    store.upsert(_verdict("r.example/old:1", True, NOW - dt.timedelta(hours=30)), NOW)
    store.upsert(_verdict("r.example/bad:1", False, NOW - dt.timedelta(hours=1)), NOW)
    store.upsert(_verdict("r.example/pinned:1", True, NOW - dt.timedelta(days=9), digest), NOW)
    images = [
        "r.example/good:1",  # a fresh tag verdict: judged
        "r.example/old:1",  # the tag's verdict is older than the TTL: the tag may have moved
        "r.example/bad:1",  # /validate refuses it; gated too, should a replica admit it
        f"r.example/pinned:2@{digest}",  # the digest's verdict, however old
        "r.example/new:1",  # never seen
        "UPPER/Case:!",  # does not parse: its pull fails, nothing to judge
    ]
    assert unjudged(images, store, NOW) == ("r.example/old:1", "r.example/bad:1", "r.example/new:1")


def test_the_preflight_runs_as_the_worker_but_without_its_privileges() -> None:
    spec = worker_spec(
        securityContext={
            "runAsUser": 1000,
            "fsGroup": 2000,
            "seccompProfile": {"type": "Localhost", "localhostProfile": "tenant.json"},
            "sysctls": [{"name": "net.core.somaxconn", "value": "1024"}],
        }
    )
    spec["containers"][0]["securityContext"] = {
        "runAsUser": 0,
        "privileged": True,
        "capabilities": {"add": ["SYS_ADMIN"]},
    }
    p = preflight(spec)["spec"]
    assert p["securityContext"] == {
        "runAsUser": 1000,
        "fsGroup": 2000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    probe = p["initContainers"][1]
    assert probe["securityContext"] == {
        "runAsUser": 0,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def test_the_preflight_runs_in_a_user_namespace_where_the_worker_does() -> None:
    """The worker's runAsUser 0 inside its user namespace was the preflight's root on the
    node (review helper)."""
    ring = new_keyring(NOW)
    for host_users, expected in ((False, False), (True, None), (None, None)):
        spec = worker_spec(securityContext={"runAsUser": 0})
        if host_users is not None:
            spec["hostUsers"] = host_users
        pod = preflight(spec)
        assert pod["spec"].get("hostUsers") is expected
        assert pod["spec"]["securityContext"]["runAsUser"] == 0
        made = signed(pod, ring.current, NOW)
        assert verify(ring, "team-a", made).ok


def test_the_preflight_carries_no_env_and_sets_every_limit() -> None:
    # The worker's env names a Secret; --files-only needs none of it.
    p = preflight()["spec"]
    for c in p["initContainers"] + p["containers"]:
        assert "env" not in c and "envFrom" not in c, c["name"]
        assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]


def test_the_preflight_reads_a_flag_value_from_the_workers_literal_env() -> None:
    # Admission gated `--elastic-ep-backend $(EP)` with EP=mooncake; the preflight's probe
    # got no env, read "$(EPGUARD_POD_EP)", said "not requested" and the pods were
    # released as judged. It gets the literal values, never a Secret's.
    from epguard.probe import cmdline

    spec = worker_spec()
    worker = spec["containers"][0]
    worker["args"] = ["--model-path", "/m", "--elastic-ep-backend", "$(EP)"]
    worker["env"] = [*worker["env"], {"name": "EP", "value": "mooncake"}]
    pod = preflight_pod("team-a", spec, key_of("team-a", spec, IMAGE),
                        PreflightSettings(InjectionSettings("r.example/epguard:1")))  # fmt: skip
    assert pod is not None
    probe = pod["spec"]["initContainers"][1]
    assert probe["env"] == [{"name": "EPGUARD_POD_EP", "value": "mooncake"}]
    # A value the argv does not name is not copied (a 1 MB config would make the
    # preflight too large to create).
    worker["env"] = [*worker["env"], {"name": "BIG_CONFIG", "value": "x" * 1_000_000}]
    again = preflight_pod("team-a", spec, key_of("team-a", spec, IMAGE),
                          PreflightSettings(InjectionSettings("r.example/epguard:1")))  # fmt: skip
    assert again is not None
    assert again["spec"]["initContainers"][1]["env"] == probe["env"]
    argv = probe["command"][probe["command"].index("--") + 1 :]
    expanded = [a.replace("$(EPGUARD_POD_EP)", "mooncake") for a in argv]  # the kubelet's
    assert cmdline.read(expanded).requested


def _probe_env(args: list[str], env: list[dict[str, str]]) -> list[Any]:
    spec = worker_spec()
    spec["containers"][0]["args"] = args
    spec["containers"][0]["env"] = env
    pod = preflight_pod("team-a", spec, key_of("team-a", spec, IMAGE),
                        PreflightSettings(InjectionSettings("r.example/epguard:1")))  # fmt: skip
    assert pod is not None
    return list(pod["spec"]["initContainers"][1].get("env", []))


def test_the_preflight_follows_every_literal_value_the_flag_is_read_from() -> None:
    flag = ["--model-path", "/Models/m", "--elastic-ep-backend"]
    # An entry stored without its empty value is "" (admission read moon$(E)cake so).
    assert _probe_env([*flag, "moon$(E)cake"], [{"name": "E"}]) == [{"name": "EPGUARD_POD_E"}]
    # A chain of any length: A names B names C.
    chain = [{"name": "C", "value": "mooncake"}, {"name": "B", "value": "$(C)"},
             {"name": "A", "value": "$(B)"}]  # fmt: skip
    assert [e["name"] for e in _probe_env([*flag, "$(A)"], chain)] == [
        "EPGUARD_POD_C", "EPGUARD_POD_B", "EPGUARD_POD_A"]  # fmt: skip
    # Names, not substrings: M is in /Models, MODEL in MODEL_PATH; neither is named.
    big = [{"name": "M", "value": "x" * 500_000}, {"name": "MODEL", "value": "y" * 500_000},
           {"name": "EP", "value": "mooncake"}]  # fmt: skip
    assert [e["name"] for e in _probe_env([*flag, "$(EP)", "--x", "$MODEL_PATH"], big)] == [
        "EPGUARD_POD_EP"]  # fmt: skip
    # A name given twice: the last wins in the worker, so both are kept, in order.
    twice = [{"name": "EP", "value": "none"}, {"name": "EP", "value": "mooncake"}]
    script = "exec python3 -m sglang.launch_server --elastic-ep-backend $EP"
    for args in ([*flag, "$(EP)"], ["sh", "-c", script]):
        kept = _probe_env(args, twice)
        assert [e["value"] for e in kept] == ["none", "mooncake"], args
    # Any character the kubelet allows in a name: $(ep.backend), and $(EP-B) is not EP.
    dotted = [{"name": "EP", "value": "none"}, {"name": "ep.backend", "value": "mooncake"},
              {"name": "EP-B", "value": "mooncake"}]  # fmt: skip
    assert [e["name"] for e in _probe_env([*flag, "$(ep.backend)"], dotted)] == [
        "EPGUARD_POD_ep.backend"]  # fmt: skip
    assert [e["name"] for e in _probe_env([*flag, "$(EP-B)"], dotted)] == ["EPGUARD_POD_EP-B"]
    # 20,000 names, each named: one pass over each text (a scan per name took ~20 s).
    many = [{"name": f"V{i}", "value": "v"} for i in range(20_000)]
    refs = " ".join(f"$V{i}" for i in range(20_000))
    line = f"echo {refs}; exec python3 -m sglang.launch_server --elastic-ep-backend mooncake"
    assert len(_probe_env(["sh", "-c", line], many)) == 20_000


def test_a_mesh_is_asked_not_to_inject_into_a_preflight() -> None:
    annotations = preflight()["metadata"]["annotations"]
    assert annotations["sidecar.istio.io/inject"] == "false"
    assert annotations["linkerd.io/inject"] == "disabled"


@pytest.mark.parametrize(
    ("status", "stopped"),
    [
        ({"phase": "Failed", "reason": "Evicted", "message": "low on ephemeral-storage"}, True),
        ({"phase": "Failed", "reason": "OutOfcpu"}, True),
        ({"phase": "Running", "conditions": [{"type": "DisruptionTarget", "status": "True",
          "reason": "PreemptionByScheduler"}]}, True),
        ({"phase": "Failed"}, False),  # the probe's own exit (an image cause, OOMKilled)
        ({"phase": "Failed", "reason": "DeadlineExceeded"}, False),  # the preflight's deadline
        ({"phase": "Failed", "conditions": [{"type": "DisruptionTarget", "status": "False"}]},
         False),
        ({"phase": "Succeeded", "reason": "Evicted"}, False),
    ],
)  # fmt: skip
def test_a_preflight_stopped_by_the_cluster_is_told_from_one_that_failed(
    status: dict[str, Any], stopped: bool
) -> None:
    assert bool(disruption({"status": status})) is stopped
