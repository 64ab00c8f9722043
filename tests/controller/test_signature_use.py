"""The controller learns from a signed probe only in the pod the signature was made for:
created within FRESH_SECONDS of signing (the API server stamps ``creationTimestamp``), and
once per signature (issue 21.1: signed parts replayed into a hand-made pod)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from kubernetes import client

from epguard.webhook.controller.probe_key import ProbeKeyManager
from epguard.webhook.controller.recorder import _verified
from epguard.webhook.engine.injection import InjectionSettings, plan
from epguard.webhook.engine.outcome import PROBED_LABEL
from epguard.webhook.engine.signing import (
    FRESH_SECONDS,
    SIGNATURE_ANNOTATION,
    KeyringHolder,
    SignatureLedger,
    new_keyring,
    sign,
)

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
RING = new_keyring(NOW)
WORKER = {
    "name": "worker",
    "image": "registry.example/sglang:1",
    "command": ["python3", "-m", "sglang.launch_server"],
    "args": ["--elastic-ep-backend", "mooncake"],
}


def _stamp(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def signed_pod(
    uid: str,
    signed_at: dt.datetime,
    created: dt.datetime,
    namespace: str = "ml",
    image: str = str(WORKER["image"]),
) -> dict[str, Any]:
    worker = {**WORKER, "image": image}
    spec = plan({"containers": [worker]}, InjectionSettings(epguard_image="epguard:1")).spec
    assert spec is not None
    stored = {"metadata": {"labels": {PROBED_LABEL: "true"}}, "spec": spec}
    return {
        "metadata": {
            "name": f"pod-{uid}",
            "namespace": namespace,
            "uid": uid,
            "creationTimestamp": _stamp(created),
            "labels": {PROBED_LABEL: "true"},
            "annotations": {SIGNATURE_ANNOTATION: sign(RING.current, namespace, stored, signed_at)},
        },
        "spec": spec,
    }


def keys() -> ProbeKeyManager:
    # A real manager over a client that is never called: the ring is held already.
    return ProbeKeyManager(
        client.ApiClient(), "epguard-system", "epguard-probe-key", dt.timedelta(days=1),
        KeyringHolder(RING),
    )  # fmt: skip


def test_the_pod_a_signature_was_made_for_is_evidence() -> None:
    pod = signed_pod("u1", NOW, NOW + dt.timedelta(seconds=1))
    assert _verified(pod, "ml", keys(), SignatureLedger()).ok


def test_a_signature_copied_into_a_pod_created_later_is_not_evidence() -> None:
    later = NOW + dt.timedelta(seconds=FRESH_SECONDS + 60)
    checked = _verified(signed_pod("u1", NOW, later), "ml", keys(), SignatureLedger())
    assert not checked.ok and "made for another pod" in checked.reason


def test_a_signature_counts_once_even_within_its_window() -> None:
    ledger = SignatureLedger()
    first = signed_pod("u1", NOW, NOW)
    replay = dict(first, metadata=dict(first["metadata"], uid="u2", name="replay"))
    assert _verified(first, "ml", keys(), ledger).ok
    assert _verified(first, "ml", keys(), ledger).ok  # the same pod, seen again
    checked = _verified(replay, "ml", keys(), ledger)
    assert not checked.ok and "used by pod uid u1 first" in checked.reason


def test_a_pod_without_a_readable_creation_time_is_not_evidence() -> None:
    pod = signed_pod("u1", NOW, NOW)
    pod["metadata"]["creationTimestamp"] = "yesterday"
    assert not _verified(pod, "ml", keys(), SignatureLedger()).ok


def test_the_ledger_is_bounded() -> None:
    ledger = SignatureLedger(limit=3)
    for i in range(10):
        assert ledger.claim(f"s{i}", f"u{i}") is None
    assert len(ledger.owners) == 3 and ledger.claim("s9", "other") == "u9"
