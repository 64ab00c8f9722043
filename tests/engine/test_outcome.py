"""Reading probe outcomes back from pod status (what the controller records)."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest

from epguard.probe.message import FILES_CLEAR, NOTHING, UNUSABLE, UNUSABLE_HERE, USABLE_HERE
from epguard.probe.message import USABLE as PROBE_USABLE
from epguard.webhook.engine.outcome import (
    MAX_RUNS,
    ProbeOutcome,
    classify,
    digest_for,
    digest_of,
    outcomes_of,
    parse_versions,
    recorded_runs,
    resolved_tags,
    run_key,
    verdict_spec,
)
from epguard.webhook.engine.verdicts import SOURCE_SCAN, verdict_name
from tests.probe import hostile_roots
from tests.probe.probe_pods import pod_with_probe_status, run_real_probe

# What the probe writes when mooncake imports and both backends register. It cannot be
# produced on a machine without libcuda.so.1; the GPU test of the probe checks the
# real first line has this prefix.
USABLE = (
    "epguard: mooncake elastic EP is usable: mooncake.pg imports after torch\n"
    "versions: torch=2.13.0+cu130 sglang=0.5.18 mooncake-transfer-engine-cuda13=0.3.13.post1\n"
    "fix: nothing to fix"
)


def test_real_probe_failure_is_an_unusable_outcome(real_probe_failure: tuple[int, str]) -> None:
    code, message = real_probe_failure
    assert code == 1
    [outcome] = outcomes_of(pod_with_probe_status(message, code))
    assert outcome.verdict == "Unusable"
    first = message.splitlines()[0]
    assert first.startswith("epguard: mooncake elastic EP is unusable in this image: ")
    assert first.endswith(": " + outcome.reason)
    assert outcome.reason and not outcome.reason.startswith("epguard:")
    assert outcome.digest == "sha256:" + "ab" * 32
    assert outcome.image == "docker.io/lmsysorg/sglang:v0.5.18-cu130"
    assert outcome.versions.mooncake == "none"


@pytest.mark.parametrize("policy", ["IfNotPresent", "Never", ""])
def test_a_tag_is_learned_only_from_a_pull_that_resolved_it(
    real_probe_failure: tuple[int, str], policy: str
) -> None:
    """With IfNotPresent (or Never) the probe ran whatever its node held under the tag,
    maybe a build the tag has moved away from: the verdict answers for the digest only,
    so it never refuses (or clears) other pods on the tag's new bytes."""
    code, message = real_probe_failure
    digest = "sha256:" + "ab" * 32
    [stale] = outcomes_of(pod_with_probe_status(message, code, pull_policy=policy))
    assert stale.image == "docker.io/lmsysorg/sglang:v0.5.18-cu130"  # as the pod named it
    assert stale.verdict_image == "docker.io/lmsysorg/sglang@" + digest
    assert verdict_name(stale.verdict_image, stale.digest) == "sha256-" + "ab" * 32
    spec = verdict_spec(stale, "llm/worker-0", dt.datetime(2026, 12, 1, tzinfo=dt.UTC), None)
    assert spec["image"] == "docker.io/lmsysorg/sglang@" + digest
    [resolved] = outcomes_of(pod_with_probe_status(message, code, pull_policy="Always"))
    assert resolved.verdict_image == resolved.image
    # Pulled with Always under a host spelling the runtime keeps as a registry of its own
    # (its own mirror, maybe other bytes under the tag): its digest alone.
    for alias in ("registry-1.docker.io", "DOCKER.IO", "docker.io:443"):
        image = f"{alias}/lmsysorg/sglang:v0.5.18-cu130"
        [other] = outcomes_of(
            pod_with_probe_status(message, code, image=image, pull_policy="Always")
        )
        assert other.verdict_image == "docker.io/lmsysorg/sglang@" + digest, alias
    assert verdict_name(resolved.verdict_image, digest).startswith("sha256-" + "ab" * 32 + "-")
    # A reference that pins its digest is about those bytes whatever the pull.
    pinned = "docker.io/lmsysorg/sglang:v0.5.18-cu130@" + digest
    [by_digest] = outcomes_of(
        pod_with_probe_status(message, code, image=pinned, pull_policy="IfNotPresent")
    )
    assert by_digest.verdict_image == pinned


