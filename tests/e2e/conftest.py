"""Fixtures for end-to-end tests through a real kube-apiserver + etcd (see devcluster/).

``control_plane`` starts once per test session (a start costs tens of seconds on
a small machine) and is shared; tests isolate themselves with the ``namespace``
fixture, a fresh namespace each, never deleted: without kube-controller-manager
a deleted namespace would stay Terminating anyway.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from devcluster import ControlPlane, MissingBinary


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


@pytest.fixture
def namespace(control_plane: ControlPlane) -> str:
    """A fresh namespace for one test, labelled so policies can be scoped to it."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", name, check=True)
    control_plane.kubectl("label", "namespace", name, f"epguard-e2e={name}", check=True)
    return name
