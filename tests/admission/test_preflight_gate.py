"""/mutate's half of the preflight gate, over real TLS: a worker on an image with no
verdict is injected and gated (``epguard.io/preflight``); a judged image, a namespace
that says ``off``, a server without a signing key or a pod that does not ask for
mooncake is not; a preflight pod the controller signed is left as it is."""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from epguard.webhook.engine.imageref import parse as parse_ref
from epguard.webhook.engine.injection import InjectionSettings
from epguard.webhook.engine.namespaces import PREFLIGHT_KEY
from epguard.webhook.engine.outcome import PROBE_CONTAINER
from epguard.webhook.engine.preflight import (
    GATE,
    PreflightSettings,
    is_gated,
    key_of,
    preflight_pod,
    signed,
)
from epguard.webhook.engine.signing import FORMAT, SIGNATURE_ANNOTATION, new_keyring, verify
from epguard.webhook.engine.verdicts import Verdict, VerdictStore
from tests.factory import TEST_RULES, container, pod, review
from tests.servers import RunningServer, running_server

INJECT = {"epguard.io/inject": "enabled"}
NEW = "registry.example/sglang:new"
JUDGED = "registry.example/sglang:judged"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tmp_path_factory.mktemp("gate"), TEST_RULES) as s:
        s.runtime.state.keys.set(new_keyring(_now()))
        store = s.runtime.state.verdicts
        assert isinstance(store, VerdictStore)
        store.upsert(
            Verdict("v", JUDGED, parse_ref(JUDGED), None, True, "ok", _now(), None), _now()
        )
        yield s