@pytest.mark.parametrize(
    ("image", "policy", "resolved"),
    [
        (
            "docker.io/lmsysorg/sglang:v1",
            "Always",
            [("docker.io/lmsysorg/sglang:v1", "sha256:" + "ab" * 32)],
        ),
        ("docker.io/lmsysorg/sglang:v1", "IfNotPresent", []),
        ("docker.io/lmsysorg/sglang:v1@sha256:" + "ab" * 32, "Always", []),
        # The one spelling the runtime folds itself: the same registry to it.
        (
            "index.docker.io/lmsysorg/sglang:v1",
            "Always",
            [("docker.io/lmsysorg/sglang:v1", "sha256:" + "ab" * 32)],
        ),
        # Hosts of their own to the runtime (their own mirrors: review helper).
        ("registry-1.docker.io/lmsysorg/sglang:v1", "Always", []),
        ("Docker.io/lmsysorg/sglang:v1", "Always", []),
        ("docker.io:443/lmsysorg/sglang:v1", "Always", []),
    ],
)
def test_a_pull_with_always_tells_what_its_tag_named(
    image: str, policy: str, resolved: list[tuple[str, str]]
) -> None:
    """Whatever the probe said (a preflight's files-only pass teaches no verdict)."""
    pod = pod_with_probe_status(FILES_CLEAR + "x", 0, image=image, pull_policy=policy)
    started = dt.datetime(2026, 11, 30, 20, 0, tzinfo=dt.UTC)  # the kubelet's startedAt
    assert [(r.tag, r.digest, r.started_at) for r in resolved_tags(pod)] == [
        (*r, started) for r in resolved
    ]
    assert resolved_tags(pod, probe_image="another:probe") == []
    for section in pod["status"]["initContainerStatuses"]:
        del section["state"]["terminated"]["startedAt"]
    assert resolved_tags(pod) == []  # no time from the kubelet: nothing to date it by


def test_crash_loop_outcome_is_read_from_last_state(real_probe_failure: tuple[int, str]) -> None:
    code, message = real_probe_failure
    pod = pod_with_probe_status(message, code, section="lastState", restart_count=3)
    [outcome] = outcomes_of(pod)
    assert outcome.verdict == "Unusable"
    assert outcome.restart_count == 2


def test_a_run_in_last_state_is_not_paired_with_the_next_runs_image(
    real_probe_failure: tuple[int, str],
) -> None:
    """Once the next run starts, imageID is its own: a tag moved between the runs
    would name the old run's failure after the new bytes (found by a review helper)."""
    code, message = real_probe_failure
    waiting = pod_with_probe_status(message, code, section="lastState", restart_count=3)
    again = pod_with_probe_status(message, code, section="running again", restart_count=3)
    assert len(outcomes_of(waiting)) == 1 and outcomes_of(again) == []
    # The tag's resolution is dated by the run imageID describes: the new one's start.
    [resolved] = resolved_tags(again)
    assert resolved.started_at == dt.datetime(2026, 11, 30, 20, 0, 7, tzinfo=dt.UTC)
    [resolved] = resolved_tags(waiting)
    assert resolved.started_at == dt.datetime(2026, 11, 30, 20, 0, 0, tzinfo=dt.UTC)
    # The next run created, not started yet: nothing dates its imageID.
    again["status"]["initContainerStatuses"][0]["state"] = {"waiting": {"reason": "Created"}}
    assert resolved_tags(again) == []


def test_usable_message_with_exit_zero_is_a_usable_outcome() -> None:
    [outcome] = outcomes_of(pod_with_probe_status(USABLE, 0))
    assert outcome.verdict == "Usable"
    assert outcome.versions.torch == "2.13.0+cu130"
    assert outcome.versions.sglang == "0.5.18"
    assert outcome.versions.mooncake == "mooncake-transfer-engine-cuda13 0.3.13.post1"


