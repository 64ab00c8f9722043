"""The loop through the real API server: a probe init container's status, written as the
kubelet writes it (a real probe run's exit code and termination message), becomes an
ImageVerdict and Events (the controller, a local kopf process); the webhook learns the
verdict from its watch and refuses the next pod on that image at `kubectl apply`.

There is no kube-controller-manager, so the Deployment → ReplicaSet → Pod chain is
written by hand with ownerReferences, as the controllers would write it. Each test uses
its own image (verdicts are cluster-scoped)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from e2e_kube import apply, denied_by_epguard, eventually, output, pod, worker

from devcluster import ControlPlane
from devcluster.kubelet import ProbeRun, probe_status_patch, run_probe
from devcluster.stack import PROBE_IMAGE, Stack
from webhook.outcome import PROBED_LABEL

pytestmark = pytest.mark.e2e

UNUSABLE = "epguard: mooncake elastic EP is unusable in this image: "
PRINTER_COLUMNS = [
    "NAME",
    "IMAGE",
    "DIGEST",
    "VERDICT",
    "SGLANG",
    "TORCH",
    "MOONCAKE",
    "LAST",
    "SEEN",
]


@pytest.fixture(scope="module")
def probe_run() -> ProbeRun:
    """One real probe run (in the real-package env when present), as in an image that
    lacks a working mooncake."""
    run = run_probe()
    assert run.exit_code == 1, run.message
    assert run.message.startswith(UNUSABLE)
    return run


@dataclass(frozen=True)
class Image:
    tag_ref: str  # as written in a pod: repo:tag
    digest: str  # sha256:…, what the kubelet resolved (imageID)

    @property
    def repo(self) -> str:
        return self.tag_ref.rsplit(":", 1)[0]

    @property
    def image_id(self) -> str:
        return f"{self.repo}@{self.digest}"

    @property
    def verdict_name(self) -> str:
        return self.digest.replace(":", "-")


def fresh_image() -> Image:
    tag = f"registry.example.com/e2e/loop:{uuid.uuid4().hex[:10]}"
    return Image(tag, "sha256:" + hashlib.sha256(tag.encode()).hexdigest())


def probed_pod(
    name: str, namespace: str, image: str, owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A worker pod with the epguard probe first among its init containers."""
    probe = {
        "name": "epguard-probe",
        "image": image,
        "command": ["python3", "/epguard/probe", "--termination-log", "/dev/termination-log", "--",
                    *worker(image)["command"], *worker(image)["args"]],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }  # fmt: skip
    copy_probe = {"name": "epguard-copy-probe", "image": PROBE_IMAGE}
    obj = pod(name, namespace, worker(image), initContainers=[copy_probe, probe])
    obj["metadata"]["labels"] = {PROBED_LABEL: "true"}  # what injection sets
    if owner is not None:
        obj["metadata"]["ownerReferences"] = [owner]
    return obj


def owner_ref(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def create(cp: ControlPlane, obj: dict[str, Any]) -> dict[str, Any]:
    """``kubectl create`` and return the stored object (with its uid)."""
    r = cp.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(obj))
    assert r.returncode == 0, r.stderr
    stored: dict[str, Any] = json.loads(r.stdout)
    return stored


