"""How long a verdict refuses, through the real API server and webhook: ImageVerdicts
written as the controller writes them (by tag or by digest, of a given age), and what
the webhook then does with the next pod. The loop that writes them from a real probe
run under a real kubelet is tests/e2e/test_loop_on_node.py. Each test uses its own
image (verdicts are cluster-scoped)."""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid
from dataclasses import dataclass

import pytest

from devcluster import ControlPlane
from devcluster.stack import Stack
from tests.e2e.e2e_kube import apply, denied_by_epguard, eventually, output, pod, worker

pytestmark = pytest.mark.e2e

UNUSABLE = "epguard: mooncake elastic EP is unusable in this image: "


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