def test_oom_kill_is_no_evidence_about_the_image(real_probe_failure: tuple[int, str]) -> None:
    _, message = real_probe_failure
    assert outcomes_of(pod_with_probe_status(message, 137)) == []


def test_nothing_to_check_is_no_evidence(tmp_path: Path) -> None:
    code, message = run_real_probe(tmp_path, ["python3", "-m", "sglang.launch_server"])
    assert code == 0
    assert classify(message, code) is None
    assert outcomes_of(pod_with_probe_status(message, code)) == []


def test_pods_without_status_or_with_garbage_yield_nothing() -> None:
    assert outcomes_of({}) == []
    assert outcomes_of({"status": {"initContainerStatuses": [None, 3, {"name": 5}]}}) == []
    pod = pod_with_probe_status("epguard: mooncake elastic EP is unusable in this image: x", 1)
    pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] = "1"
    assert outcomes_of(pod) == []


def test_digest_is_taken_from_every_image_id_spelling() -> None:
    digest = "sha256:" + "0f" * 32
    assert digest_of(f"docker.io/lmsysorg/sglang@{digest}") == digest
    assert digest_of(f"docker-pullable://lmsysorg/sglang@{digest}") == digest
    assert digest_of("") is None
    assert digest_of(None) is None


def test_a_digest_reported_under_another_repository_is_no_digest_of_the_image(
    real_probe_failure: tuple[int, str],
) -> None:
    """Review helper: containerd reports the alphabetically first repo digest of the image,
    every name its config carries on that node merged: a tenant's re-manifested copy of a
    public image (the same config) under aaa.example made other tenants' probes report
    its digest. Such a run teaches nothing ("no image digest"), nor resolves the tag."""
    digest = "sha256:" + "0f" * 32
    image = "lmsysorg/sglang:v1"
    assert digest_for(image, f"docker.io/lmsysorg/sglang@{digest}") == digest
    assert digest_for(image, f"docker-pullable://lmsysorg/sglang@{digest}") == digest
    assert digest_for(image, f"index.docker.io/lmsysorg/sglang@{digest}") == digest
    assert digest_for(image, digest) == digest  # no repository named
    assert digest_for(image, f"aaa.attacker.example/p@{digest}") is None
    assert digest_for(image, f"docker.io/lmsysorg/other@{digest}") is None
    # A pinned digest is what ran, whatever name the runtime reports it under.
    pinned = "sha256:" + "1e" * 32
    assert digest_for(f"lmsysorg/sglang:v1@{pinned}", f"aaa.attacker.example/p@{digest}") == pinned
    code, message = real_probe_failure
    other = f"aaa.attacker.example/p@{digest}"
    [outcome] = outcomes_of(pod_with_probe_status(message, code, image_id=other))
    assert outcome.digest is None and not outcome.about_the_image
    pod = pod_with_probe_status(FILES_CLEAR + "x", 0, image=image, pull_policy="Always",
                                image_id=other)  # fmt: skip
    assert resolved_tags(pod) == []


def test_verdict_name_is_by_digest_and_shared_by_spellings_of_one_tag() -> None:
    digest = "sha256:" + "ab" * 32
    assert verdict_name("x@" + digest, digest) == "sha256-" + "ab" * 32
    assert verdict_name("x:t@" + digest, digest) == "sha256-" + "ab" * 32
    # By tag: one object per (bytes, tag), shared by the tag's spellings.
    tagged = verdict_name("lmsysorg/sglang:v1", digest)
    assert tagged.startswith("sha256-" + "ab" * 32 + "-") and len(tagged) == 71 + 17
    assert tagged == verdict_name("docker.io/lmsysorg/sglang:v1", digest)
    assert tagged != verdict_name("lmsysorg/sglang:v2", digest)
    assert verdict_name("x", digest) == verdict_name("x:latest", digest) != tagged
    assert verdict_name("lmsysorg/sglang:v1", None) == verdict_name(
        "docker.io/lmsysorg/sglang:v1", None
    )
    assert verdict_name("lmsysorg/sglang:v1", None) != verdict_name("lmsysorg/sglang:v2", None)
    # The scan's own names: never one of the probe's.
    assert verdict_name("x", "sha256:" + "ab" * 32, SOURCE_SCAN) == "scan-sha256-" + "ab" * 32


