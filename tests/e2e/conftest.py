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

from devcluster import ControlPlane, MissingBinary
from devcluster.stack import Stack, deploy_epguard


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    """A running control plane: ``.kubeconfig`` (Path), ``.kubectl(*args)`` -> CompletedProcess."""
    cp = ControlPlane()
    try:
        cp.start()
    except MissingBinary as e:
        # A failure, not a skip: `make test` builds the binaries first, so a
        # missing one means the setup is broken, and a skip would hide that.
        pytest.fail(str(e), pytrace=False)
    try:
        yield cp
    finally:
        cp.stop()


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