def mutate(server: RunningServer, obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the response, the pod as the API server stores it after the patch)."""
    with server.client() as client:
        r = client.post("/mutate", json=review(obj))
    assert r.status_code == 200, r.text
    response: dict[str, Any] = r.json()["response"]
    ops = json.loads(base64.b64decode(response["patch"])) if "patch" in response else []
    return response, jsonpatch.apply_patch(obj, ops)


def worker(image: str = NEW, **kw: Any) -> dict[str, Any]:
    return pod([container(image=image)], annotations=INJECT, **kw)


def test_a_worker_on_a_new_image_is_injected_and_gated(server: RunningServer) -> None:
    obj = worker()
    obj["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    response, stored = mutate(server, obj)
    assert response["allowed"] is True
    assert stored["spec"]["schedulingGates"] == [
        {"name": "kueue.x-k8s.io/admission"},
        {"name": GATE},
    ]
    assert PROBE_CONTAINER in [c["name"] for c in stored["spec"]["initContainers"]]
    ring = server.runtime.state.keys.ring
    assert ring is not None and verify(ring, "ml", stored).ok  # the gate is not signed


def test_a_judged_image_is_not_gated(server: RunningServer) -> None:
    _, stored = mutate(server, worker(JUDGED))
    assert not is_gated(stored)
    assert PROBE_CONTAINER in [c["name"] for c in stored["spec"]["initContainers"]]


def test_a_pod_bound_to_a_node_is_probed_not_gated(server: RunningServer) -> None:
    # The API server refuses a pod with spec.nodeName and a scheduling gate ("nodeName:
    # Forbidden: cannot be set until all schedulingGates have been cleared", checked on
    # kube-apiserver v1.35.4): gated, such a worker could not be created at all.
    obj = worker()
    obj["spec"]["nodeName"] = "gpu-node-1"
    response, stored = mutate(server, obj)
    assert response["allowed"] is True and not is_gated(stored)
    assert PROBE_CONTAINER in [c["name"] for c in stored["spec"]["initContainers"]]


def test_a_gated_pod_bound_by_a_later_webhook_loses_the_gate_when_reinvoked(
    server: RunningServer,
) -> None:
    # Gated by epguard, then spec.nodeName set by a later webhook: reinvoked, epguard
    # kept its gate and the API server refused the pod.
    _, gated = mutate(server, worker())
    assert is_gated(gated)
    gated["spec"]["nodeName"] = "gpu-node-1"
    _, again = mutate(server, gated)
    assert not is_gated(again)


def test_a_pod_that_does_not_ask_for_mooncake_is_not_gated(server: RunningServer) -> None:
    plain = container(image=NEW, args=["--model-path", "/m"])
    _, stored = mutate(server, pod([plain], annotations=INJECT))
    assert not is_gated(stored)


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (
            ["--model-path", "/m", "--elastic-ep-backend", "$(EP)"],
            [{"name": "EP", "valueFrom": {"configMapKeyRef": {"name": "sglang", "key": "ep"}}}],
        ),
        (["--config", "/etc/sglang/serve.yaml"], None),
    ],
    ids=["value-from-a-configmap", "config-file"],
)
def test_a_worker_whose_flag_admission_cannot_see_is_probed_not_gated(
    server: RunningServer, args: list[str], env: list[dict[str, Any]] | None
) -> None:
    """The probe sees the pod's values when it starts; the gate would hold the pod on a
    verdict about mooncake that the worker may never ask for (and its preflight, without
    the pod's variables, could not tell). Before, such a worker got neither."""
    obj = pod([container(image=NEW, args=args, env=env)], annotations=INJECT)
    response, stored = mutate(server, obj)
    assert response["allowed"] is True
    assert PROBE_CONTAINER in [c["name"] for c in stored["spec"]["initContainers"]]
    assert not is_gated(stored)
    ring = server.runtime.state.keys.ring
    assert ring is not None and verify(ring, "ml", stored).ok  # its outcome is evidence
    with server.client() as client:
        said = client.post("/validate", json=review(stored)).json()["response"]
    assert said["allowed"] is True
    assert any("the epguard probe checks it when the pod starts" in w for w in said["warnings"])


def test_a_value_the_shell_computes_is_said_to_be_read_by_neither(server: RunningServer) -> None:
    # The probe cannot compute ${V,,} either (it says "the image was not checked"); the
    # warning promised it would check it.
    script = "V=MOONCAKE; exec python3 -m sglang.launch_server --elastic-ep-backend ${V,,}"
    obj = pod([container(image=NEW, command=["bash", "-c", script], args=[])], annotations=INJECT)
    _, stored = mutate(server, obj)
    with server.client() as client:
        said = client.post("/validate", json=review(stored)).json()["response"]
    warning = next(w for w in said["warnings"] if "${V,,}" in w)
    assert "the shell computes as it runs is read by neither" in warning


def test_a_worker_in_a_native_sidecar_is_probed_first_and_not_gated(
    server: RunningServer,
) -> None:
    """An SGLang worker run as a native sidecar (an init container with restartPolicy
    Always) got no probe (injection read spec.containers only): now the probe runs before
    it. The gate and the preflight judge the containers' images only."""
    sidecar = {**container(image=NEW, name="sglang"), "restartPolicy": "Always"}
    plain = container(image="registry.example/proxy:1", name="proxy", args=["--port", "8"])
    obj = pod([plain], init=[sidecar], annotations=INJECT)
    response, stored = mutate(server, obj)
    assert response["allowed"] is True
    names = [c["name"] for c in stored["spec"]["initContainers"]]
    assert names[-1] == "sglang" and PROBE_CONTAINER in names[:-1]
    probe = next(c for c in stored["spec"]["initContainers"] if c["name"] == PROBE_CONTAINER)
    assert probe["image"] == NEW and probe["command"][-1] == sidecar["args"][-1]
    assert not is_gated(stored)
    ring = server.runtime.state.keys.ring
    assert ring is not None and verify(ring, "ml", stored).ok


def test_a_namespace_label_overrides_the_default_both_ways(
    server: RunningServer, tmp_path: Path
) -> None:
    server.runtime.state.namespaces.upsert("ml", {PREFLIGHT_KEY: "off"})
    try:
        _, stored = mutate(server, worker())
        assert not is_gated(stored)
    finally:
        server.runtime.state.namespaces.delete("ml")
    with running_server(tmp_path, TEST_RULES, preflight_mode="off") as off:
        off.runtime.state.keys.set(new_keyring(_now()))
        _, stored = mutate(off, worker())
        assert not is_gated(stored)
        off.runtime.state.namespaces.upsert("ml", {PREFLIGHT_KEY: "gate"})
        _, stored = mutate(off, worker())
        assert is_gated(stored)


def test_without_a_signing_key_nothing_is_gated(tmp_path: Path) -> None:
    # The controller could not sign a preflight either: the pod would wait for nothing.
    with running_server(tmp_path, TEST_RULES) as unkeyed:
        response, stored = mutate(unkeyed, worker())
        assert not is_gated(stored)
        assert any("injected unsigned" in w for w in response["warnings"])


def _preflight(server: RunningServer) -> dict[str, Any]:
    spec = worker()["spec"]
    settings = PreflightSettings(InjectionSettings(server.runtime.settings.inject_image))
    built = preflight_pod("ml", spec, key_of("ml", spec, NEW), settings)
    assert built is not None
    return built


def test_a_signed_preflight_pod_is_left_as_it_is(server: RunningServer) -> None:
    ring = server.runtime.state.keys.ring
    assert ring is not None
    obj = signed(_preflight(server), ring.current, _now())
    response, stored = mutate(server, obj)
    assert "patch" not in response
    assert stored == obj
    assert "--files-only" in stored["spec"]["initContainers"][1]["command"]


def test_a_preflight_label_without_a_valid_signature_is_injected_as_any_pod(
    server: RunningServer,
) -> None:
    ring = server.runtime.state.keys.ring
    assert ring is not None
    obj = signed(_preflight(server), ring.current, _now())
    obj["metadata"]["annotations"][SIGNATURE_ANNOTATION] = f"{FORMAT}:forged:1:00"
    obj["metadata"]["annotations"].update(INJECT)
    _, stored = mutate(server, obj)
    # Its main container asks for nothing, so its epguard-* parts are removed.
    assert not [
        c for c in stored["spec"].get("initContainers", []) if c["name"].startswith("epguard-")
    ]