def _ended(message: str, code: int, at: str) -> ProbeOutcome:
    [outcome] = outcomes_of(pod_with_probe_status(message, code, finished_at=at))
    return outcome


def test_verdict_spec_counts_runs_and_keeps_first_seen() -> None:
    t1 = dt.datetime(2026, 11, 30, 20, 0, 30, tzinfo=dt.UTC)
    first = verdict_spec(_ended(USABLE, 0, "2026-11-30T20:00:07Z"), "llm/worker-0", t1, None)
    assert (first["count"], first["firstSeen"], first["lastSeen"]) == (
        1,
        "2026-11-30T20:00:07Z",
        "2026-11-30T20:00:07Z",
    )
    later = _ended(USABLE, 0, "2026-11-30T21:00:00Z")
    second = verdict_spec(later, "llm/worker-1", t1 + dt.timedelta(hours=1), first)
    assert second["count"] == 2
    assert second["firstSeen"] == "2026-11-30T20:00:07Z"
    assert second["lastSeen"] == "2026-11-30T21:00:00Z"
    assert second["pod"] == "llm/worker-1"


def test_a_run_is_dated_when_it_ended_not_when_it_is_read() -> None:
    """A run read again two days later (a restarted controller, a verdict that remembers
    only its last MAX_RUNS runs) does not renew a tag's 24 h."""
    run = _ended(USABLE, 0, "2026-11-30T20:00:07Z")
    read = dt.datetime(2026, 12, 2, 20, 0, tzinfo=dt.UTC)
    spec = verdict_spec(run, "llm/worker-0", read, None)
    assert (spec["firstSeen"], spec["lastSeen"]) == ("2026-11-30T20:00:07Z",) * 2
    # A node's clock ahead of the controller's: never later than now.
    ahead = verdict_spec(_ended(USABLE, 0, "2026-12-09T00:00:00Z"), "llm/w", read, None)
    assert ahead["lastSeen"] == "2026-12-02T20:00:00Z"


def test_an_older_run_is_counted_and_leaves_the_newer_answer(
    real_probe_failure: tuple[int, str],
) -> None:
    """The old code dated every run when read: an old Unusable run, read again after a
    restart, replaced the newer Usable answer and renewed it for 24 h."""
    code, message = real_probe_failure
    now = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    newer = verdict_spec(_ended(USABLE, 0, "2026-12-01T11:00:00Z"), "llm/new", now, None)
    assert newer["verdict"] == "Usable"
    older = _ended(message, code, "2026-12-01T09:00:00Z")
    assert older.verdict == "Unusable"
    spec = verdict_spec(older, "llm/old", now, newer, run="u-old/epguard-probe/1")
    assert spec["verdict"] == "Usable"
    assert (spec["reason"], spec["report"], spec["versions"]) == (
        newer["reason"],
        newer["report"],
        newer["versions"],
    )
    assert (spec["pod"], spec["lastSeen"]) == ("llm/new", "2026-12-01T11:00:00Z")
    # Counted, remembered, and the first sighting moves back to it.
    assert spec["count"] == 2
    assert spec.get("runs", [])[-1] == "u-old/epguard-probe/1"
    assert spec["firstSeen"] == "2026-12-01T09:00:00Z"
    # The held answer keeps the reference its pod named (a digest's object is shared by
    # every name that pins it).
    named = {**newer, "image": "mirror.example/sglang@sha256:" + "ab" * 32}
    assert verdict_spec(older, "llm/old", now, named)["image"] == named["image"]
    # A held time ahead of the controller's clock keeps nothing (a skewed writer).
    ahead = verdict_spec(older, "llm/old", now, {**newer, "lastSeen": "2026-12-09T00:00:00Z"})
    assert (ahead["verdict"], ahead["lastSeen"]) == ("Unusable", "2026-12-01T09:00:00Z")
    # A newer run than the verdict's replaces its answer, as before.
    again = verdict_spec(_ended(message, code, "2026-12-01T11:30:00Z"), "llm/x", now, spec)
    assert (again["verdict"], again["lastSeen"]) == ("Unusable", "2026-12-01T11:30:00Z")


