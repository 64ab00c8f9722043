"""Fixtures for end-to-end tests through a real kube-apiserver + etcd (see devcluster/);
``control_plane``, ``epguard`` and ``namespace`` are the suite's (tests/conftest.py), as
devcluster's own tests use them too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devcluster import ControlPlane
from devcluster.stack import Stack
from tests.e2e.e2e_kube import (
    BAD_IMAGE,
    DENY_RULE,
    DENY_RULE_ID,
    apply,
    eventually,
    minimal_crd,
    pod,
    rules_text,
    set_rules_text,
    with_rule,
    worker,
)


@pytest.fixture(scope="session")
def deny_rule(control_plane: ControlPlane, epguard: Stack) -> Iterator[str]:
    """The session's deny rule (``e2e_kube.DENY_RULE``, for ``BAD_IMAGE``) added to the
    live rules ConfigMap, in force once the webhook denies a dry run; its id."""
    original = rules_text(control_plane)
    set_rules_text(control_plane, with_rule(original, DENY_RULE))
    probe_ns = "e2e-deny-rule"
    control_plane.kubectl("create", "namespace", probe_ns)
    probe = pod("deny-rule-probe", probe_ns, worker(BAD_IMAGE))
    eventually(
        lambda: DENY_RULE_ID in apply(control_plane, probe, dry_run=True).stderr,
        what="the webhook to load the e2e deny rule",
    )
    try:
        yield DENY_RULE_ID
    finally:
        set_rules_text(control_plane, original)


@pytest.fixture(scope="session")
def workload_crds(control_plane: ControlPlane) -> list[str]:
    """LeaderWorkerSet and DynamoGraphDeployment CRDs (minimal), established."""
    crds = [
        minimal_crd("leaderworkerset.x-k8s.io", "LeaderWorkerSet", "leaderworkersets", ["v1"]),
        minimal_crd(
            "nvidia.com", "DynamoGraphDeployment", "dynamographdeployments", ["v1alpha1", "v1beta1"]
        ),
    ]
    r = apply(control_plane, *crds)
    assert r.returncode == 0, r.stderr
    names = [f"crd/{c['metadata']['name']}" for c in crds]  # type: ignore[index]
    control_plane.kubectl("wait", "--for=condition=Established", *names, check=True)
    return names
