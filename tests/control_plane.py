"""One way for every test module to get its own real control plane."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from devcluster import ControlPlane, MissingBinary


@contextmanager
def running_control_plane() -> Iterator[ControlPlane]:
    """A fresh etcd + kube-apiserver, stopped (leaving no process) when the block ends.

    A missing binary fails the test rather than skipping it: `make test` builds them
    first, so a missing one means the set-up is broken, and a skip would hide that.
    """
    cp = ControlPlane()
    try:
        cp.start()
    except MissingBinary as e:
        pytest.fail(f"{e} (run `make tools`)", pytrace=False)
    try:
        yield cp
    finally:
        cp.stop()