def test_the_verdict_remembers_the_runs_it_counted_so_none_counts_twice() -> None:
    # The controller may not patch pods: the ImageVerdict itself says which probe
    # terminations it has counted, the last MAX_RUNS of them.
    [outcome] = outcomes_of(pod_with_probe_status(USABLE, 0))
    t = dt.datetime(2026, 11, 30, 20, 0, tzinfo=dt.UTC)
    run = run_key("uid-1", outcome)
    assert run == "uid-1/epguard-probe/2026-11-30T20:00:07Z"
    spec = verdict_spec(outcome, "llm/w", t, None, run)
    assert recorded_runs(spec) == [run]
    again = verdict_spec(outcome, "llm/w", t, spec, run)
    assert again["runs"] == [run]
    many: dict[str, object] = dict(spec)
    for i in range(MAX_RUNS + 5):
        many = dict(verdict_spec(outcome, "llm/w", t, many, f"uid-{i}/x"))
    assert len(recorded_runs(many)) == MAX_RUNS
    assert recorded_runs(many)[-1] == f"uid-{MAX_RUNS + 4}/x"
    assert recorded_runs({"runs": ["ok", 7, None]}) == ["ok"]  # edited by hand: lenient


def test_versions_line_missing_gives_empty_versions() -> None:
    versions = parse_versions("epguard: mooncake elastic EP is unusable in this image: x")
    assert versions.torch == "" and versions.mooncake == ""


def test_a_container_merely_named_epguard_probe_is_no_evidence(
    real_probe_failure: tuple[int, str],
) -> None:
    code, message = real_probe_failure
    pod = pod_with_probe_status(message, code)
    pod["spec"]["initContainers"][1]["command"] = ["sh", "-c", "echo whatever"]
    assert outcomes_of(pod) == []


def test_with_a_known_probe_image_only_pods_whose_copy_container_runs_it_count(
    real_probe_failure: tuple[int, str],
) -> None:
    code, message = real_probe_failure
    pod = pod_with_probe_status(message, code)
    assert len(outcomes_of(pod, probe_image="epguard:dev")) == 1
    # A pod that brings its own "probe" (another copy image) cannot write verdicts.
    assert outcomes_of(pod, probe_image="ghcr.io/epguard/epguard:0.1.0") == []
    pod["spec"]["initContainers"].pop(0)
    assert outcomes_of(pod, probe_image="epguard:dev") == []


def test_a_preflight_whose_probe_volume_is_the_probe_image_counts_and_no_other_image_does(
    real_probe_failure: tuple[int, str],
) -> None:
    """preflight.probeVolume: image -- no copy container: the epguard image itself is the
    probe's volume. That image, and only that one, is epguard's probe."""
    code, message = real_probe_failure
    pod = pod_with_probe_status(message, code)
    pod["spec"]["initContainers"].pop(0)
    volume = {"name": "epguard-probe", "image": {"reference": "epguard:dev"}}
    pod["spec"]["volumes"] = [volume]
    assert len(outcomes_of(pod, probe_image="epguard:dev")) == 1
    for other in (
        {"name": "epguard-probe", "image": {"reference": "attacker/epguard:dev"}},
        {"name": "other", "image": {"reference": "epguard:dev"}},  # not the probe's volume
        {"name": "epguard-probe", "emptyDir": {}},
    ):
        pod["spec"]["volumes"] = [other]
        assert outcomes_of(pod, probe_image="epguard:dev") == [], other


# --- image causes vs environment causes -------------------------------------------------

