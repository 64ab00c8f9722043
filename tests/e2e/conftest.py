"""Fixtures for end-to-end tests through a real kube-apiserver + etcd (see devcluster/).

``control_plane`` starts once per test session (a start takes a few seconds, and
the API server's informers warm up once) and is shared; tests isolate themselves
with the ``namespace`` fixture, a fresh namespace each, never deleted: without
kube-controller-manager a deleted namespace would stay Terminating anyway.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from devcluster import ControlPlane
from devcluster.stack import Stack, deploy_epguard
from tests.control_plane import running_control_plane
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
def control_plane() -> Iterator[ControlPlane]:
    """A running control plane: ``.kubeconfig`` (Path), ``.kubectl(*args)`` -> CompletedProcess."""
    with running_control_plane() as cp:
        yield cp


@pytest.fixture(scope="session")
def epguard(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """epguard deployed into the session's control plane as ``make up`` does it: the
    chart installed with helm, the webhook and the controller as local processes, and
    the chart's ValidatingWebhookConfiguration pointed at the local webhook.

    ``.webhook_url``; ``.webhook_tls`` (``.cert_file``, ``.key_file``, ``.bundle_file``);
    ``.rotate_webhook_tls(control_plane)``; ``.run_dir`` (``webhook/rules.yaml``,
    ``logs/{webhook,controller}.log``); ``.extras`` (the processes); ``.stages``."""
    stack = Stack(run_dir=tmp_path_factory.mktemp("epguard"), detached=False)
    try:
        ok = deploy_epguard(stack, control_plane)
        skipped = {k: v for k, v in stack.stages.items() if v.startswith("skipped")}
        if not ok or skipped:
            pytest.fail(f"epguard did not deploy: {stack.stages}", pytrace=False)
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def namespace(control_plane: ControlPlane) -> str:
    """A fresh namespace for one test, labelled so policies can be scoped to it."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", name, check=True)
    control_plane.kubectl("label", "namespace", name, f"epguard-e2e={name}", check=True)
    return name


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
