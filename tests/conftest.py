"""Suite-wide fixtures and markers.

``state`` (the engine's in-memory state with the test rules) and ``server`` (a real
webhook on loopback TLS, one per module) serve the engine and admission tests.

``control_plane`` (etcd + kube-apiserver) starts once per test session (a start takes a
few seconds, and the API server's informers warm up once) and is shared by tests/e2e and
tests/devcluster; ``epguard`` deploys the chart into it with the webhook and controller
as local processes; tests isolate themselves with ``namespace``, a fresh namespace each,
never deleted: without kube-controller-manager a deleted namespace stays Terminating.

``shared_node`` is the one-node cluster with the chart's pods (tests/e2e/node_e2e.py)
that the node modules share, started by ``make up`` and stopped by ``make down``; a
module that starts a node of its own asks for ``machine_to_itself`` first. Tests marked
``after_all`` run after every other collected test (the shared node's ``make down``);
the longest modules (``LONG_MODULES``) are collected first, for make test's two workers.

Tests marked ``gpu`` need an NVIDIA driver (``libcuda.so.1``) and a visible GPU;
they are skipped on machines without one and run where one exists.
"""

from __future__ import annotations

import ctypes
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster import ControlPlane
from devcluster.stack import Stack, deploy_epguard
from epguard.webhook.engine.policy import PolicyState
from tests.control_plane import running_control_plane
from tests.e2e.node_e2e import SharedCluster
from tests.factory import TEST_RULES, make_state
from tests.servers import RunningServer, running_server


def _has_gpu() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists()


# The modules whose tests take longest in all (20 s or more in make test's first phase, on
# two xdist workers; measured on ee971b7), longest first. They are handed out first (with
# scripts/test.sh's --no-loadscope-reorder, xdist gives each worker a module at a time in
# this order), so that the two workers end together: xdist's own order, by number of
# tests, handed these out last (test_backstop_scale's four tests take 85 s); replayed from
# the per-test times, one worker ran on ~14 s after the other had ended. A module missing
# here only runs later.
LONG_MODULES = (
    "tests/e2e/test_backstop_scale.py",
    "tests/controller/test_gatekeeper.py",
    "tests/e2e/test_controller_resilience.py",
    "tests/probe/test_probe_realpkgs.py",
    "tests/probe/test_probe_doubles.py",
    "tests/e2e/test_cluster_watches.py",
    "tests/e2e/test_backstop.py",
    "tests/probe/test_probe_files_only.py",
    "tests/chart/test_prefilter.py",
    "tests/controller/test_compiler.py",
    "tests/scan/test_hostile.py",
    "tests/e2e/test_controller_e2e.py",
    "tests/engine/test_three_entry_points.py",
    "tests/e2e/test_admission.py",
    "tests/e2e/test_preflight_policy.py",
)


def _order(item: pytest.Item) -> tuple[bool, int]:
    module = item.nodeid.split("::", 1)[0]
    rank = LONG_MODULES.index(module) if module in LONG_MODULES else len(LONG_MODULES)
    # Tests marked after_all run last, whatever their module.
    return item.get_closest_marker("after_all") is not None, rank


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_order)  # stable: in collected order within each rank
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver (libcuda.so.1)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def state() -> PolicyState:
    return make_state()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tmp_path_factory.mktemp("server"), TEST_RULES) as s:
        yield s


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


@pytest.fixture(scope="session")
def shared_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedCluster]:
    shared = SharedCluster(lambda: tmp_path_factory.mktemp("stack"))
    try:
        yield shared
    finally:
        _stopped(shared)


@pytest.fixture(scope="module")
def machine_to_itself(shared_node: SharedCluster) -> None:
    """For a module that starts a node of its own: the shared one is stopped first (and
    started again by the next module that asks for it)."""
    _stopped(shared_node)


def _stopped(shared: SharedCluster) -> None:
    """``make down`` of the shared cluster, failing loudly where it failed: a module that
    then started a node of its own would meet the old one's ports and containerd, and a
    session that ended green would leave the machine taken."""
    down = shared.stop()
    if down is not None and down.returncode != 0:
        pytest.fail(
            f"make down of the shared cluster failed ({down.returncode}):\n"
            f"{down.stdout[-2000:]}{down.stderr[-2000:]}",
            pytrace=False,
        )


@pytest.fixture
def namespace(control_plane: ControlPlane) -> str:
    """A fresh namespace for one test, labelled so policies can be scoped to it."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", name, check=True)
    control_plane.kubectl("label", "namespace", name, f"epguard-e2e={name}", check=True)
    return name