def write_probe_status(
    cp: ControlPlane, namespace: str, name: str, image: Image, run: ProbeRun
) -> None:
    patch = probe_status_patch(run, image=image.tag_ref, image_id=image.image_id)
    r = cp.kubectl(
        "patch", "pod", name, "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps(patch),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def verdict(cp: ControlPlane, name: str) -> dict[str, Any] | None:
    r = cp.kubectl("get", "imageverdict", name, "-o", "json")
    return json.loads(r.stdout) if r.returncode == 0 else None


def wait_for_verdict(cp: ControlPlane, name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def recorded() -> bool:
        v = verdict(cp, name)
        if v is not None:
            found.append(v)
        return v is not None

    eventually(recorded, within=60, what=f"the controller to write ImageVerdict {name}")
    return found[-1]


def events(cp: ControlPlane, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
    r = cp.kubectl(
        "get", "events", "-n", namespace, "-o", "json",
        "--field-selector", f"involvedObject.kind={kind},involvedObject.name={name}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    items: list[dict[str, Any]] = json.loads(r.stdout)["items"]
    return items


def write_verdict(cp: ControlPlane, image: Image, *, age: dt.timedelta, pod: str) -> str:
    """An Unusable ImageVerdict as the controller writes it, last seen ``age`` ago."""
    seen = (dt.datetime.now(dt.UTC) - age).strftime("%Y-%m-%dT%H:%M:%SZ")
    obj = {
        "apiVersion": "epguard.io/v1alpha1",
        "kind": "ImageVerdict",
        "metadata": {"name": image.verdict_name},
        "spec": {
            "image": image.tag_ref,
            "digest": image.digest,
            "verdict": "Unusable",
            "reason": UNUSABLE + "torch does not import",
            "versions": {"sglang": "", "torch": "", "mooncake": "none"},
            "firstSeen": seen,
            "lastSeen": seen,
            "pod": pod,
            "count": 1,
        },
    }
    r = apply(cp, obj)
    assert r.returncode == 0, r.stderr
    return seen


@pytest.fixture(scope="module")
def recorded(control_plane: ControlPlane, epguard: Stack, probe_run: ProbeRun) -> dict[str, Any]:
    cp = control_plane
    namespace = f"e2e-loop-{uuid.uuid4().hex[:8]}"
    cp.kubectl("create", "namespace", namespace, check=True)
    image = fresh_image()
    labels = {"app": "sglang"}
    template = {"metadata": {"labels": labels}, "spec": {"containers": [worker(image.tag_ref)]}}
    deployment = create(cp, {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "sglang", "namespace": namespace},
        "spec": {"selector": {"matchLabels": labels}, "template": template},
    })  # fmt: skip
    replicaset = create(cp, {
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": "sglang-6d4f9", "namespace": namespace,
                     "ownerReferences": [owner_ref(deployment)]},
        "spec": {"selector": {"matchLabels": labels}, "template": template},
    })  # fmt: skip
    create(cp, probed_pod("sglang-6d4f9-x2k7q", namespace, image.tag_ref, owner_ref(replicaset)))
    write_probe_status(cp, namespace, "sglang-6d4f9-x2k7q", image, probe_run)
    iv = wait_for_verdict(cp, image.verdict_name)
    return {"namespace": namespace, "image": image, "verdict": iv, "pod": "sglang-6d4f9-x2k7q"}


class TestProbeOutcomeRecorded:
    """Deployment → ReplicaSet → Pod by hand; the pod's probe fails."""

    def test_the_image_verdict_holds_the_image_digest_reason_and_pod(
        self, recorded: dict[str, Any], probe_run: ProbeRun
    ) -> None:
        spec = recorded["verdict"]["spec"]
        image: Image = recorded["image"]

        assert spec["image"] == image.tag_ref
        assert spec["digest"] == image.digest
        assert spec["verdict"] == "Unusable"
        assert probe_run.message.splitlines()[0].endswith(": " + spec["reason"])
        assert spec["pod"] == f"{recorded['namespace']}/{recorded['pod']}"
        assert spec["count"] == 1

    def test_kubectl_get_imageverdicts_reads_as_a_compatibility_table(
        self, control_plane: ControlPlane, recorded: dict[str, Any], probe_run: ProbeRun
    ) -> None:
        image: Image = recorded["image"]

        out = control_plane.kubectl("get", "imageverdicts", image.verdict_name, check=True).stdout

        header, row = out.splitlines()
        assert header.split() == PRINTER_COLUMNS
        assert row.split()[:4] == [image.verdict_name, image.tag_ref, image.digest, "Unusable"]
        versions = next(
            line for line in probe_run.message.splitlines() if line.startswith("versions:")
        )
        found = dict(kv.split("=", 1) for kv in versions.removeprefix("versions:").split())
        for key in ("sglang", "torch"):
            if found[key] != "none":
                assert f" {found[key]} " in row
        mooncake = {k: v for k, v in found.items() if k.startswith("mooncake") and v != "none"}
        for dist, version in mooncake.items():
            assert f"{dist} {version}" in row
        assert re.search(r"\s\d+s$", row)  # LAST SEEN: seconds ago

    def test_an_event_with_the_reason_is_posted_on_the_pod(
        self, control_plane: ControlPlane, recorded: dict[str, Any], probe_run: ProbeRun
    ) -> None:
        found = events(control_plane, recorded["namespace"], "Pod", recorded["pod"])

        assert [e["reason"] for e in found] == ["MooncakeProbeFailed"]
        assert found[0]["type"] == "Warning"
        assert probe_run.message.splitlines()[0][:200] in found[0]["message"]

    def test_the_same_event_is_posted_on_the_top_owner_not_the_replicaset(
        self, control_plane: ControlPlane, recorded: dict[str, Any], probe_run: ProbeRun
    ) -> None:
        on_deployment = events(control_plane, recorded["namespace"], "Deployment", "sglang")
        on_replicaset = events(control_plane, recorded["namespace"], "ReplicaSet", "sglang-6d4f9")

        assert [e["reason"] for e in on_deployment] == ["MooncakeProbeFailed"]
        assert (
            f"epguard probe in pod {recorded['namespace']}/{recorded['pod']}"
            in (on_deployment[0]["message"])
        )
        assert on_replicaset == []

    def test_kubectl_describe_pod_shows_the_probe_termination(
        self, control_plane: ControlPlane, recorded: dict[str, Any], probe_run: ProbeRun
    ) -> None:
        out = control_plane.kubectl(
            "describe", "pod", recorded["pod"], "-n", recorded["namespace"], check=True
        ).stdout

        assert re.search(r"State:\s+Terminated\n\s+Reason:\s+Error\n\s+Message:\s+" + re.escape(
            probe_run.message.splitlines()[0]), out)  # fmt: skip
        assert re.search(r"Exit Code:\s+1\n", out)
        assert re.search(r"Warning\s+MooncakeProbeFailed\s+\S+\s+epguard-controller", out)

    def test_the_next_pod_on_that_image_is_refused_with_the_learned_reason_and_where(
        self, control_plane: ControlPlane, recorded: dict[str, Any], probe_run: ProbeRun
    ) -> None:
        image: Image = recorded["image"]
        next_pod = pod("sglang-next", recorded["namespace"], worker(image.tag_ref))
        eventually(
            lambda: denied_by_epguard(apply(control_plane, next_pod, dry_run=True)),
            what="the webhook to learn the verdict",
        )

        r = apply(control_plane, next_pod)

        assert denied_by_epguard(r), output(r)
        seen = recorded["verdict"]["spec"]["lastSeen"]
        assert (
            f"which this image cannot serve: {recorded['verdict']['spec']['reason']} "
            f"(seen failing in pod {recorded['namespace']}/{recorded['pod']} at {seen})"
        ) in r.stderr
        assert f"[epguard verdict {image.verdict_name}]" in r.stderr

    def test_a_pod_pinned_to_the_failing_digest_is_refused_too(
        self, control_plane: ControlPlane, recorded: dict[str, Any]
    ) -> None:
        image: Image = recorded["image"]
        pinned = pod("sglang-pinned", recorded["namespace"], worker(image.image_id))
        eventually(
            lambda: denied_by_epguard(apply(control_plane, pinned, dry_run=True)),
            what="the webhook to learn the verdict",
        )

        r = apply(control_plane, pinned)

        assert denied_by_epguard(r), output(r)
        assert f"[epguard verdict {image.verdict_name}]" in r.stderr


class TestVerdictLifetime:
    def test_a_tag_verdict_older_than_the_ttl_only_warns(
        self, control_plane: ControlPlane, epguard: Stack, namespace: str
    ) -> None:
        image = fresh_image()
        write_verdict(control_plane, image, age=dt.timedelta(hours=25), pod=f"{namespace}/old-0")
        obj = pod("sglang", namespace, worker(image.tag_ref))
        eventually(
            lambda: image.verdict_name in apply(control_plane, obj, dry_run=True).stderr,
            what="the webhook to learn the verdict",
        )

        r = apply(control_plane, obj)

        assert r.returncode == 0, r.stderr
        assert f"seen failing in pod {namespace}/old-0" in r.stderr
        assert "Warning:" in r.stderr

    def test_a_fresh_tag_verdict_refuses(
        self, control_plane: ControlPlane, epguard: Stack, namespace: str
    ) -> None:
        image = fresh_image()
        seen = write_verdict(
            control_plane, image, age=dt.timedelta(hours=23), pod=f"{namespace}/w-0"
        )
        obj = pod("sglang", namespace, worker(image.tag_ref))
        eventually(
            lambda: denied_by_epguard(apply(control_plane, obj, dry_run=True)),
            what="the webhook to learn the verdict",
        )

        r = apply(control_plane, obj)

        assert denied_by_epguard(r), output(r)
        assert f"(seen failing in pod {namespace}/w-0 at {seen})" in r.stderr

    def test_a_digest_verdict_refuses_however_old_it_is(
        self, control_plane: ControlPlane, epguard: Stack, namespace: str
    ) -> None:
        image = fresh_image()
        write_verdict(control_plane, image, age=dt.timedelta(days=90), pod=f"{namespace}/old-0")
        pinned = pod("sglang", namespace, worker(image.image_id))
        tagged = pod("sglang-tag", namespace, worker(image.tag_ref))
        eventually(
            lambda: denied_by_epguard(apply(control_plane, pinned, dry_run=True)),
            what="the webhook to learn the verdict",
        )

        by_digest = apply(control_plane, pinned)
        by_tag = apply(control_plane, tagged)

        assert denied_by_epguard(by_digest), output(by_digest)
        assert f"seen failing in pod {namespace}/old-0" in by_digest.stderr
        assert by_tag.returncode == 0, by_tag.stderr  # the same verdict, by tag: only a warning

    def test_deleting_the_image_verdict_clears_it(
        self, control_plane: ControlPlane, epguard: Stack, namespace: str
    ) -> None:
        image = fresh_image()
        write_verdict(control_plane, image, age=dt.timedelta(minutes=5), pod=f"{namespace}/w-0")
        obj = pod("sglang", namespace, worker(image.tag_ref))
        eventually(
            lambda: denied_by_epguard(apply(control_plane, obj, dry_run=True)),
            what="the webhook to learn the verdict",
        )

        control_plane.kubectl("delete", "imageverdict", image.verdict_name, check=True)
        eventually(
            lambda: apply(control_plane, obj, dry_run=True).returncode == 0,
            what="the webhook to forget the verdict",
        )

        r = apply(control_plane, obj)
        assert r.returncode == 0, r.stderr
        assert image.verdict_name not in output(r)
