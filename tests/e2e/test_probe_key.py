"""The probe-signing key through a real kube-apiserver: created once, rotated when due
(the previous keys kept), replaced when unusable, and one keyring for two replicas."""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Iterator

import pytest
from kubernetes import client

from devcluster import ControlPlane
from epguard.webhook.cluster.kube import api_client
from epguard.webhook.controller.probe_key import ProbeKeyManager
from epguard.webhook.engine.signing import MAX_KEYS, KeyringHolder, keyring_from_secret
from tests.control_plane import running_control_plane

pytestmark = pytest.mark.e2e

NS = "default"
NOW = dt.datetime(2026, 12, 1, 12, tzinfo=dt.UTC)
ROTATION = dt.timedelta(days=30)


@pytest.fixture(scope="module")
def cluster() -> Iterator[ControlPlane]:
    with running_control_plane() as cp:
        yield cp


def manager(cp: ControlPlane, name: str) -> ProbeKeyManager:
    return ProbeKeyManager(api_client(str(cp.kubeconfig)), NS, name, ROTATION, KeyringHolder())


def stored(cp: ControlPlane, name: str) -> dict[str, object]:
    r = cp.kubectl("get", "secret", name, "-n", NS, "-o", "json", check=True)
    obj: dict[str, object] = json.loads(r.stdout)
    return obj


def test_the_key_is_created_once_and_held(cluster: ControlPlane) -> None:
    m = manager(cluster, "key-create")
    ring = m.reconcile_once(NOW)
    assert m.holder.ring == ring and len(ring.keys) == 1
    assert keyring_from_secret(stored(cluster, "key-create")) == ring
    # Not due: the same key, no write.
    version = stored(cluster, "key-create")["metadata"]["resourceVersion"]  # type: ignore[index]
    assert m.reconcile_once(NOW + dt.timedelta(days=1)) == ring
    assert stored(cluster, "key-create")["metadata"]["resourceVersion"] == version  # type: ignore[index]


def test_a_due_key_is_rotated_and_the_previous_ones_still_verify(cluster: ControlPlane) -> None:
    m = manager(cluster, "key-rotate")
    first = m.reconcile_once(NOW)
    second = m.reconcile_once(NOW + ROTATION + dt.timedelta(hours=1))
    assert second.current != first.current
    assert second.find(first.current.id) == first.current
    later = second
    for i in range(MAX_KEYS + 1):
        later = m.reconcile_once(NOW + (i + 2) * (ROTATION + dt.timedelta(hours=1)))
    assert len(later.keys) == MAX_KEYS
    assert keyring_from_secret(stored(cluster, "key-rotate")) == later


def test_an_unusable_secret_is_replaced_with_a_fresh_key(cluster: ControlPlane) -> None:
    m = manager(cluster, "key-broken")
    m.reconcile_once(NOW)
    garbage = base64.b64encode(b"not json").decode()
    patch = json.dumps({"data": {"keys.json": garbage}})
    cluster.kubectl("patch", "secret", "key-broken", "-n", NS, "-p", patch, check=True)
    ring = m.reconcile_once(NOW + dt.timedelta(minutes=1))
    assert keyring_from_secret(stored(cluster, "key-broken")) == ring


def test_two_replicas_end_up_holding_the_same_keyring(cluster: ControlPlane) -> None:
    a, b = manager(cluster, "key-ha"), manager(cluster, "key-ha")
    ring_a = a.reconcile_once(NOW)
    ring_b = b.reconcile_once(NOW)  # reads what a created; creates nothing
    assert ring_a == ring_b
    due = NOW + ROTATION + dt.timedelta(hours=1)
    rotated_a = a.reconcile_once(due)
    assert b.reconcile_once(due) == rotated_a  # b sees a's rotation as not due yet


def test_the_secret_is_opaque_and_labelled_as_the_controllers(cluster: ControlPlane) -> None:
    manager(cluster, "key-labels").reconcile_once(NOW)
    core = client.CoreV1Api(api_client(str(cluster.kubeconfig)))
    secret = core.read_namespaced_secret("key-labels", NS)
    assert secret.type == "Opaque"
    assert secret.metadata.labels == {"app.kubernetes.io/managed-by": "epguard-controller"}