IN_THE_POD = (
    "epguard: mooncake elastic EP is unusable in this pod: mooncake.pg cannot load: "
    "missing libcuda.so.1 (NVIDIA driver not mounted in this container)\n"
    "versions: torch=2.13.0+cu130 sglang=0.5.20 mooncake-transfer-engine-cuda13=0.3.13.post1\n"
    "scope: environment (this pod or its node; the image may be fine)\n"
    "fix: give this init container the worker's GPU request (nvidia.com/gpu)"
)
IN_THE_IMAGE = (
    "epguard: mooncake elastic EP is unusable in this image: mooncake-transfer-engine "
    "0.3.13.post1 is built for CUDA 12 (needs libcudart.so.12) but torch 2.13.0+cu130 uses "
    "CUDA 13\nversions: torch=2.13.0+cu130 sglang=0.5.23 mooncake-transfer-engine=0.3.13.post1\n"
    "scope: image (in the image's files: the same on every node)\n"
    "fix: install mooncake-transfer-engine-cuda13==0.3.13.post1"
)


def test_a_cause_in_the_pod_is_an_environment_outcome_that_is_not_about_the_image() -> None:
    [o] = outcomes_of(pod_with_probe_status(IN_THE_POD, 1))
    assert (o.verdict, o.scope) == ("Unusable", "environment")
    assert not o.about_the_image
    assert o.reason.startswith("mooncake.pg cannot load: missing libcuda.so.1")


def test_a_cause_in_the_image_with_a_digest_is_about_the_image() -> None:
    [o] = outcomes_of(pod_with_probe_status(IN_THE_IMAGE, 1))
    assert (o.verdict, o.scope) == ("Unusable", "image")
    assert o.about_the_image


def test_an_image_line_contradicted_by_its_scope_line_is_not_about_the_image() -> None:
    forged = IN_THE_IMAGE.replace("scope: image", "scope: environment")
    assert classify(forged, 1) == ("Unusable", "environment")


def test_no_outcome_without_a_digest_is_about_the_image() -> None:
    # A tag names bytes that can change; only the digest the kubelet ran is evidence.
    for message, code in ((IN_THE_IMAGE, 1), (USABLE, 0)):
        [o] = outcomes_of(pod_with_probe_status(message, code, image_id=""))
        assert o.digest is None and not o.about_the_image


def test_a_pass_with_a_digest_is_about_the_image() -> None:
    [o] = outcomes_of(pod_with_probe_status(USABLE, 0))
    assert o.verdict == "Usable" and o.scope is None and o.about_the_image


def test_the_verdict_names_the_image_the_pod_asked_for_not_the_runtimes_other_name() -> None:
    # containerd reports any name the same bytes carry on the node (another tag of the
    # image): the next pods name the pod's own reference. (Patching that reference after
    # the run breaks the pod's signature: tests/admission/test_signed_injection.py.)
    pod = pod_with_probe_status(IN_THE_IMAGE, 1)
    (status,) = pod["status"]["initContainerStatuses"]
    status["image"] = "registry.example.com/alias:7"  # the same bytes' other name
    asked = next(c["image"] for c in pod["spec"]["initContainers"] if c["name"] == "epguard-probe")
    [o] = outcomes_of(pod)
    assert o.image == asked != status["image"]


# --- a --files-only run (the preflight pod) -----------------------------------------------


def _files_only_run(tmp_path: Path, change: str) -> tuple[int, str]:
    """The real probe with --files-only on a crafted image root (tests/probe/hostile_roots):
    as written, its files prove cuda-mismatch; "clear" gives it an extension they cannot
    fault."""
    root = hostile_roots.write_root(tmp_path / "root")
    if change == "clear":
        ext = root / "mooncake" / f"pg_2_13_0{hostile_roots.ext_suffix()}"
        ext.write_bytes(hostile_roots.elf_bytes(["libc.so.6"]) + b"\0set_transfer_engine\0")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=str(root), PYTHONNOUSERSITE="1")
    return run_real_probe(tmp_path, hostile_roots.WORKER, opts=["--files-only"], env=env)


def test_a_files_only_run_whose_files_prove_nothing_is_no_evidence(tmp_path: Path) -> None:
    code, message = _files_only_run(tmp_path, "clear")
    assert code == 0
    assert message.startswith(FILES_CLEAR + "left for the GPU node: ")
    # Nothing learned: not Usable (the driver, the GPU and the import are unjudged).
    for exit_code in (0, 1):
        assert classify(message, exit_code) is None
        assert outcomes_of(pod_with_probe_status(message, exit_code)) == []


def test_a_files_only_run_whose_files_prove_a_cause_is_about_the_image(tmp_path: Path) -> None:
    code, message = _files_only_run(tmp_path, "cuda-mismatch")
    assert code == 1
    [o] = outcomes_of(pod_with_probe_status(message, code))
    assert (o.verdict, o.scope) == ("Unusable", "image")
    assert o.about_the_image
    assert o.reason.startswith("mooncake-transfer-engine 0.3.13.post1 is built for CUDA 12")


def test_no_first_line_that_learns_nothing_is_ever_a_verdict() -> None:
    # Whatever the exit code and whatever lines follow (a usable line, an image scope).
    for first in (
        FILES_CLEAR + "left for the GPU node: the import of mooncake.pg",
        USABLE_HERE + "mooncake.pg imports after torch",
        NOTHING + "the worker argv does not request --elastic-ep-backend mooncake",
    ):
        for rest in ("", "\n" + USABLE.splitlines()[0], "\nscope: image (in the image's files)"):
            for code in (0, 1):
                assert classify(first + rest, code) is None, (first, rest, code)
    # The prefixes cannot be read as one another's.
    for verdict_line in (PROBE_USABLE, UNUSABLE, UNUSABLE_HERE):
        assert not FILES_CLEAR.startswith(verdict_line)
        assert not verdict_line.startswith(FILES_CLEAR)


def test_a_nodes_clock_orders_nothing_past_the_api_servers_and_the_controllers(
    real_probe_failure: tuple[int, str],
) -> None:
    code, message = real_probe_failure
    now = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    newer = verdict_spec(_ended(USABLE, 0, "2026-12-01T11:00:00Z"), "llm/new", now, None)
    # A node 3 h fast: its old run, read again, would be the newest at every restart.
    fast = _ended(message, code, "2026-12-01T13:00:00Z")
    kept = verdict_spec(fast, "llm/old", now, newer)
    assert (kept["verdict"], kept["lastSeen"]) == ("Usable", "2026-12-01T11:00:00Z")
    assert verdict_spec(fast, "llm/old", now, None)["lastSeen"] == "2026-12-01T12:00:00Z"
    # ... but a fresh run there (its pod created after the held answer) is new: it is
    # ordered by its pod's creation, the API server's clock.
    fresh = verdict_spec(fast, "llm/f", now, newer, created=now - dt.timedelta(minutes=1))
    assert (fresh["verdict"], fresh["lastSeen"], fresh["pod"]) == (
        "Unusable",
        "2026-12-01T12:00:00Z",
        "llm/f",
    )
    # A held time a minute ahead (another replica's clock, within CLOCK_SKEW) still holds.
    ahead_a_bit = {**newer, "lastSeen": "2026-12-01T12:01:00Z"}
    old = _ended(message, code, "2026-12-01T10:00:00Z")
    assert verdict_spec(old, "llm/o", now, ahead_a_bit)["verdict"] == "Usable"
    # Within CLOCK_SKEW ahead: an ordinary new run (dated now).
    near = verdict_spec(_ended(message, code, "2026-12-01T12:03:00Z"), "llm/n", now, newer)
    assert (near["verdict"], near["lastSeen"]) == ("Unusable", "2026-12-01T12:00:00Z")
    # A node a day slow: never earlier than its pod's creation (the API server's clock),
    # else a tag's verdict would be born expired.
    created = dt.datetime(2026, 12, 1, 11, 59, tzinfo=dt.UTC)
    slow = _ended(message, code, "2026-11-30T11:59:30Z")
    spec = verdict_spec(slow, "llm/s", now, None, created=created)
    assert spec["lastSeen"] == "2026-12-01T11:59:00Z"
