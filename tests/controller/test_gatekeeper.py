"""The preflight controller's passes against an in-memory API with the API server's
semantics where they matter here (a create of an existing name is a conflict, a JSON
patch whose ``test`` fails changes nothing, conditions merge by type). The real API
server and node: tests/e2e/test_preflight_on_node.py."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import itertools
import json
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import jsonpatch
import kopf
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.webhook.controller import gatekeeper
from epguard.webhook.controller.gatekeeper import (
    CREATE_SECONDS,
    NEW_PER_NAMESPACE,
    RETAINED_PER_NAMESPACE,
    Conflict,
    KubePreflightApi,
    PreflightConfig,
    Preflights,
    Refused,
    Terminating,
    worker_keys,
    worth_a_pass,
)
from epguard.webhook.controller.owners import Unreadable
from epguard.webhook.engine.injection import InjectionSettings
from epguard.webhook.engine.outcome import COPY_CONTAINER, PROBE_CONTAINER, PROBED_LABEL
from epguard.webhook.engine.preflight import (
    CONDITION,
    GATE,
    KEY_LABEL,
    PREFLIGHT_LABEL,
    PreflightSettings,
    ProbeVolume,
    is_gated,
)
from epguard.webhook.engine.signing import (
    FORMAT,
    MAX_KEYS,
    SIGNATURE_ANNOTATION,
    Keyring,
    new_keyring,
    rotated,
    sign,
    verify,
)

NOW = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.UTC)
BAD_LINE = "epguard: mooncake elastic EP is unusable in this image: torch has no mooncake"
BAD = f"{BAD_LINE}\nscope: image (files)\nfix: rebuild"
CLEAR = "epguard: no image cause in this image's files: left for the GPU node: the driver"
STAMP = "%Y-%m-%dT%H:%M:%SZ"


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> dt.datetime:
        return self.now


class MemoryApi:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.owners: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, str, str, bool, str]] = []
        self.event_keys: set[tuple[str, str]] = set()
        self.uids = itertools.count(1)
        self.deleted: list[str] = []
        self.lists: list[str | None] = []  # the namespace of each list call (None: all)

    def add(self, pod: dict[str, Any]) -> dict[str, Any]:
        pod = copy.deepcopy(pod)
        meta = pod.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{next(self.uids)}")
        meta.setdefault("creationTimestamp", self.clock().strftime(STAMP))
        self.pods[(meta["namespace"], meta["name"])] = pod
        return pod

    def _probed(self, namespace: str | None) -> Iterator[dict[str, Any]]:
        self.lists.append(namespace)
        for p in list(self.pods.values()):
            if p["metadata"].get("labels", {}).get(PROBED_LABEL) == "true" and namespace in (
                None,
                p["metadata"]["namespace"],
            ):
                yield copy.deepcopy(p)

    def preflight_pods(self, namespace: str | None = None) -> Iterator[dict[str, Any]]:
        return (
            p
            for p in self._probed(namespace)
            if p["metadata"]["labels"].get(PREFLIGHT_LABEL) == "true"
        )

    def unscheduled_probed_pods(self, namespace: str | None = None) -> Iterator[dict[str, Any]]:
        return (p for p in self._probed(namespace) if not p.get("spec", {}).get("nodeName"))

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.pods.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def create_pod(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if (namespace, body["metadata"]["name"]) in self.pods:
            raise Conflict("AlreadyExists")
        return copy.deepcopy(self.add(body))

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        pod = self.pods.get((namespace, name))
        if pod is not None and pod["metadata"]["uid"] == uid:
            del self.pods[(namespace, name)]
            self.deleted.append(name)

    def patch_pod(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise Conflict("NotFound")
        try:
            self.pods[(namespace, name)] = jsonpatch.apply_patch(pod, ops)
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
            raise Conflict(str(exc)) from exc

    def set_condition(self, namespace: str, name: str, uid: str, condition: dict[str, Any]) -> None:
        pod = self.pods.get((namespace, name))
        if pod is None or pod["metadata"]["uid"] != uid:  # the API server: 404, or 422
            raise ApiException(status=422 if pod else 404, reason="not that pod")
        status = pod.setdefault("status", {})
        kept = [c for c in status.get("conditions", []) if c["type"] != condition["type"]]
        status["conditions"] = [*kept, condition]

    def read_object(self, path: str) -> dict[str, Any]:
        if path not in self.owners:
            raise Unreadable("Not Found")
        return self.owners[path]

    def post_event(
        self, about: client.V1ObjectReference, reason: str, message: str, *, warning: bool, key: str
    ) -> bool:
        if (str(about.name), key) in self.event_keys:
            return True
        self.event_keys.add((str(about.name), key))
        self.events.append((str(about.kind), str(about.name), reason, warning, message))
        return True

    # -- what a test looks at ------------------------------------------------------------

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.pods[(namespace, name)]

    def preflights(self) -> list[dict[str, Any]]:
        return [
            p for p in self.pods.values() if p["metadata"]["name"].startswith("epguard-preflight-")
        ]

    def finish(self, preflight: dict[str, Any], code: int, message: str) -> None:
        preflight["status"] = {
            "phase": "Succeeded" if code == 0 else "Failed",
            "initContainerStatuses": [
                {
                    "name": PROBE_CONTAINER,
                    "state": {"terminated": {"exitCode": code, "message": message}},
                }
            ],
        }


class Keys:
    def __init__(self, ring: Keyring | None) -> None:
        self.ring = ring
        self.rereads = 0
        self.secret: Keyring | None = None  # what a read of the Secret would find, if set

    def refresh(self) -> Keyring | None:
        return self.ring

    def reread(self) -> Keyring | None:
        self.rereads += 1
        if self.secret is not None:
            self.ring = self.secret
        return self.ring


def _conditions_written(api: MemoryApi) -> list[str]:
    """Each condition written from now on, as "<pod> <reason>", in order."""
    written: list[str] = []
    write = api.set_condition

    def recorded(namespace: str, name: str, uid: str, condition: dict[str, Any]) -> None:
        written.append(f"{name} {condition['reason']}")
        write(namespace, name, uid, condition)

    api.set_condition = recorded  # type: ignore[method-assign]
    return written


def gated_pod(
    name: str, image: str = "r.example/sglang:new", namespace: str = "ml", owner: str | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {PROBED_LABEL: "true"}}
    if owner:
        meta["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "name": owner,
                "uid": f"rs-{owner}",
                "controller": True,
            }
        ]
    return {
        "metadata": meta,
        "spec": {
            "schedulingGates": [{"name": GATE}],
            "containers": [
                {
                    "name": "worker",
                    "image": image,
                    "args": ["--model-path", "/m", "--elastic-ep-backend", "mooncake"],
                }
            ],
        },
    }


def setup(
    on_error: str = "open",
    retain: int = 3600,
    ring: bool = True,
    probe_volume: ProbeVolume = "copy",
) -> tuple[Preflights, MemoryApi, Clock, Keyring | None]:
    clock = Clock()
    api = MemoryApi(clock)
    keyring = new_keyring(NOW) if ring else None
    injection = InjectionSettings("r.example/epguard:1")
    config = PreflightConfig(
        PreflightSettings(injection, timeout_seconds=300, probe_volume=probe_volume),
        on_error=on_error,
        retain_seconds=retain,
    )
    # The pass's clock for CREATE_SECONDS stands still: a slow machine never leaves a
    # test's creates to the next pass (the test of that budget moves it itself).
    pf = Preflights(api, config, Keys(keyring), clock, monotonic=lambda: 0.0)
    return pf, api, clock, keyring


def test_one_preflight_per_image_key_however_many_pods_wait() -> None:
    pf, api, _, ring = setup()
    for i in range(64):
        api.add(gated_pod(f"w-{i}"))
    api.add(gated_pod("other-image", image="r.example/sglang:other"))
    api.add(gated_pod("other-ns", namespace="team-b"))
    done = pf.run_once()
    assert len(done.created) == 3 and len(api.preflights()) == 3
    assert ring is not None
    for p in api.preflights():
        assert verify(ring, p["metadata"]["namespace"], p).ok  # signed like /mutate signs
    assert pf.run_once().created == []  # running: nothing is created twice
    assert all(is_gated(api.pod("ml", f"w-{i}")) for i in range(64))
    cond = next(c for c in api.pod("ml", "w-0")["status"]["conditions"] if c["type"] == CONDITION)
    assert cond["status"] == "False" and cond["reason"] == "PreflightRunning"


def test_a_restarted_controller_picks_up_the_running_preflight() -> None:
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    restarted, _, _, _ = setup()
    restarted.api = api
    restarted.clock = clock
    restarted.keys = pf.keys  # the same Secret's keys
    assert restarted.run_once().created == []
    assert len(api.preflights()) == 1
    assert is_gated(api.pod("ml", "w-0"))  # still waiting on the running preflight


def test_nothing_proven_takes_the_gate_off_every_waiting_pod() -> None:
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    api.add(gated_pod("w-1"))
    api.pod("ml", "w-1")["spec"]["schedulingGates"].insert(0, {"name": "kueue"})
    pf.run_once()
    api.finish(api.preflights()[0], 0, CLEAR)
    done = pf.run_once()
    assert sorted(done.ungated) == ["Pod ml/w-0", "Pod ml/w-1"]
    assert not is_gated(api.pod("ml", "w-0"))
    assert api.pod("ml", "w-1")["spec"]["schedulingGates"] == [{"name": "kueue"}]
    assert ("Pod", "w-0", "PreflightPassed", False) in [e[:4] for e in api.events]
    # A new pod on the image: decided at once by the retained preflight, none created.
    api.add(gated_pod("w-2"))
    again = pf.run_once()
    assert again.created == [] and again.ungated == ["Pod ml/w-2"]


def test_an_image_cause_holds_every_waiting_pod_with_the_probes_line() -> None:
    pf, api, _, _ = setup()
    api.owners["/apis/apps/v1/namespaces/ml/replicasets/web-7d9f"] = {
        "metadata": {
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": "web",
                    "uid": "d-1",
                    "controller": True,
                }
            ]
        }
    }
    api.owners["/apis/apps/v1/namespaces/ml/deployments/web"] = {"metadata": {}}
    for i in range(3):
        api.add(gated_pod(f"w-{i}", owner="web-7d9f"))
    pf.run_once()
    api.finish(api.preflights()[0], 1, BAD)
    done = pf.run_once()
    assert len(done.held) == 3 and done.ungated == []
    for i in range(3):
        pod = api.pod("ml", f"w-{i}")
        assert is_gated(pod)
        cond = next(c for c in pod["status"]["conditions"] if c["type"] == CONDITION)
        assert cond["status"] == "False" and cond["reason"] == "ImageUnusable"
        assert BAD_LINE in cond["message"]
    on_pods = [e for e in api.events if e[0] == "Pod" and e[2] == "ImageUnusable"]
    on_owner = [e for e in api.events if e[0] == "Deployment"]
    assert len(on_pods) == 3 and all(e[3] for e in on_pods)
    assert len(on_owner) == 1 and BAD_LINE in on_owner[0][4]  # once, not per pod
    # Later passes post nothing new.
    before = len(api.events)
    assert pf.run_once().held == [] and len(api.events) == before


@pytest.mark.parametrize("on_error", ["open", "hold"])
def test_a_preflight_that_cannot_judge_opens_or_holds(on_error: str) -> None:
    pf, api, clock, _ = setup(on_error=on_error)
    api.add(gated_pod("w-0"))
    pf.run_once()
    preflight = api.preflights()[0]
    preflight["status"] = {
        "initContainerStatuses": [
            {
                "name": PROBE_CONTAINER,
                "state": {
                    "waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}
                },
            }
        ]
    }
    assert pf.run_once().ungated == []  # waits while within the deadline
    cond = next(c for c in api.pod("ml", "w-0")["status"]["conditions"] if c["type"] == CONDITION)
    assert "ImagePullBackOff" in cond["message"]
    clock.now += dt.timedelta(seconds=301)
    done = pf.run_once()
    if on_error == "open":
        assert done.ungated == ["Pod ml/w-0"]
        event = next(e for e in api.events if e[2] == "PreflightFailedGateOpened")
        assert event[3] and "did not finish within 300 s" in event[4]
    else:
        assert done.ungated == [] and is_gated(api.pod("ml", "w-0"))
        assert done.held == ["Pod ml/w-0"]


def test_without_a_signing_key_nothing_is_decided_until_the_deadline() -> None:
    # Without keys epguard's preflights cannot be told from a tenant's pods under their
    # names: each read as "not made by epguard", and every waiting pod was opened.
    pf, api, clock, _ = setup(ring=False)
    api.add(gated_pod("w-0"))
    done = pf.run_once()
    assert done.created == [] and api.preflights() == [] and done.ungated == []
    assert is_gated(api.pod("ml", "w-0"))
    clock.now += dt.timedelta(seconds=300 + 61)  # the deadline and a minute, keyless
    done = pf.run_once()
    assert done.created == [] and done.ungated == ["Pod ml/w-0"]  # onError=open
    assert "holds no probe-signing key" in api.events[-1][4]


def test_a_held_pod_stays_held_while_the_keys_cannot_be_read() -> None:
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 1, BAD)
    assert pf.run_once().held == ["Pod ml/w-0"]
    pf.keys.ring = None  # type: ignore[attr-defined]  # a failed read of the Secret
    done = pf.run_once()
    assert done.ungated == [] and is_gated(api.pod("ml", "w-0"))
    assert pf.answer(["ml"]).ungated == []


def test_a_preflight_the_api_server_refuses_cannot_judge() -> None:
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))

    def refuse(namespace: str, body: dict[str, Any]) -> None:
        raise Refused("denied by the ValidatingAdmissionPolicy epguard-preflight")

    api.create_pod = refuse  # type: ignore[method-assign]
    done = pf.run_once()
    assert done.ungated == ["Pod ml/w-0"]  # onError=open: nothing stays gated forever
    event = next(e for e in api.events if e[2] == "PreflightFailedGateOpened")
    assert "could not be created" in event[4] and "epguard-preflight" in event[4]


def _init_names(api: MemoryApi) -> list[list[str]]:
    return [[c["name"] for c in p["spec"]["initContainers"]] for p in api.preflights()]


def test_a_refused_image_probe_volume_falls_back_to_the_copy_in_that_namespace() -> None:
    """preflight.probeVolume: image where the API server cannot take it (the ImageVolume
    gate off drops the volume, and the chart's policy refuses what is left; a policy
    engine that knows no image volumes): the preflight is made with the copy container
    at once, and so is every later one of that namespace, instead of every gated pod
    opened unjudged. Another namespace still tries the image volume: one namespace's
    policy must not change how another's preflights are made."""
    pf, api, _, ring = setup(probe_volume="image")
    api.add(gated_pod("w-0"))
    real, refused = api.create_pod, []

    def no_image_volumes(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if any("image" in v for v in body["spec"]["volumes"]):
            refused.append(namespace)
            raise Refused("denied by the ValidatingAdmissionPolicy epguard-preflight")
        return real(namespace, body)

    api.create_pod = no_image_volumes  # type: ignore[method-assign]
    done = pf.run_once()
    assert refused == ["ml"] and done.ungated == [] and is_gated(api.pod("ml", "w-0"))
    assert _init_names(api) == [[COPY_CONTAINER, PROBE_CONTAINER]]
    assert ring is not None and verify(ring, "ml", api.preflights()[0]).ok
    api.add(gated_pod("w-1", image="r.example/sglang:other"))
    pf.run_once()
    assert refused == ["ml"]  # the namespace's next preflight is made with the copy at once
    api.add(gated_pod("w-2", namespace="team-b"))
    pf.run_once()
    assert refused == ["ml", "team-b"]
    assert _init_names(api) == [[COPY_CONTAINER, PROBE_CONTAINER]] * 3
    assert pf.config.settings.probe_volume == "image"


def test_an_image_probe_volume_refused_with_the_copy_too_says_the_copys_refusal() -> None:
    """Refused with the copy container too: the copy's refusal is the answer (onError),
    and the namespace's next preflight still mounts the image."""
    pf, api, _, _ = setup(probe_volume="image")
    api.add(gated_pod("w-0"))
    shapes: list[bool] = []

    def refuse(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        image = any("image" in v for v in body["spec"]["volumes"])
        shapes.append(image)
        raise Refused("no image volumes here" if image else "denied by the namespace's policy")

    api.create_pod = refuse  # type: ignore[method-assign]
    done = pf.run_once()
    assert shapes == [True, False] and done.ungated == ["Pod ml/w-0"]
    event = next(e for e in api.events if e[2] == "PreflightFailedGateOpened")
    assert "denied by the namespace's policy" in event[4]
    assert "no image volumes" not in event[4]
    api.add(gated_pod("w-1", image="r.example/sglang:other"))
    pf.run_once()
    assert shapes[2] is True


def test_an_image_probe_volume_refused_over_quota_waits_and_is_not_copied() -> None:
    """A quota the namespace's own pods may free says nothing about the volume: the
    preflight waits, as with the copy, and is not made twice."""
    pf, api, _, _ = setup(probe_volume="image")
    api.add(gated_pod("w-0"))
    shapes: list[bool] = []

    def over_quota(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        shapes.append(any("image" in v for v in body["spec"]["volumes"]))
        raise Refused('pods "epguard-preflight-x" is forbidden: exceeded quota: pods')

    api.create_pod = over_quota  # type: ignore[method-assign]
    done = pf.run_once()
    assert shapes == [True] and done.ungated == [] and is_gated(api.pod("ml", "w-0"))


def test_an_image_probe_volume_the_api_server_takes_is_kept() -> None:
    pf, api, _, _ = setup(probe_volume="image")
    api.add(gated_pod("w-0"))
    pf.run_once()
    assert _init_names(api) == [[PROBE_CONTAINER]]
    assert pf.config.settings.probe_volume == "image"


@pytest.mark.parametrize("on_error", ["open", "hold"])
def test_a_preflight_an_admission_step_changed_is_deleted_and_cannot_judge(
    on_error: str,
) -> None:
    # A LimitRange's default ephemeral-storage is added to every container that has none
    # (tests/e2e/test_preflight_policy.py shows it on a real API server), so the stored
    # preflight no longer verifies. It was taken for a tenant's pod under the
    # preflight's name: its pods opened unjudged, or held for good, the pod never removed.
    pf, api, clock, _ = setup(on_error=on_error)
    api.add(gated_pod("w-0"))
    creates = []

    def defaulted(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        creates.append(body["metadata"]["name"])
        body = copy.deepcopy(body)
        for c in [*body["spec"]["initContainers"], *body["spec"]["containers"]]:
            for part in ("requests", "limits"):
                c.setdefault("resources", {}).setdefault(part, {})["ephemeral-storage"] = "1Gi"
        return MemoryApi.create_pod(api, namespace, body)

    api.create_pod = defaulted  # type: ignore[method-assign]
    done = pf.run_once()
    assert api.preflights() == [] and len(done.deleted) == 1
    cond = next(c for c in api.pod("ml", "w-0")["status"]["conditions"] if c["type"] == CONDITION)
    assert "changed by an admission step" in cond["message"]
    if on_error == "open":
        assert done.ungated == ["Pod ml/w-0"]
        event = next(e for e in api.events if e[2] == "PreflightFailedGateOpened")
        assert "LimitRange" in event[4]
    else:
        assert done.held == ["Pod ml/w-0"] and is_gated(api.pod("ml", "w-0"))
        assert pf.run_once().created == [] and len(creates) == 1  # not made every pass
        clock.now += dt.timedelta(seconds=301)
        pf.run_once()
        assert len(creates) == 2  # tried again after a deadline


def test_a_changed_preflight_still_terminating_keeps_its_standing_failure() -> None:
    # Deleted gracefully, it is listed again next pass: its pods' condition flipped back
    # to "running" (and failed again) while it went.
    pf, api, _, _ = setup(on_error="hold")
    api.add(gated_pod("w-0"))
    real = api.create_pod

    def defaulted(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        stored = real(namespace, body)
        for c in api.pod(namespace, body["metadata"]["name"])["spec"]["initContainers"]:
            c["resources"]["requests"]["ephemeral-storage"] = "1Gi"
        return api.pod(namespace, body["metadata"]["name"]) if stored else stored

    api.create_pod = defaulted  # type: ignore[method-assign]
    deletes: list[str] = []
    api.delete_pod = lambda namespace, name, uid: deletes.append(name)  # type: ignore[method-assign]
    written = _conditions_written(api)
    pf.run_once()
    pf.run_once()  # the changed preflight is still there
    assert written == ["w-0 PreflightFailed"], written  # written once, never "running"
    assert len(deletes) == 2  # and asked to go again, not left for the standing's end


def test_a_changed_preflight_found_by_a_list_is_made_again_not_taken_for_a_tenants() -> None:
    # The create's own answer was lost (a timeout, a restart): the next list found a pod
    # under the preflight's name, signed by a held key, that does not verify. It was read
    # as a tenant's pod: its pods opened (or held for good) and it was never removed.
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    (made,) = api.preflights()
    for c in made["spec"]["initContainers"]:  # what a LimitRange default does
        c["resources"]["requests"]["ephemeral-storage"] = "1Gi"
    second = pf.run_once()
    assert second.ungated == [] and second.deleted == [f"Pod ml/{made['metadata']['name']}"]
    cond = next(c for c in api.pod("ml", "w-0")["status"]["conditions"] if c["type"] == CONDITION)
    assert "changed by an admission step" in cond["message"]
    assert pf.run_once().created == [f"Pod ml/{made['metadata']['name']}"]  # made again


def test_a_key_whose_preflight_was_never_made_is_not_said_to_have_lost_it() -> None:
    # "Removed before it answered" is for keys that had a preflight; one whose creates
    # kept failing says why it never started.
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))

    def failing(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        raise ApiException(status=500, reason="etcdserver: request timed out")

    api.create_pod = failing  # type: ignore[method-assign]
    assert pf.run_once().ungated == []
    assert _passes_for(pf, clock, 300 + 61) == ["Pod ml/w-0"]
    event = next(e for e in api.events if e[2] == "PreflightFailedGateOpened")
    assert "etcdserver" in event[4] and "removed before it answered" not in event[4]


def test_a_preflight_removed_before_it_answers_is_not_remade_past_the_deadline() -> None:
    # Deleted between passes (a drain, a reaper, an admin), it was made again each pass
    # with a deadline of its own: 80 preflights in 40 minutes, the pod gated throughout.
    pf, api, clock, _ = setup(on_error="open")
    api.add(gated_pod("w-0"))
    made = 0
    for _ in range(80):  # 40 minutes of passes 30 s apart
        made += len(pf.run_once().created)
        if not is_gated(api.pod("ml", "w-0")):
            break
        for p in api.preflights():
            del api.pods[(p["metadata"]["namespace"], p["metadata"]["name"])]
        clock.now += dt.timedelta(seconds=30)
    assert not is_gated(api.pod("ml", "w-0"))  # onError=open, at the deadline
    assert made <= (300 + 60) // 30 + 1, made
    event = next(e for e in api.events if e[2] == "PreflightFailedGateOpened")
    assert "removed before it answered" in event[4]


def test_a_just_rotated_key_does_not_sign_preflights_yet() -> None:
    # A webhook replica whose watch has not read the new key yet refused or re-injected a
    # preflight signed with it, and under onError=open its pods were opened unjudged.
    pf, api, clock, _ = setup()
    older = new_keyring(NOW - dt.timedelta(days=30))
    pf.keys = Keys(rotated(older, NOW))  # type: ignore[assignment]
    api.add(gated_pod("w-0"))
    pf.run_once()
    (first,) = api.preflights()
    assert verify(older, "ml", first).key_id == older.current.id
    assert verify(older, "ml", first).ok  # a replica holding only the older keys verifies it
    del api.pods[("ml", first["metadata"]["name"])]
    clock.now += dt.timedelta(seconds=121)
    api.add(gated_pod("w-1", image="r.example/sglang:other"))
    pf.run_once()
    newest = pf.keys.ring.current  # type: ignore[attr-defined]
    assert any(verify(pf.keys.ring, "ml", p).key_id == newest.id for p in api.preflights())  # type: ignore[attr-defined]


def test_an_ungate_that_lost_a_race_changes_nothing() -> None:
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 0, CLEAR)
    real = api.patch_pod

    def racing(namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        # The tenant added a gate in front of ours between the list and the patch.
        api.pod(namespace, name)["spec"]["schedulingGates"].insert(0, {"name": "mine"})
        real(namespace, name, ops)

    api.patch_pod = racing  # type: ignore[method-assign]
    assert pf.run_once().ungated == []
    assert api.pod("ml", "w-0")["spec"]["schedulingGates"] == [{"name": "mine"}, {"name": GATE}]
    api.patch_pod = real  # type: ignore[method-assign]
    assert pf.run_once().ungated == ["Pod ml/w-0"]
    assert api.pod("ml", "w-0")["spec"]["schedulingGates"] == [{"name": "mine"}]


def test_a_gated_pod_whose_image_changed_waits_on_the_new_image() -> None:
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 0, CLEAR)
    api.pod("ml", "w-0")["spec"]["containers"][0]["image"] = "r.example/sglang:swapped"
    done = pf.run_once()
    assert done.ungated == [] and len(done.created) == 1
    (key,) = worker_keys(api.pod("ml", "w-0"))
    assert key.image == "r.example/sglang:swapped"


def test_preflights_nobody_waits_on_are_cleaned_up() -> None:
    pf, api, clock, _ = setup(retain=600)
    api.add(gated_pod("w-0"))
    api.add(gated_pod("gone", image="r.example/sglang:gone"))
    pf.run_once()
    finished = next(
        p
        for p in api.preflights()
        if p["spec"]["initContainers"][1]["image"] == "r.example/sglang:new"
    )
    api.finish(finished, 0, CLEAR)
    del api.pods[("ml", "gone")]  # its only waiter was deleted while it ran
    done = pf.run_once()
    assert len(done.deleted) == 1  # the running one nobody waits on
    clock.now += dt.timedelta(seconds=599)
    assert pf.run_once().deleted == []  # still answers for its image
    clock.now += dt.timedelta(seconds=2)
    assert len(pf.run_once().deleted) == 1
    assert api.preflights() == []


def test_a_namespace_keeps_only_its_newest_finished_preflights_however_many_it_made() -> None:
    """A tenant gated one pod after another, each on a key of its own, and deleted each
    once its preflight ended: every finished preflight was kept for the retention, and
    each pass listed and held all of them (review helper). Past the cap the oldest are
    deleted; another namespace's are not counted against it."""
    pf, api, clock, _ = setup(retain=3600)
    extra = 5
    for i in range(RETAINED_PER_NAMESPACE + extra):
        api.add(gated_pod(f"w-{i}", image=f"r.example/sglang:v{i}"))
    api.add(gated_pod("b-0", namespace="team-b"))
    made = []
    while len(api.preflights()) < RETAINED_PER_NAMESPACE + extra + 1:
        created = pf.run_once().created
        assert created, "no pass made a preflight"
        made += created
        clock.now += dt.timedelta(seconds=1)
    for p in api.preflights():
        api.finish(p, 0, CLEAR)
    pf.run_once()  # the answers: every pod let go
    for at in [at for at, p in api.pods.items() if PREFLIGHT_LABEL not in p["metadata"]["labels"]]:
        del api.pods[at]
    done = pf.run_once()
    assert len(done.deleted) == extra, done.deleted
    left = [(p["metadata"]["namespace"], p["metadata"]["creationTimestamp"])
            for p in api.preflights()]  # fmt: skip
    assert len([ns for ns, _ in left if ns == "ml"]) == RETAINED_PER_NAMESPACE
    assert any(ns == "team-b" for ns, _ in left)
    oldest_kept = min(stamp for ns, stamp in left if ns == "ml")
    assert all(p["metadata"]["creationTimestamp"] >= oldest_kept
               for p in api.preflights())  # fmt: skip
    assert pf.run_once().deleted == []  # within the cap now


def test_a_preflight_being_deleted_is_not_deleted_again_each_pass() -> None:
    pf, api, clock, _ = setup(retain=600)
    api.add(gated_pod("w-0"))
    pf.run_once()
    (preflight,) = api.preflights()
    api.finish(preflight, 0, CLEAR)
    del api.pods[("ml", "w-0")]
    # Held by a finalizer (the policy lets only the controller add one; one set before it).
    preflight["metadata"]["deletionTimestamp"] = clock().strftime(STAMP)
    clock.now += dt.timedelta(seconds=601)
    assert pf.run_once().deleted == []
    assert api.preflights() == [preflight]


def test_a_pod_gated_by_hand_without_a_mooncake_container_is_let_go() -> None:
    pf, api, _, _ = setup()
    pod = gated_pod("w-0")
    pod["spec"]["containers"][0]["args"] = ["--model-path", "/m"]
    api.add(pod)
    done = pf.run_once()
    # Nothing to judge: no key, so the pod waits on nothing and the gate comes off.
    assert done.created == [] and done.ungated == ["Pod ml/w-0"]
    assert "nothing to judge" in api.events[-1][4]


def test_the_preflight_key_label_is_what_matches_a_preflight_to_its_pods() -> None:
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    (preflight,) = api.preflights()
    (key,) = worker_keys(api.pod("ml", "w-0"))
    assert preflight["metadata"]["labels"][KEY_LABEL] == key.hash
    assert preflight["metadata"]["name"] == key.pod_name


def test_one_namespaces_api_trouble_does_not_stop_the_others() -> None:
    pf, api, _, _ = setup()
    api.add(gated_pod("w", namespace="aaa"))
    api.add(gated_pod("w", namespace="team-b", image="r.example/sglang:b"))
    real = api.create_pod

    def flaky(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if namespace == "aaa":
            raise RuntimeError("500 Internal Server Error from an image-policy webhook")
        return real(namespace, body)

    api.create_pod = flaky  # type: ignore[method-assign]
    done = pf.run_once()
    assert done.created == [
        "Pod team-b/epguard-preflight-" + worker_keys(api.pod("team-b", "w"))[0].hash
    ]
    # The API server's trouble is no verdict on the image: it waits, and says why.
    assert done.ungated == [] and is_gated(api.pod("aaa", "w"))
    cond = next(c for c in api.pod("aaa", "w")["status"]["conditions"] if c["type"] == CONDITION)
    assert cond["reason"] == "PreflightRunning" and "500 Internal Server Error" in cond["message"]
    api.finish(api.preflights()[0], 0, CLEAR)
    assert pf.run_once().ungated == ["Pod team-b/w"]


def test_a_pod_the_pass_cannot_read_is_left_as_it_is_and_stops_no_one_else(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Insurance: no pod is known to make the pass's reading raise (a fuzz of 112,000
    random pods found none), but one that did must not stop every namespace's pass."""
    from epguard.webhook.controller import gatekeeper

    pf, api, _, _ = setup()
    api.add(gated_pod("bad", namespace="aaa"))
    api.add(gated_pod("w", namespace="team-b", image="r.example/sglang:b"))
    real = gatekeeper.worker_keys

    def raising(pod: Any) -> Any:
        if pod["metadata"]["name"] == "bad":
            raise ValueError("a shape nobody foresaw")
        return real(pod)

    monkeypatch.setattr(gatekeeper, "worker_keys", raising)
    with caplog.at_level("WARNING", logger="epguard.controller.gatekeeper"):
        done = pf.run_once()
        pf.run_once()
    assert [p["metadata"]["namespace"] for p in api.preflights()] == ["team-b"]
    assert len(done.created) == 1 and is_gated(api.pod("aaa", "bad"))
    said = [r.getMessage() for r in caplog.records if "aaa/bad" in r.getMessage()]
    assert said == [
        "pod aaa/bad left as it is: it could not be read (ValueError: a shape nobody foresaw)"
    ]


def test_a_refused_gate_removal_is_said_once_and_blocks_no_one_else() -> None:
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    api.add(gated_pod("w-1"))
    pf.run_once()
    api.finish(api.preflights()[0], 0, CLEAR)
    real = api.patch_pod

    def policy(namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        if name == "w-0":
            raise Refused('admission webhook "kyverno" denied the request: no updates')
        real(namespace, name, ops)

    api.patch_pod = policy  # type: ignore[method-assign]
    assert pf.run_once().ungated == ["Pod ml/w-1"]
    pf.run_once()
    stuck = [e for e in api.events if e[2] == "PreflightGateStuck"]
    assert len(stuck) == 1 and "kyverno" in stuck[0][4] and stuck[0][1] == "w-0"
    assert is_gated(api.pod("ml", "w-0"))


def test_a_tenants_pod_under_the_preflights_name_is_no_answer_and_is_left_alone() -> None:
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    (key,) = worker_keys(api.pod("ml", "w-0"))
    fake = {"metadata": {"name": key.pod_name, "namespace": "ml", "labels": {
        PROBED_LABEL: "true", "epguard.io/preflight-pod": "true", KEY_LABEL: key.hash}},
        "spec": {}}  # fmt: skip
    api.add(fake)
    api.finish(api.pod("ml", key.pod_name), 1, BAD)  # it "says" the image is bad
    done = pf.run_once()
    assert done.held == [] and done.ungated == ["Pod ml/w-0"]  # onError=open
    event = next(e for e in api.events if e[2] == "PreflightFailedGateOpened")
    assert "did not make" in event[4]
    assert done.deleted == [] and ("ml", key.pod_name) in api.pods


def test_a_forged_preflight_with_a_non_ascii_signature_time_stops_no_pass() -> None:
    # A tenant's own pod, labelled a preflight, with a signature whose time is "²"
    # (str.isdigit() says yes, int() raises): it made every pass fail, so no namespace's
    # preflight was created and every gated pod stayed gated.
    pf, api, _, ring = setup()
    assert ring is not None
    forged = {"metadata": {"name": "forged", "namespace": "team-evil", "labels": {
        PROBED_LABEL: "true", "epguard.io/preflight-pod": "true"}, "annotations": {
        "epguard.io/probe-signature": f"{FORMAT}:{ring.keys[0].id}:\u00b2:00"}},
        "spec": {"initContainers": [{"name": "epguard-x", "image": "busybox"}],
                 "containers": [{"name": "c", "image": "busybox"}]}}  # fmt: skip
    api.add(forged)
    api.add(gated_pod("victim", namespace="team-b"))
    done = pf.run_once()
    assert len(done.created) == 1 and api.preflights()[0]["metadata"]["namespace"] == "team-b"
    assert ("team-evil", "forged") in api.pods  # not epguard's: left alone


def test_a_key_held_up_by_a_squatted_name_fails_at_the_deadline() -> None:
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))
    (key,) = worker_keys(api.pod("ml", "w-0"))
    api.add({"metadata": {"name": key.pod_name, "namespace": "ml"}, "spec": {}})
    assert pf.run_once().ungated == []  # every create is a 409; it waits...
    assert _passes_for(pf, clock, 300 + 61) == ["Pod ml/w-0"]  # ...until the deadline
    assert "no preflight answered within 360 s" in api.events[-1][4]


def _passes_for(pf: Preflights, clock: Clock, seconds: int, every: int = 30) -> list[str]:
    """``seconds`` of the controller's life, a pass every ``every`` s (a pass runs every
    5 s; a longer gap means no pass ran): the pods those passes opened."""
    opened: list[str] = []
    for _ in range(0, seconds, every):
        clock.now += dt.timedelta(seconds=every)
        opened += pf.run_once().ungated
    return opened


def test_a_preflight_is_signed_when_it_is_created_not_when_the_pass_began() -> None:
    pf, api, clock, ring = setup()
    for i in range(3):
        api.add(gated_pod(f"w-{i}", image=f"r.example/sglang:{i}"))
    real = api.create_pod
    signed_at: list[tuple[int | None, dt.datetime]] = []

    def slow(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        assert ring is not None
        signed_at.append((verify(ring, namespace, body).signed_at, clock.now))
        clock.now += dt.timedelta(seconds=100)  # a slow API server
        return real(namespace, body)

    api.create_pod = slow  # type: ignore[method-assign]
    pf.run_once()
    assert [s for s, _ in signed_at] == [int(t.timestamp()) for _, t in signed_at]


def test_under_hold_a_failed_preflight_is_retried_after_the_retention() -> None:
    pf, api, clock, _ = setup(on_error="hold", retain=600)
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 128, "")  # could not start
    assert pf.run_once().held == ["Pod ml/w-0"]
    clock.now += dt.timedelta(seconds=601)
    assert len(pf.run_once().deleted) == 1  # retried: the next pass starts a new one
    assert len(pf.run_once().created) == 1
    assert is_gated(api.pod("ml", "w-0"))


def test_a_pass_reads_a_shared_owner_once_and_decides_pods_side_by_side() -> None:
    """The replicas of one ReplicaSet share its owner chain: a pass reads it once, not
    once per pod (200 waiting pods decided one after another took ~30 s on the node)."""
    pf, api, _, _ = setup()
    api.owners["/apis/apps/v1/namespaces/ml/replicasets/web-7d9f"] = {
        "metadata": {"ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                          "name": "web", "uid": "d-1", "controller": True}]}
    }  # fmt: skip
    api.owners["/apis/apps/v1/namespaces/ml/deployments/web"] = {"metadata": {}}
    reads: list[str] = []
    threads: set[str] = set()
    read_object, post_event = api.read_object, api.post_event

    def counted(path: str) -> dict[str, Any]:
        reads.append(path)
        time.sleep(0.01)  # an API round trip: lets the pass's threads overlap
        return read_object(path)

    def posted(*args: Any, **kwargs: Any) -> bool:
        threads.add(threading.current_thread().name)
        time.sleep(0.01)
        return post_event(*args, **kwargs)

    api.read_object = counted  # type: ignore[method-assign]
    api.post_event = posted  # type: ignore[method-assign]
    for i in range(16):
        api.add(gated_pod(f"w-{i}", owner="web-7d9f"))
    pf.run_once()
    api.finish(api.preflights()[0], 1, BAD)
    assert len(pf.run_once().held) == 16
    assert sorted(reads) == sorted(api.owners)  # each once
    assert len(threads) > 1  # the pods' writes were made side by side


def test_a_gated_or_preflight_pods_event_wakes_a_pass_through_kopfs_own_body() -> None:
    """The event filter is handed a ``kopf.Body`` (a Mapping view, not a dict). Read as a
    dict, it saw no labels and no gate: no event ever woke a pass, and every preflight
    was created and every gate decided on the 5 s timer (up to 5 s late, twice)."""
    preflight = gated_pod("epguard-preflight-1")
    preflight["spec"].pop("schedulingGates")
    preflight["metadata"]["labels"][PREFLIGHT_LABEL] = "true"
    ungated = gated_pod("w-open")
    ungated["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    assert worth_a_pass(body=kopf.Body(gated_pod("w-0")))
    assert worth_a_pass(body=kopf.Body(preflight))
    assert not worth_a_pass(body=kopf.Body(ungated))
    assert not worth_a_pass(body=kopf.Body({}))


def test_a_held_pod_in_a_namespace_being_deleted_is_not_opened_on_its_way_out() -> None:
    # Seen on the node: the namespace controller deleted the preflight first; the next
    # pass could not create another ("being terminated") and, under onError=open, took
    # the gate off a held pod of a bad image, which could then be scheduled.
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    api.add(gated_pod("w-1"))
    pf.run_once()
    api.finish(api.preflights()[0], 1, BAD)
    assert len(pf.run_once().held) == 2
    preflight = api.preflights()[0]
    api.delete_pod("ml", preflight["metadata"]["name"], preflight["metadata"]["uid"])
    api.add(gated_pod("w-2"))  # created just before the namespace began to go

    def terminating(namespace: str, body: dict[str, Any]) -> None:
        raise Terminating("unable to create new content in namespace ml: being terminated")

    api.create_pod = terminating  # type: ignore[method-assign]
    done = pf.run_once()
    assert done.ungated == [] and done.created == []
    assert all(is_gated(api.pod("ml", f"w-{i}")) for i in range(3))
    assert not any(e[2] == "PreflightFailedGateOpened" for e in api.events)


def test_the_api_servers_namespace_terminating_refusal_is_told_apart() -> None:
    body = {
        "kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": 'pods "epguard-preflight-1" is forbidden: unable to create new content in '
                   "namespace ml because it is being terminated",
        "details": {"name": "epguard-preflight-1", "kind": "pods", "causes": [
            {"reason": "NamespaceTerminating", "type": "NamespaceTerminating",
             "message": "namespace ml is being terminated", "field": "metadata.namespace"}]},
    }  # fmt: skip
    terminating = ApiException(status=403, reason="Forbidden")
    terminating.body = json.dumps(body)
    rbac = ApiException(status=403, reason="Forbidden")
    rbac.body = json.dumps({**body, "details": {"name": "epguard-preflight-1", "kind": "pods"}})
    for exc, raised in ((terminating, Terminating), (rbac, Refused)):

        class Core:
            def create_namespaced_pod(self, *args: Any, error: Exception = exc, **kw: Any) -> None:
                raise error

        api = KubePreflightApi(client.ApiClient())  # nothing is sent: core is replaced
        api.core = Core()  # type: ignore[assignment]
        with pytest.raises(raised, match="being terminated"):
            api.create_pod("ml", {"metadata": {"name": "epguard-preflight-1"}})


def test_pods_whose_preflight_answered_are_decided_before_the_waiting_ones_are_written() -> None:
    # 40 pods on an image whose preflight still runs, listed before 3 on an image whose
    # preflight has answered: the answered ones' decisions come first in the pass, not
    # behind 40 "waiting" condition writes (on a loaded API server, seconds each pass).
    pf, api, _, _ = setup()
    for i in range(3):
        api.add(gated_pod(f"bad-{i}", image="r.example/sglang:bad"))
    pf.run_once()  # the bad image's preflight, created
    api.finish(api.preflights()[0], 1, BAD)
    for i in range(40):
        api.add(gated_pod(f"new-{i}", image="r.example/sglang:new"))
    api.pods = dict(sorted(api.pods.items(), key=lambda kv: not kv[0][1].startswith("new-")))
    order = _conditions_written(api)
    done = pf.run_once()
    assert len(done.held) == 3
    held = [i for i, what in enumerate(order) if what.endswith("ImageUnusable")]
    assert len(held) == 3 and max(held) < 3 + 8, order[: max(held) + 1]  # 8 = PASS_WORKERS


def test_pods_whose_preflight_answered_are_decided_before_new_preflights_are_created() -> None:
    # Seen on the node (200 pods): a pass that created preflights for newly seen images
    # first kept an answered image's pods waiting up to 3 s behind those creates.
    pf, api, _, _ = setup()
    for i in range(3):
        api.add(gated_pod(f"bad-{i}", image="r.example/sglang:bad"))
    pf.run_once()
    api.finish(api.preflights()[0], 1, BAD)
    for i in range(NEW_PER_NAMESPACE):
        api.add(gated_pod(f"new-{i}", image=f"r.example/sglang:new-{i}"))
    order: list[str] = []
    create, write = api.create_pod, api.set_condition

    def created(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        order.append("create")
        return create(namespace, body)

    def written(namespace: str, name: str, uid: str, condition: dict[str, Any]) -> None:
        order.append(f"{name} {condition['reason']}")
        write(namespace, name, uid, condition)

    api.create_pod = created  # type: ignore[method-assign]
    api.set_condition = written  # type: ignore[method-assign]
    done = pf.run_once()
    assert len(done.held) == 3 and len(done.created) == NEW_PER_NAMESPACE
    assert sorted(order[:3]) == [f"bad-{i} ImageUnusable" for i in range(3)], order[:5]
    assert order.count("create") == NEW_PER_NAMESPACE


# -- what a pass holds, whatever the tenants' pods are like -----------------------------


class StreamingApi(MemoryApi):
    """Reads like the real API: each pod parsed anew as it is listed or read, with the
    bulk a tenant's own worker may carry (``pad``), so that only the pass decides what
    stays in memory."""

    def __init__(self, clock: Clock, pad: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(clock)
        self.pad = pad

    def unscheduled_probed_pods(self, namespace: str | None = None) -> Iterator[dict[str, Any]]:
        for p in super().unscheduled_probed_pods(namespace):
            if p["metadata"]["name"].startswith("big-"):
                self.pad(p)
            yield p

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        p = super().read_pod(namespace, name)
        if p is not None and name.startswith("big-"):
            self.pad(p)
        return p

    def create_pod(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        # The API server keeps what is created, not the pass: only its name is stored here
        # (and what it answers is what was sent).
        super().create_pod(namespace, {"metadata": dict(body["metadata"])})
        return body


def _one_string(p: dict[str, Any]) -> None:
    # 1.4 MB in one env value, as etcd allows.
    p["spec"]["containers"][0]["env"] = [{"name": "PAD", "value": "x" * 1_400_000}]


def _many_entries(p: dict[str, Any]) -> None:
    # Small env entries and tolerations: 50,000 of them (1.4 MB as JSON) are ~12 MB once
    # parsed; a fifth of that here keeps the test quick, the ratio is the same.
    spec = p["spec"]
    spec["containers"][0]["env"] = [{"name": f"E{i}", "value": "x"} for i in range(5_000)]
    spec["tolerations"] = [{"key": f"k{i}", "operator": "Exists"} for i in range(5_000)]


def _long_owner(p: dict[str, Any]) -> None:
    # The API server checks no length in an ownerReference: a 1.4 MB owner name was kept
    # by the pass for every waiting pod.
    p["metadata"]["ownerReferences"][0]["name"] = "x" * 1_400_000


def _many_pull_secrets(p: dict[str, Any]) -> None:
    # Nor a count of imagePullSecrets: each name was kept by each key of each pod.
    p["spec"]["imagePullSecrets"] = [{"name": f"s-{i:05}-{'x' * 20}"} for i in range(50_000)]


def _peak(run: Callable[[], Any]) -> tuple[Any, int]:
    import tracemalloc

    tracemalloc.start()
    try:
        out = run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak


@pytest.mark.parametrize(
    "pad",
    [_one_string, _many_entries, _long_owner, _many_pull_secrets],
    ids=["one-string", "many-entries", "long-owner", "many-pull-secrets"],
)
@pytest.mark.parametrize("images", [1, 16], ids=["one-image", "sixteen-images"])
def test_a_pass_holds_a_bounded_number_of_huge_pods_however_many_wait(
    pad: Callable[[dict[str, Any]], None], images: int
) -> None:
    pf, _, clock, _ = setup()
    api = StreamingApi(clock, pad)
    pf.api = api
    for i in range(24):
        api.add(gated_pod(f"big-{i:02}", image=f"r.example/sglang:{i % images}", owner="rs"))
    one, size = _peak(lambda: api.read_pod("ml", "big-00"))
    assert one is not None
    done, peak = _peak(pf.run_once)
    # 50,000 pull secrets make a preflight over MAX_PREFLIGHT_BYTES: none is made, and
    # onError=open opens the pods at once.
    made = 0 if pad is _many_pull_secrets else images
    assert done.pods == 24 and len(done.created) == made
    assert len(done.ungated) == (24 if made == 0 else 0)
    # Held whole, 24 such pods would be 24 x size (16 of them, the first of each image,
    # before this bound); a pass holds the one being read, and
    # WHOLE_PODS at a time to make preflights from (each with the preflight made).
    assert peak < 8 * size, f"peak {peak / 1e6:.1f} MB, one pod {size / 1e6:.1f} MB"
    waiting = api.pod("ml", "big-23")
    reason = "PreflightFailedGateOpened" if made == 0 else "PreflightRunning"
    assert waiting["status"]["conditions"][0]["reason"] == reason


def test_one_namespace_starts_at_most_a_bounded_number_of_preflights_a_pass() -> None:
    pf, api, _, _ = setup()
    for i in range(NEW_PER_NAMESPACE + 5):
        api.add(gated_pod(f"w-{i:02}", image=f"r.example/sglang:new-{i:02}"))
    api.add(gated_pod("other-team", image="r.example/sglang:new-00", namespace="team-b"))
    first = pf.run_once()
    # Every other namespace's preflight starts at once; the rest of this one's next pass.
    assert len(first.created) == NEW_PER_NAMESPACE + 1
    assert "Pod team-b/" in " ".join(first.created)
    late = api.pod("ml", f"w-{NEW_PER_NAMESPACE + 4:02}")["status"]["conditions"][0]
    assert late["reason"] == "PreflightRunning"
    assert "other images of this namespace are having their preflights started" in late["message"]
    second = pf.run_once()
    assert len(second.created) == 5
    assert len(api.preflights()) == NEW_PER_NAMESPACE + 6


def test_a_pass_starts_creates_for_a_bounded_time_spread_over_the_namespaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Seen on the node (200 pods, 100 new images): one pass that made 78 preflights took
    # 13.8 s, and every preflight that ended meanwhile waited for it to have its pods
    # decided.
    monkeypatch.setattr(gatekeeper, "PASS_WORKERS", 1)  # one create at a time: exact
    pf, api, _, _ = setup()
    elapsed = [0.0]  # the pass's clock: each create takes a quarter of the budget
    pf.monotonic = lambda: elapsed[0]
    create = api.create_pod

    def slow_create(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        elapsed[0] += CREATE_SECONDS / 4
        return create(namespace, body)

    api.create_pod = slow_create  # type: ignore[method-assign]
    namespaces = [f"team-{n}" for n in range(6)]
    for n, namespace in enumerate(namespaces):
        for i in range(8):
            api.add(gated_pod(f"w-{i}", image=f"r.example/sglang:{n}-{i}", namespace=namespace))
    # One namespace past NEW_PER_NAMESPACE too: its own deferral says its own reason.
    for i in range(NEW_PER_NAMESPACE + 1):
        api.add(gated_pod(f"w-{i}", image=f"r.example/sglang:big-{i}", namespace="big"))
    first = pf.run_once()
    # Creates start until the budget is spent (the last one started finishes): 5, each
    # namespace's first image before any second; the rest wait for the next passes.
    assert len(first.created) == 5
    # (in the order the pods are listed: the teams first here)
    assert {c.split("/")[0] for c in first.created} == {f"Pod team-{n}" for n in range(5)}
    assert first.deferred == 6 * 8 + NEW_PER_NAMESPACE - 5

    def says(namespace: str, name: str, words: str) -> bool:
        return any(words in c["message"] for c in api.pod(namespace, name)["status"]["conditions"])

    assert sum(says(ns, f"w-{i}", "other images are being started first")
               for ns in namespaces for i in range(8)) == 6 * 8 - 5  # fmt: skip
    assert says("big", f"w-{NEW_PER_NAMESPACE}", "other images of this namespace")
    passes = 1
    while len(api.preflights()) < 6 * 8 + NEW_PER_NAMESPACE + 1 and passes < 50:
        assert pf.run_once().created
        passes += 1
    assert len(api.preflights()) == 6 * 8 + NEW_PER_NAMESPACE + 1


def test_a_waiting_pods_slim_copy_ungates_it_at_the_gates_place() -> None:
    pf, api, _, _ = setup()
    pod = gated_pod("w")
    pod["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}, {"name": GATE}]
    api.add(pod)
    pf.run_once()
    api.finish(api.preflights()[0], 0, CLEAR)
    done = pf.run_once()
    assert done.ungated == ["Pod ml/w"]
    assert api.pod("ml", "w")["spec"]["schedulingGates"] == [{"name": "kueue.x-k8s.io/admission"}]


def test_a_waiting_pods_slim_copy_keeps_none_of_the_tenants_own_gates() -> None:
    """65,000 gates of its own before epguard's (the API server sets no count) were kept
    as a list that long in each waiting pod's slim copy, for the whole pass: ~0.5 MB a
    1 MB pod, a controller OOM with a few hundred such pods. The gate still comes off at
    its place."""
    import tracemalloc

    from epguard.webhook.controller.gatekeeper import _slim

    own = [{"name": f"g{i}"} for i in range(50_000)]
    pod = gated_pod("w")
    pod["spec"]["schedulingGates"] = [*own, {"name": GATE}]
    tracemalloc.start()
    try:
        slim = _slim(pod)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 16 * 1024
    pf, api, _, _ = setup()
    api.add(pod)
    pf.run_once()
    api.finish(api.preflights()[0], 0, CLEAR)
    assert pf.run_once().ungated == ["Pod ml/w"]
    assert api.pod("ml", "w")["spec"]["schedulingGates"] == own
    assert slim["spec"]["schedulingGates"] == [{"name": GATE}]


def test_an_image_reference_that_does_not_parse_is_no_key() -> None:
    """The webhook gates no pod for such an image (preflight.unjudged); a key would keep
    the pod's string, which the API server lets be 700 KB, for the whole pass."""
    from epguard.webhook.controller.gatekeeper import worker_keys

    pod = gated_pod("w")
    good = pod["spec"]["containers"][0]
    bad = {**good, "name": "w2", "image": "Bad/" + "x" * 700_000}
    pod["spec"]["containers"].append(bad)
    assert [k.image for k in worker_keys(pod)] == [good["image"]]


def test_a_preflight_too_big_to_copy_is_decided_by_on_error() -> None:
    # Its creates run side by side, each holding its preflight: a worker's placement of
    # 1 MiB is not copied, and its pods are decided as when a preflight cannot run.
    from epguard.webhook.controller.gatekeeper import MAX_PREFLIGHT_BYTES

    pf, api, _, _ = setup()
    pod = gated_pod("w")
    n = MAX_PREFLIGHT_BYTES // 30
    pod["spec"]["tolerations"] = [{"key": f"k{i}", "operator": "Exists"} for i in range(n)]
    api.add(pod)
    done = pf.run_once()
    assert done.created == [] and done.ungated == ["Pod ml/w"]
    said = api.pod("ml", "w")["status"]["conditions"][0]
    assert said["reason"] == "PreflightFailedGateOpened"
    assert f"more than {MAX_PREFLIGHT_BYTES:,}" in said["message"]


# -- a preflight's answer, decided at once -----------------------------------------------


def test_an_answer_run_decides_only_its_namespaces_answered_pods_and_makes_nothing() -> None:
    pf, api, _, _ = setup()
    for name in ("w-0", "w-1"):
        api.add(gated_pod(name))
    api.add(gated_pod("w-0", namespace="team-b"))
    pf.run_once()
    ml, team_b = sorted(api.preflights(), key=lambda p: p["metadata"]["namespace"])
    api.finish(ml, 0, CLEAR)
    api.finish(team_b, 1, BAD)
    api.add(gated_pod("w-new", image="r.example/sglang:newer"))  # no preflight yet
    api.lists.clear()
    done = pf.answer(["ml"])
    assert sorted(done.ungated) == ["Pod ml/w-0", "Pod ml/w-1"]
    assert api.lists == ["ml", "ml"]  # its namespace's preflights and gated pods only
    assert done.created == [] and done.deleted == [] and len(api.preflights()) == 2
    assert is_gated(api.pod("ml", "w-new"))
    assert all(c["type"] != CONDITION for c in api.pod("ml", "w-new").get("status", {}).get(
        "conditions", []))  # fmt: skip
    assert all(c["reason"] != "ImageUnusable" for c in api.pod("team-b", "w-0")["status"][
        "conditions"])  # fmt: skip
    # The next pass does the rest, and nothing twice.
    events = len(api.events)
    later = pf.run_once()
    assert later.ungated == [] and later.held == ["Pod team-b/w-0"]
    assert later.created == ["Pod ml/" + next(
        p["metadata"]["name"] for p in api.preflights()
        if p["metadata"]["namespace"] == "ml" and "status" not in p)]  # fmt: skip
    assert len(api.events) == events + 1  # the held pod's (it has no owner)


def _answer_while_the_pass_lists(
    pf: Preflights, api: MemoryApi, before: Callable[[], None] = lambda: None
) -> None:
    """The next pass lists the gated pods as they are, then an answer run of "ml" runs
    (after ``before``) and decides them before the pass does, from the pass's list."""
    real = api.unscheduled_probed_pods

    def listing(namespace: str | None = None) -> Iterator[dict[str, Any]]:
        listed = list(real(namespace))
        if namespace is None:
            before()
            pf.answer(["ml"])
        return iter(listed)

    api.unscheduled_probed_pods = listing  # type: ignore[method-assign]


def test_a_pass_and_an_answer_run_deciding_one_pod_write_it_once() -> None:
    """Each decides from its own list: a pass that listed the pods before the answer run
    wrote their condition held them again (a second condition with a later
    lastTransitionTime, the Events posted again)."""
    pf, api, _, _ = setup()
    for i in range(3):
        api.add(gated_pod(f"w-{i}"))
    pf.run_once()
    api.finish(api.preflights()[0], 1, BAD)
    writes = _conditions_written(api)
    _answer_while_the_pass_lists(pf, api)
    assert pf.run_once().held == []  # the answer run held them
    assert sorted(writes) == [f"w-{i} ImageUnusable" for i in range(3)]  # once each
    assert len([e for e in api.events if e[2] == "ImageUnusable"]) == 3


def test_a_pass_that_listed_before_an_answer_does_not_undo_its_decision() -> None:
    """The pass listed the preflight running; it ended and the answer run took the gate
    off while the pass went on: the pass then wrote "waiting for the preflight" on the
    opened pod, which no later pass reads again (it is no longer gated)."""
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.add(gated_pod("w-1"))  # created since: no condition yet
    _answer_while_the_pass_lists(pf, api, lambda: api.finish(api.preflights()[0], 0, CLEAR))
    pf.run_once()
    pod = api.pod("ml", "w-1")
    assert not is_gated(pod)
    cond = next(c for c in pod["status"]["conditions"] if c["type"] == CONDITION)
    assert (cond["status"], cond["reason"]) == ("True", "PreflightPassed")


def test_a_condition_another_replica_changed_since_is_written_again() -> None:
    """A replica that leads again holds what it wrote before the failover: the other
    replica's condition since then (a retried preflight, running) is what a new list
    shows, and the same decision as before is written again."""
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 1, BAD)
    assert pf.answer(["ml"]).held == ["Pod ml/w-0"]
    other = {"type": CONDITION, "status": "False", "reason": "PreflightRunning", "message": "x"}
    api.set_condition("ml", "w-0", api.pod("ml", "w-0")["metadata"]["uid"], other)
    assert pf.run_once().held == ["Pod ml/w-0"]
    cond = next(c for c in api.pod("ml", "w-0")["status"]["conditions"] if c["type"] == CONDITION)
    assert cond["reason"] == "ImageUnusable"


@pytest.mark.parametrize(
    "error", [ApiException(status=500, reason="etcd timeout"), TimeoutError("read timed out")]
)
def test_a_failed_condition_write_is_tried_again(error: Exception) -> None:
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 1, BAD)
    real = api.set_condition

    def failing(namespace: str, name: str, uid: str, condition: dict[str, Any]) -> None:
        raise error

    api.set_condition = failing  # type: ignore[method-assign]
    pf.answer(["ml"])
    api.set_condition = real  # type: ignore[method-assign]
    assert pf.run_once().held == ["Pod ml/w-0"]


def _answers(ring: Keyring | None) -> gatekeeper.Answers:
    return gatekeeper.Answers(lambda: ring, timeout_seconds=300)


def test_only_epguards_own_finished_preflight_counts_as_an_answer() -> None:
    pf, api, _, ring = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    preflight = api.preflights()[0]

    async def noted(body: dict[str, Any], held: Keyring | None = ring) -> bool:
        answers = _answers(held)
        said = answers.note(kopf.Body(copy.deepcopy(body)), NOW)
        assert answers.take() == (["ml"] if said else [])
        return said

    assert not asyncio.run(noted(preflight))  # still running
    api.finish(preflight, 1, BAD)
    assert asyncio.run(noted(preflight))
    assert not asyncio.run(noted(preflight, held=None))  # no keys held: the passes decide
    forged = copy.deepcopy(preflight)
    forged["spec"]["initContainers"][-1]["image"] = "r.example/tenant:any"
    assert not asyncio.run(noted(forged))  # a tenant's pod labelled as one: no answer
    assert not asyncio.run(noted(api.pod("ml", "w-0")))  # a gated worker


def test_an_answer_wakes_the_answer_loop_which_decides_its_pods_not_a_pass() -> None:
    pf, api, _, ring = setup()
    api.add(gated_pod("w-0"))
    api.add(gated_pod("w-0", namespace="team-b"))
    pf.run_once()
    for p in api.preflights():
        api.finish(p, 0, CLEAR)
    answered: list[list[str]] = []
    real = pf.answer

    def answer(namespaces: Any) -> gatekeeper.Pass:
        answered.append(sorted(namespaces))
        return real(namespaces)

    pf.answer = answer  # type: ignore[method-assign]

    async def scenario() -> None:
        memo = kopf.Memo()
        wake = memo["preflight_wake"] = gatekeeper._Wake()
        answers = memo["preflight_answers"] = _answers(ring)
        stop = asyncio.Event()
        loop = asyncio.create_task(gatekeeper._answer_loop(pf, answers, stop))
        for p in api.preflights():
            await gatekeeper._pod_event(memo=memo, body=kopf.Body(copy.deepcopy(p)), type=None)
        assert wake.is_set() and not answers.namespaces  # kopf's listing: a pass decides
        wake.clear()
        for p in api.preflights():
            await gatekeeper._pod_event(
                memo=memo, body=kopf.Body(copy.deepcopy(p)), type="MODIFIED"
            )
        assert not wake.is_set()  # no whole pass for an answer
        for _ in range(200):
            if not is_gated(api.pod("ml", "w-0")) and not is_gated(api.pod("team-b", "w-0")):
                break
            await asyncio.sleep(0.01)
        stop.set()
        await loop
        await gatekeeper._pod_event(memo=memo, body=kopf.Body(gated_pod("w-1")), type="ADDED")
        assert wake.is_set()  # a gated pod's event still wakes a pass

    asyncio.run(scenario())
    assert not is_gated(api.pod("ml", "w-0")) and not is_gated(api.pod("team-b", "w-0"))
    assert sorted(answered) == [["ml"], ["team-b"]]  # a run each, side by side


def test_an_opened_pods_condition_waits_for_a_write_in_flight_and_says_opened() -> None:
    """A pass writes "waiting" (its list saw the preflight running) while the preflight
    ends and an answer run opens the pod: the answer run's condition was skipped for the
    write in flight, and the opened pod said "waiting" for good."""
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.add(gated_pod("w-1"))  # no condition yet: the next pass writes "waiting" on it
    real = api.set_condition
    writing, release = threading.Event(), threading.Event()

    def slow(namespace: str, name: str, uid: str, condition: dict[str, Any]) -> None:
        if condition["reason"] == "PreflightRunning":
            writing.set()
            assert release.wait(10)
        real(namespace, name, uid, condition)

    api.set_condition = slow  # type: ignore[method-assign]
    passing = threading.Thread(target=pf.run_once)
    passing.start()
    assert writing.wait(10)
    api.finish(api.preflights()[0], 0, CLEAR)
    answering = threading.Thread(target=pf.answer, args=(["ml"],))
    answering.start()
    time.sleep(0.2)  # the answer run has opened the pod and waits for the write
    release.set()
    passing.join(10)
    answering.join(10)
    pod = api.pod("ml", "w-1")
    assert not is_gated(pod)
    cond = next(c for c in pod["status"]["conditions"] if c["type"] == CONDITION)
    assert (cond["status"], cond["reason"]) == ("True", "PreflightPassed")


def test_a_pass_and_an_answer_run_list_at_most_two_at_once() -> None:
    pf, api, _, _ = setup()
    for ns in ("a", "b", "c", "d"):
        api.add(gated_pod("w-0", namespace=ns))
    pf.run_once()
    for p in api.preflights():
        api.finish(p, 1, BAD)
    real = api._probed
    listing, now, most = threading.Condition(), [0], [0]

    def counted(namespace: str | None) -> Iterator[dict[str, Any]]:
        # Each list waits (up to 0.5 s) for a third beside it: with the bound, two lists
        # always meet and the third never comes; without it, the third does.
        with listing:
            now[0] += 1
            most[0] = max(most[0], now[0])
            listing.notify_all()
            listing.wait_for(lambda: now[0] > gatekeeper.LISTS, timeout=0.5)
        try:
            yield from real(namespace)
        finally:
            with listing:
                now[0] -= 1

    api._probed = counted  # type: ignore[method-assign]
    passing = threading.Thread(target=pf.run_once)
    passing.start()
    pf.answer(["a", "b", "c", "d"])
    passing.join(10)
    assert most[0] == gatekeeper.LISTS == 2
    for ns in "abcd":
        cond = next(c for c in api.pod(ns, "w-0")["status"]["conditions"] if c["type"] == CONDITION)
        assert cond["reason"] == "ImageUnusable"


def test_the_record_of_written_conditions_keeps_only_gated_pods() -> None:
    pf, api, _, _ = setup()
    for i in range(3):
        api.add(gated_pod(f"w-{i}"))
    pf.run_once()
    assert len(pf._written) == 3  # "waiting", each
    api.finish(api.preflights()[0], 0, CLEAR)
    pf.run_once()  # opened: no longer gated
    pf.run_once()
    assert pf._written == {}


def test_one_namespaces_list_reads_answer_pages() -> None:
    calls: list[tuple[str, int]] = []

    class Response:
        data = b'{"metadata": {}, "items": []}'

    class Core:
        def list_namespaced_pod(self, namespace: str, limit: int, **_: Any) -> Response:
            calls.append((namespace, limit))
            return Response()

        def list_pod_for_all_namespaces(self, limit: int, **_: Any) -> Response:
            calls.append(("*", limit))
            return Response()

    api = KubePreflightApi(client.ApiClient())
    api.core = Core()  # type: ignore[assignment]
    list(api.unscheduled_probed_pods("ml"))
    list(api.preflight_pods())
    assert calls == [("ml", gatekeeper.ANSWER_PAGE), ("*", gatekeeper.POD_PAGE)]


def test_an_image_cause_holds_a_pod_whose_other_image_is_still_being_judged() -> None:
    """A pod with two elastic-EP containers on two images: one image's cause holds it at
    once, in an answer run as in a pass, whatever the other preflight says yet (the
    answer run waited for both, and only a pass held it)."""
    pf, api, _, _ = setup()
    pod = gated_pod("w-0")
    second = copy.deepcopy(pod["spec"]["containers"][0])
    second.update(name="worker-b", image="r.example/sglang:other")
    pod["spec"]["containers"].append(second)
    api.add(pod)
    pf.run_once()
    assert len(api.preflights()) == 2
    bad = next(p for p in api.preflights()
               if p["spec"]["initContainers"][-1]["image"] == "r.example/sglang:new")  # fmt: skip
    api.finish(bad, 1, BAD)
    assert pf.answer(["ml"]).held == ["Pod ml/w-0"]
    api.pods.pop(("ml", next(p["metadata"]["name"] for p in api.preflights() if p is not bad)))
    assert pf.run_once().held == []  # already held; the other image's preflight is made again


@pytest.mark.parametrize(
    "errors",
    [
        [ApiException(status=500, reason="etcd timeout"), TimeoutError("read timed out")],
        [TimeoutError("read timed out"), ApiException(status=429, reason="throttled")],
    ],
)
def test_an_opened_pods_condition_is_tried_again_when_its_write_fails(
    errors: list[Exception], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pass lists a pod once its gate is gone: a failed write of its condition left
    the "waiting" one for good."""
    monkeypatch.setattr(gatekeeper, "OPENED_BACKOFF", 0.0)
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 0, CLEAR)
    real = api.set_condition
    left = list(errors)

    def flaky(namespace: str, name: str, uid: str, condition: dict[str, Any]) -> None:
        if left:
            raise left.pop(0)
        real(namespace, name, uid, condition)

    api.set_condition = flaky  # type: ignore[method-assign]
    assert pf.answer(["ml"]).ungated == ["Pod ml/w-0"]
    cond = next(c for c in api.pod("ml", "w-0")["status"]["conditions"] if c["type"] == CONDITION)
    assert (cond["status"], cond["reason"]) == ("True", "PreflightPassed")


# -- a pod proven unusable stays held; nothing but a clear answer opens it ----------------


def _held(on_error: str = "open") -> tuple[Preflights, MemoryApi, Clock, Keyring | None]:
    pf, api, clock, ring = setup(on_error=on_error)
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 1, BAD)
    assert pf.run_once().held == ["Pod ml/w-0"]
    return pf, api, clock, ring


def _condition_of(api: MemoryApi, name: str, namespace: str = "ml") -> dict[str, Any]:
    """The pod's epguard condition ({} when it has none)."""
    conditions = api.pod(namespace, name).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == CONDITION), {})


def _reason(api: MemoryApi, name: str) -> str:
    return str(_condition_of(api, name)["reason"])


def test_a_held_pod_whose_preflight_is_deleted_stays_held_while_it_runs_again() -> None:
    # The pod garbage collector or an admin's `delete pods --field-selector
    # status.phase==Failed` removes the finished preflight: the new one was charged the
    # held pod's age and read as overdue, and onError=open removed the gate.
    pf, api, clock, _ = _held()
    clock.now += dt.timedelta(seconds=400)  # past the deadline counted from the pod
    del api.pods[("ml", api.preflights()[0]["metadata"]["name"])]
    done = pf.run_once()
    assert len(done.created) == 1 and done.ungated == []
    assert is_gated(api.pod("ml", "w-0")) and _reason(api, "w-0") == "ImageUnusable"
    api.finish(api.preflights()[0], 1, BAD)
    assert pf.run_once().ungated == [] and is_gated(api.pod("ml", "w-0"))


def test_a_held_pod_is_not_opened_by_a_preflight_that_cannot_run_again() -> None:
    pf, api, _, _ = _held()
    del api.pods[("ml", api.preflights()[0]["metadata"]["name"])]
    pf.run_once()
    api.finish(api.preflights()[0], 128, "")  # the new one could not start: no answer
    done = pf.run_once()
    assert done.ungated == [] and _reason(api, "w-0") == "ImageUnusable"


def test_a_held_pod_is_opened_when_its_image_is_found_clear_again() -> None:
    # An admin deletes a mistaken verdict and the preflight: the new answer decides.
    pf, api, _, _ = _held()
    del api.pods[("ml", api.preflights()[0]["metadata"]["name"])]
    pf.run_once()
    api.finish(api.preflights()[0], 0, CLEAR)
    assert pf.run_once().ungated == ["Pod ml/w-0"]


@pytest.mark.parametrize("change", ["rotated past", "replaced", "older format"])
def test_a_preflight_signed_with_a_key_no_longer_held_is_made_again(change: str) -> None:
    # Three rotations (30 days each) or a replaced Secret: the retained preflight no
    # longer verifies. It read as a tenant's pod under its name, and its held pods were
    # opened (onError=open) or held for good and never retried (hold). So does one an
    # older epguard signed (a format that signed less) after an upgrade.
    for on_error in ("open", "hold"):
        pf, api, _, ring = _held(on_error)
        assert ring is not None
        if change == "replaced":
            pf.keys.ring = new_keyring(NOW)  # type: ignore[attr-defined]
        elif change == "older format":  # as the epguard before this one signed it
            made = api.preflights()[0]
            made["metadata"]["annotations"][SIGNATURE_ANNOTATION] = sign(
                ring.current, "ml", made, NOW, fmt="v2"
            )
        else:
            for _ in range(MAX_KEYS):  # the key that signed it is no longer kept
                ring = rotated(ring, NOW)
            pf.keys.ring = ring  # type: ignore[attr-defined]
        old = api.preflights()[0]["metadata"]["uid"]
        done = pf.run_once()
        assert done.ungated == [] and len(done.deleted) == 1, (on_error, done)
        assert is_gated(api.pod("ml", "w-0")) and _reason(api, "w-0") == "ImageUnusable"
        done = pf.run_once()
        (made,) = api.preflights()
        assert done.created and made["metadata"]["uid"] != old, on_error


def test_an_answer_read_in_time_is_not_overdue_because_the_list_was_slow() -> None:
    # The preflight answers at 299.5 s of a 300 s deadline while the pass lists the gated
    # pods (4 s): it was judged with the clock read after the list, "did not finish".
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    clock.now = NOW + dt.timedelta(seconds=299)
    real = api.unscheduled_probed_pods

    def slow(namespace: str | None = None) -> Iterator[dict[str, Any]]:
        listed = list(real(namespace))
        api.finish(api.preflights()[0], 1, BAD)
        clock.now = NOW + dt.timedelta(seconds=303)
        return iter(listed)

    api.unscheduled_probed_pods = slow  # type: ignore[method-assign]
    assert pf.run_once().ungated == []
    api.unscheduled_probed_pods = real  # type: ignore[method-assign]
    assert pf.run_once().held == ["Pod ml/w-0"]


def test_an_older_pass_does_not_open_a_pod_a_newer_answer_run_held() -> None:
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    clock.now = NOW + dt.timedelta(seconds=301)  # the pass will find it overdue
    real = api.unscheduled_probed_pods
    held: list[str] = []

    def listing(namespace: str | None = None) -> Iterator[dict[str, Any]]:
        listed = list(real(namespace))
        if namespace is None:  # the pass's list is read; then the answer and its run
            api.finish(api.preflights()[0], 1, BAD)
            held.extend(pf.answer(["ml"]).held)
        return iter(listed)

    api.unscheduled_probed_pods = listing  # type: ignore[method-assign]
    done = pf.run_once()
    assert held == ["Pod ml/w-0"] and done.ungated == []
    assert is_gated(api.pod("ml", "w-0")) and _reason(api, "w-0") == "ImageUnusable"


def test_the_gate_of_another_pod_made_under_the_same_name_stays() -> None:
    # A StatefulSet's pod deleted and made again (new uid, new image) between the list
    # and the patch: the patch removed the new pod's gate, unjudged.
    pf, api, _, _ = setup()
    api.add(gated_pod("sglang-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 0, CLEAR)
    real = api.patch_pod

    def made_again(namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        del api.pods[(namespace, name)]
        api.add(gated_pod(name, image="r.example/sglang:unjudged"))
        real(namespace, name, ops)

    api.patch_pod = made_again  # type: ignore[method-assign]
    assert pf.run_once().ungated == []
    assert is_gated(api.pod("ml", "sglang-0"))
    api.patch_pod = real  # type: ignore[method-assign]
    done = pf.run_once()
    assert len(done.created) == 1 and done.ungated == []  # its own image's preflight


def test_an_api_error_on_create_waits_and_the_deadline_still_bounds_it() -> None:
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))

    def failing(namespace: str, body: dict[str, Any]) -> None:
        raise ApiException(status=500, reason="etcdserver: request timed out")

    api.create_pod = failing  # type: ignore[method-assign]
    assert pf.run_once().ungated == []
    assert "etcdserver" in api.pod("ml", "w-0")["status"]["conditions"][0]["message"]
    assert _passes_for(pf, clock, 300 + 61) == ["Pod ml/w-0"]  # onError=open, at the deadline


def test_refused_creates_do_not_take_the_other_images_places() -> None:
    pf, api, _, _ = setup(on_error="hold")
    for i in range(NEW_PER_NAMESPACE):
        api.add(gated_pod(f"a-{i:02d}", image=f"r.example/refused:{i}"))
    api.add(gated_pod("z-ok", image="r.example/fine:1"))
    real = api.create_pod

    def create(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if "refused" in json.dumps(body):
            raise Refused("denied by the namespace's policy")
        return real(namespace, body)

    api.create_pod = create  # type: ignore[method-assign]
    pf.run_once()  # 16 refused, z-ok deferred
    assert api.preflights() == []
    pf.run_once()  # the refused go last: z-ok's preflight is made
    assert len(api.preflights()) == 1


def test_one_namespaces_slow_list_does_not_hold_up_anothers_answer() -> None:
    pf, api, _, _ = setup()
    for ns in ("b-fast", "a-slow"):
        api.add(gated_pod("w-0", namespace=ns))
    pf.run_once()
    for p in api.preflights():
        api.finish(p, 1, BAD)
    real = api.unscheduled_probed_pods
    fast_decided = threading.Event()

    def listing(namespace: str | None = None) -> Iterator[dict[str, Any]]:
        if namespace == "a-slow":  # until the other namespace's pod is decided (or 5 s)
            fast_decided.wait(5)
        return real(namespace)

    write = api.set_condition

    def written(namespace: str, name: str, uid: str, condition: dict[str, Any]) -> None:
        write(namespace, name, uid, condition)
        if namespace == "b-fast":
            fast_decided.set()

    api.unscheduled_probed_pods = listing  # type: ignore[method-assign]
    api.set_condition = written  # type: ignore[method-assign]
    started = time.monotonic()
    done = pf.answer(["a-slow", "b-fast"])
    assert sorted(done.held) == ["Pod a-slow/w-0", "Pod b-fast/w-0"]
    assert time.monotonic() - started < 4  # "b-fast" was decided while "a-slow" listed


def test_a_preflight_is_noted_once_however_often_it_changes() -> None:
    pf, api, _, ring = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    preflight = api.preflights()[0]
    api.finish(preflight, 1, BAD)
    answers = _answers(ring)

    async def note_three_times() -> list[list[str]]:
        taken = []
        for i in range(3):  # the kubelet's later reports, a tenant's relabelling
            body = copy.deepcopy(preflight)
            body["metadata"]["labels"]["tenant"] = str(i)
            assert answers.note(kopf.Body(body), NOW)
            taken.append(answers.take())
        return taken

    assert asyncio.run(note_three_times()) == [["ml"], [], []]


def test_a_preflight_made_after_its_pods_deadline_still_gets_its_own_time() -> None:
    # The controller was down past the deadline: the preflight it then makes is judged
    # on its own deadline, not opened at once for the pod's age.
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))
    clock.now += dt.timedelta(seconds=400)
    assert len(pf.run_once().created) == 1
    assert pf.run_once().ungated == [] and is_gated(api.pod("ml", "w-0"))
    api.finish(api.preflights()[0], 1, BAD)
    assert pf.run_once().held == ["Pod ml/w-0"]


def test_a_namespace_answered_during_anothers_slow_run_is_decided_without_waiting() -> None:
    # The namespace noted while another's run lists slowly (its many large gated pods)
    # waited for that whole run before its own began.
    pf, api, _, ring = setup()
    for ns in ("a-slow", "b-fast"):
        api.add(gated_pod("w-0", namespace=ns))
    pf.run_once()
    for p in api.preflights():
        api.finish(p, 1, BAD)
    real = api.unscheduled_probed_pods
    release = threading.Event()

    def listing(namespace: str | None = None) -> Iterator[dict[str, Any]]:
        if namespace == "a-slow":
            release.wait(5)
        return real(namespace)

    api.unscheduled_probed_pods = listing  # type: ignore[method-assign]

    async def scenario() -> None:
        answers = _answers(ring)
        stop = asyncio.Event()
        loop = asyncio.create_task(gatekeeper._answer_loop(pf, answers, stop))
        slow, fast = sorted(api.preflights(), key=lambda p: p["metadata"]["namespace"])
        answers.note(kopf.Body(copy.deepcopy(slow)), NOW)
        await asyncio.sleep(0.2)  # a-slow's run is listing
        answers.note(kopf.Body(copy.deepcopy(fast)), NOW)
        for _ in range(300):
            if _reason_in(api, "b-fast") == "ImageUnusable":
                break
            await asyncio.sleep(0.01)
        decided_first = _reason_in(api, "b-fast") == "ImageUnusable"
        release.set()
        stop.set()
        answers.wake.set()
        await loop
        assert decided_first, "b-fast waited for a-slow's run"

    asyncio.run(scenario())
    assert _reason_in(api, "a-slow") == "ImageUnusable"


def _reason_in(api: MemoryApi, namespace: str) -> str:
    return str(_condition_of(api, "w-0", namespace).get("reason", ""))


def test_keys_left_for_later_after_an_outage_are_not_overdue_at_once() -> None:
    # The controller was down past the deadline; 17 new images in one namespace: the
    # 17th, left to the next pass (16 a pass), was opened at once, never judged.
    pf, api, clock, _ = setup()
    for i in range(NEW_PER_NAMESPACE + 1):
        api.add(gated_pod(f"w-{i:02}", image=f"r.example/sglang:new-{i:02}"))
    clock.now += dt.timedelta(seconds=400)
    done = pf.run_once()
    assert len(done.created) == NEW_PER_NAMESPACE and done.ungated == []
    assert len(pf.run_once().created) == 1


def test_a_held_pods_age_does_not_make_a_new_replicas_key_overdue() -> None:
    # w-0 held 400 s ago; its finished preflight is gone; a new replica on the same image
    # arrives while the API server fails creates: the key was charged w-0's age.
    pf, api, clock, _ = _held()
    clock.now += dt.timedelta(seconds=400)
    del api.pods[("ml", api.preflights()[0]["metadata"]["name"])]
    api.add(gated_pod("w-1"))

    def failing(namespace: str, body: dict[str, Any]) -> None:
        raise ApiException(status=500, reason="etcdserver: request timed out")

    api.create_pod = failing  # type: ignore[method-assign]
    assert pf.run_once().ungated == []
    assert is_gated(api.pod("ml", "w-1")) and is_gated(api.pod("ml", "w-0"))


def test_a_new_replica_waits_while_a_preflight_signed_with_an_old_key_is_made_again() -> None:
    pf, api, clock, ring = _held()
    assert ring is not None
    clock.now += dt.timedelta(seconds=400)
    for _ in range(MAX_KEYS):
        ring = rotated(ring, NOW)
    pf.keys.ring = ring  # type: ignore[attr-defined]
    api.add(gated_pod("w-1"))  # a new replica on the image proven unusable
    assert pf.run_once().ungated == []
    assert pf.run_once().ungated == []  # the new preflight is made
    api.finish(api.preflights()[0], 1, BAD)
    assert sorted(pf.run_once().held) == ["Pod ml/w-1"]  # w-0 says so already


def test_a_preflight_from_a_key_the_other_replica_made_is_read_after_the_secret() -> None:
    # The other replica rotated: its preflight names a key this one has not read yet. The
    # Secret is read again before the preflight is taken for a stale one and deleted.
    pf, api, _, ring = setup()
    assert ring is not None
    newer = rotated(ring, NOW)
    api.add(gated_pod("w-0"))
    pf.keys.ring = newer  # type: ignore[attr-defined]  # the other replica, creating
    pf.run_once()
    pf.keys.ring = ring  # type: ignore[attr-defined]  # this replica, behind
    pf.keys.secret = newer  # type: ignore[attr-defined]
    done = pf.run_once()
    assert done.deleted == [] and pf.keys.rereads == 1  # type: ignore[attr-defined]
    api.finish(api.preflights()[0], 1, BAD)
    assert pf.run_once().held == ["Pod ml/w-0"]


def test_a_hold_for_an_image_cause_ends_when_the_pods_image_is_changed() -> None:
    # The held pod's image is changed (an UPDATE): its old cause no longer holds it, and
    # a new image whose preflight cannot judge is decided by onError (open), not kept
    # gated for good by the old image's condition.
    pf, api, _, _ = _held()
    assert "[preflight epguard-preflight-" in _reason_message(api, "w-0")
    api.pod("ml", "w-0")["spec"]["containers"][0]["image"] = "r.example/sglang:fixed"
    assert len(pf.run_once().created) == 1
    new = next(p for p in api.preflights() if "fixed" in json.dumps(p))
    api.finish(new, 128, "")  # could not judge
    assert pf.run_once().ungated == ["Pod ml/w-0"]


def test_a_tenants_labelled_pod_not_named_as_a_preflight_is_left_alone() -> None:
    pf, api, _, ring = setup()
    assert ring is not None
    api.add(gated_pod("w-0"))
    pf.run_once()
    copied = copy.deepcopy(api.preflights()[0])
    copied["metadata"]["name"] = "my-own"  # its signature names a key no longer held
    for _ in range(MAX_KEYS):
        ring = rotated(ring, NOW)
    pf.keys.ring = ring  # type: ignore[attr-defined]
    api.add(copied)
    done = pf.run_once()
    assert ("ml", "my-own") in api.pods and "Pod ml/my-own" not in done.deleted


def _reason_message(api: MemoryApi, name: str) -> str:
    return str(_condition_of(api, name)["message"])


def test_keys_left_for_later_are_never_overdue_and_an_outage_charges_no_key() -> None:
    # 40 new images in a namespace (16 preflights a pass); then no pass for 390 s (the
    # API server down): the 8 still queued were opened as overdue, never judged.
    pf, api, clock, _ = setup()
    for i in range(40):
        api.add(gated_pod(f"w-{i:02}", image=f"r.example/sglang:new-{i:02}"))
    assert len(pf.run_once().created) == NEW_PER_NAMESPACE
    for p in api.preflights():
        api.finish(p, 1, BAD)
    clock.now += dt.timedelta(seconds=390)
    opened = pf.run_once().ungated + pf.run_once().ungated + pf.run_once().ungated
    assert opened == [] and len(api.preflights()) == 40


def test_a_key_held_up_is_not_charged_the_time_no_pass_ran() -> None:
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))

    def failing(namespace: str, body: dict[str, Any]) -> None:
        raise ApiException(status=500, reason="etcdserver: request timed out")

    api.create_pod = failing  # type: ignore[method-assign]
    pf.run_once()
    clock.now += dt.timedelta(seconds=390)  # no pass ran meanwhile (another replica led)
    assert pf.run_once().ungated == []
    assert _passes_for(pf, clock, 300 + 61) == ["Pod ml/w-0"]  # passes again: the deadline


def test_a_finished_preflight_older_than_the_retention_is_made_again_for_waiting_pods() -> None:
    # A tag pushed again with the fix: the held pods' old answer is not kept for ever.
    pf, api, clock, _ = _held()
    clock.now += dt.timedelta(seconds=3601)
    assert len(pf.run_once().deleted) == 1
    assert len(pf.run_once().created) == 1 and is_gated(api.pod("ml", "w-0"))
    assert _reason(api, "w-0") == "ImageUnusable"  # held while it runs again
    api.finish(api.preflights()[0], 0, CLEAR)
    assert pf.run_once().ungated == ["Pod ml/w-0"]


def test_a_namespace_over_its_pod_quota_waits_for_the_preflight() -> None:
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))

    def over(namespace: str, body: dict[str, Any]) -> None:
        raise Refused('pods "epguard-preflight-x" is forbidden: exceeded quota: pods')

    api.create_pod = over  # type: ignore[method-assign]
    assert pf.run_once().ungated == [] and is_gated(api.pod("ml", "w-0"))
    assert "exceeded quota" in _reason_message(api, "w-0")


def test_the_answer_loop_starts_no_run_once_stopping() -> None:
    pf, api, _, ring = setup()
    for i in range(6):
        api.add(gated_pod("w-0", namespace=f"ns-{i}"))
    pf.run_once()
    for p in api.preflights():
        api.finish(p, 1, BAD)
    release = threading.Event()
    real = api.unscheduled_probed_pods
    listed: list[str | None] = []

    def listing(namespace: str | None = None) -> Iterator[dict[str, Any]]:
        listed.append(namespace)
        release.wait(5)
        return real(namespace)

    api.unscheduled_probed_pods = listing  # type: ignore[method-assign]

    async def scenario() -> None:
        answers = _answers(ring)
        stop = asyncio.Event()
        loop = asyncio.create_task(gatekeeper._answer_loop(pf, answers, stop))
        for p in api.preflights():
            answers.note(kopf.Body(copy.deepcopy(p)), NOW)
        await asyncio.sleep(0.3)  # two runs are listing, four wait for a place
        stop.set()
        answers.wake.set()
        release.set()
        await loop

    asyncio.run(scenario())
    assert len(listed) == gatekeeper.ANSWER_LISTS  # the four waiting never started


def test_keys_whose_create_started_nothing_take_no_place_from_another_image() -> None:
    # 16 keys that never start a preflight (names squatted: every create a 409; or a
    # namespace quota, a 500) kept the namespace's 16 places each pass, and the 17th
    # image waited behind them, "16 other images ... first", for good under open.
    pf, api, clock, _ = setup()
    for i in range(NEW_PER_NAMESPACE):
        api.add(gated_pod(f"s-{i:02}", image=f"r.example/squatted:{i}"))
        (key,) = worker_keys(api.pod("ml", f"s-{i:02}"))
        api.add({"metadata": {"name": key.pod_name, "namespace": "ml"}, "spec": {}})
    api.add(gated_pod("z-queued", image="r.example/sglang:queued"))
    (queued,) = worker_keys(api.pod("ml", "z-queued"))
    pf.run_once()  # the 16 squatted try first; z-queued is left for later
    assert ("ml", queued.pod_name) not in api.pods
    pf.run_once()  # they go last now, and take no place
    assert ("ml", queued.pod_name) in api.pods and is_gated(api.pod("ml", "z-queued"))
    api.finish(api.pod("ml", queued.pod_name), 1, BAD)  # judged: held
    opened = _passes_for(pf, clock, 300 + 61)  # the squatted ones: onError at the deadline
    assert len(opened) == NEW_PER_NAMESPACE and "Pod ml/z-queued" not in opened


def test_a_slow_pass_is_still_a_pass_for_the_held_up_deadline() -> None:
    # Each pass of 66 s (a slow API server): the gap from one pass's start to the next
    # read as "no pass ran", and the held-up clocks were reset every pass, for good.
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))
    (key,) = worker_keys(api.pod("ml", "w-0"))
    api.add({"metadata": {"name": key.pod_name, "namespace": "ml"}, "spec": {}})
    real = api.unscheduled_probed_pods

    def slow(namespace: str | None = None) -> Iterator[dict[str, Any]]:
        clock.now += dt.timedelta(seconds=66)
        return real(namespace)

    api.unscheduled_probed_pods = slow  # type: ignore[method-assign]
    opened: list[str] = []
    for _ in range(8):
        opened += pf.run_once().ungated
    assert opened == ["Pod ml/w-0"]


def test_a_waited_on_preflight_is_not_made_again_sooner_than_its_deadline() -> None:
    # A retention shorter than a preflight's run remade a held image's preflight in every
    # other pass (each a pull, and a GPU under gpus: worker).
    pf, api, clock, _ = setup(retain=0)
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 1, BAD)
    state = api.preflights()[0]["status"]["initContainerStatuses"][0]["state"]
    state["terminated"]["finishedAt"] = (NOW + dt.timedelta(seconds=20)).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    made = 0
    for _ in range(10):  # 100 s, a pass every 10 s
        clock.now += dt.timedelta(seconds=10)
        made += len(pf.run_once().created)
    assert made == 0 and is_gated(api.pod("ml", "w-0"))
    clock.now = NOW + dt.timedelta(seconds=20 + 301)  # the deadline (300 s) after it
    assert len(pf.run_once().deleted) == 1


@pytest.mark.parametrize(
    "status",
    [
        {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: "
         "ephemeral-storage."},
        {"phase": "Failed", "reason": "Terminated", "message": "Pod was terminated in "
         "response to imminent node shutdown."},
        {"phase": "Failed", "conditions": [{"type": "DisruptionTarget", "status": "True",
         "reason": "PreemptionByScheduler", "message": "preempted"}]},
    ],
    ids=["evicted", "node shutdown", "preempted"],
)  # fmt: skip
def test_a_preflight_the_cluster_stopped_is_made_again_not_taken_as_cannot_judge(
    status: dict[str, Any],
) -> None:
    # An evicted (its own pull can fill the disk), preempted or shut-down preflight said
    # "failed", and onError=open opened every waiting pod unjudged.
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.preflights()[0]["status"] = status
    done = pf.run_once()
    assert done.ungated == [] and len(done.deleted) == 1
    assert "stopped by the cluster" in _reason_message(api, "w-0")
    assert len(pf.run_once().created) == 1
    api.finish(api.preflights()[0], 1, BAD)
    assert pf.run_once().held == ["Pod ml/w-0"]


def test_preflights_stopped_again_and_again_still_meet_the_deadline() -> None:
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))
    opened: list[str] = []
    for _ in range(14):  # 420 s: each preflight evicted before it answers
        opened += pf.run_once().ungated
        for p in api.preflights():
            p["status"] = {"phase": "Failed", "reason": "Evicted", "message": "disk"}
        clock.now += dt.timedelta(seconds=30)
    assert opened == ["Pod ml/w-0"]  # onError=open, at the deadline


def test_a_failure_answers_only_for_pods_created_before_it() -> None:
    # A retained "cannot judge" opened every new pod on the image at once, for the whole
    # retention, with no preflight made for them.
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 128, "")  # could not start the probe
    state = api.preflights()[0]["status"]["initContainerStatuses"][0]["state"]
    state["terminated"]["finishedAt"] = NOW.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert pf.run_once().ungated == ["Pod ml/w-0"]  # onError=open
    clock.now += dt.timedelta(seconds=600)
    api.add(gated_pod("w-1"))
    done = pf.run_once()
    assert done.ungated == [] and len(done.deleted) == 1
    assert len(pf.run_once().created) == 1 and is_gated(api.pod("ml", "w-1"))


def test_under_hold_a_preflight_stopped_every_time_is_not_made_again_every_deadline() -> None:
    # Each preflight evicted before it answers (its own pull fills the disk): past the
    # deadline its failure stood for one pass, then it was made again, and again, for
    # good -- the pods flipping between held and waiting.
    pf, api, clock, _ = setup(on_error="hold", retain=3600)
    api.add(gated_pod("w-0"))
    created, reasons = 0, []
    for _ in range(80):  # 40 min, a pass every 30 s
        created += len(pf.run_once().created)
        reasons.append(_reason(api, "w-0"))
        for p in api.preflights():
            p["status"] = {"phase": "Failed", "reason": "Evicted", "message": "disk"}
        clock.now += dt.timedelta(seconds=30)
    assert is_gated(api.pod("ml", "w-0"))
    held = reasons.index("PreflightFailed")
    assert set(reasons[held:]) == {"PreflightFailed"}  # held from the deadline on
    assert created <= 7  # made again only until the deadline, then after the retention


def test_under_hold_a_stopped_preflights_failure_stands_for_the_retention_each_time() -> None:
    # Every preflight evicted (retain 600 s, deadline 300 s), for 4 hours: made again
    # until the deadline, then the failure stands until the retention retries it -- in
    # every cycle, not only the first.
    pf, api, clock, _ = setup(on_error="hold", retain=600)
    api.add(gated_pod("w-0"))
    made: list[int] = []
    for t in range(0, 4 * 3600, 30):
        if pf.run_once().created:
            made.append(t)
        for p in api.preflights():
            p["status"] = {"phase": "Failed", "reason": "Evicted", "message": "disk"}
        clock.now += dt.timedelta(seconds=30)
    runs = [[made[0]]]
    for t in made[1:]:
        if t - runs[-1][-1] <= 120:
            runs[-1].append(t)
        else:
            runs.append([t])
    gaps = [b[0] - a[-1] for a, b in itertools.pairwise(runs)]
    assert len(runs) >= 4 and min(gaps) >= 540, (runs, gaps)  # retried; stood meanwhile
    assert all(r[-1] - r[0] <= 300 + 61 + 60 for r in runs)  # each run ends at a deadline
    assert is_gated(api.pod("ml", "w-0"))


def test_a_pod_created_after_a_stopped_preflights_failure_stood_gets_a_new_one() -> None:
    pf, api, clock, _ = setup()
    api.add(gated_pod("w-0"))
    done = pf.run_once()
    for _ in range(40):  # every preflight evicted: w-0 is opened at the deadline
        for p in api.preflights():
            p["status"] = {"phase": "Failed", "reason": "Evicted", "message": "disk"}
        clock.now += dt.timedelta(seconds=30)
        done = pf.run_once()
        if done.ungated:
            break
    assert done.ungated == ["Pod ml/w-0"]
    clock.now += dt.timedelta(seconds=30)
    api.add(gated_pod("w-1"))  # created after that failure stood
    done = pf.run_once()
    assert done.ungated == [] and is_gated(api.pod("ml", "w-1"))


def test_a_key_the_namespace_keeps_queueing_is_never_overdue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """epguard's own queue is no failure of the image: a namespace that brings a new image
    every pass keeps its other images queued (one place a pass here), with passes running
    all along; past the deadline the queued image was opened unjudged."""
    monkeypatch.setattr(gatekeeper, "NEW_PER_NAMESPACE", 1)
    pf, api, clock, _ = setup()
    api.add(gated_pod("z-0", image="r.example/sglang:queued"))
    opened: list[str] = []
    for i in range(14):  # 14 passes 30 s apart: 420 s, past the 360 s deadline
        api.add(gated_pod(f"a-{i:02}", image=f"r.example/sglang:new-{i:02}"))
        # The API server lists a namespace by name: every new "a-" pod before "z-0".
        api.pods = dict(sorted(api.pods.items()))
        clock.now += dt.timedelta(seconds=30)
        opened += pf.run_once().ungated
    assert "Pod ml/z-0" not in opened
    assert is_gated(api.pod("ml", "z-0"))
    assert "having their preflights started first" in _condition_of(api, "z-0")["message"]


def _opened_pods_writes(
    monkeypatch: pytest.MonkeyPatch, status: int, message: str = ""
) -> tuple[int, list[float]]:
    """An opened pod whose condition write the API server answers with ``status``
    (``message`` in its Status body): how many tries were made, and the waits between."""
    slept: list[float] = []
    clock_only = types.SimpleNamespace(monotonic=time.monotonic, sleep=slept.append)
    monkeypatch.setattr(gatekeeper, "time", clock_only)
    pf, api, _, _ = setup()
    api.add(gated_pod("w-0"))
    pf.run_once()
    api.finish(api.preflights()[0], 0, CLEAR)
    tries: list[str] = []

    def failing(namespace: str, name: str, uid: str, condition: dict[str, Any]) -> None:
        tries.append(name)
        exc = ApiException(status=status, reason="failed")
        exc.body = json.dumps({"message": message})
        raise exc

    api.set_condition = failing  # type: ignore[method-assign]
    assert pf.answer(["ml"]).ungated == ["Pod ml/w-0"]
    return len(tries), slept


@pytest.mark.parametrize(
    "message",
    [
        "etcdserver: request timed out",  # 500
        # A ValidatingAdmissionPolicy's refusal is a 422 (reason Invalid): not the pod
        # gone, so it is the API server's answer, tried again.
        "ValidatingAdmissionPolicy 'x' denied request: no",
    ],
)
def test_an_opened_pods_condition_write_sleeps_only_between_its_tries(
    monkeypatch: pytest.MonkeyPatch, message: str
) -> None:
    """Each try of an opened pod's condition write waits before the next one, never
    after the last: that wait held the deciding thread for nothing."""
    status = 422 if "denied" in message else 500
    tries, slept = _opened_pods_writes(monkeypatch, status, message)
    backoff = gatekeeper.OPENED_BACKOFF
    assert tries == gatekeeper.OPENED_WRITES
    assert slept == [backoff * n for n in range(1, gatekeeper.OPENED_WRITES)]


@pytest.mark.parametrize("status", [404, 409, 422])
def test_an_opened_pod_that_is_gone_is_not_written_again(
    monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    """Found by a review helper: a tenant deleting its pods as their gates came off made
    each condition write fail (404) and be tried OPENED_WRITES times, 1.5 s of a decide
    worker per pod. A pod gone or replaced is final: one try, no wait."""
    assert _opened_pods_writes(monkeypatch, status) == (1, [])


def test_a_tenants_signed_worker_labelled_as_a_preflight_is_not_epguards() -> None:
    """An injected worker's probe is signed too; labelled (and named) as a preflight by its
    tenant, it counted as epguard's own: every pass read it (running, up to 1.5 MiB), each
    end of its probe started an answer run, and the pass could delete it. Only a pod built
    as a preflight (a --files-only probe, which the signature binds) is one."""
    from epguard.webhook.engine.injection import plan

    pf, api, _, ring = setup()
    assert ring is not None
    spec = plan(gated_pod("w")["spec"], InjectionSettings("r.example/epguard:1")).spec
    assert spec is not None
    worker = gated_pod("w")
    worker["spec"] = spec
    key = "0" * 20
    worker["metadata"]["name"] = f"epguard-preflight-{key}"
    worker["metadata"]["labels"].update({PREFLIGHT_LABEL: "true", KEY_LABEL: key})
    stored = {"metadata": {"labels": {PROBED_LABEL: "true"}}, "spec": spec}
    worker["metadata"]["annotations"] = {
        SIGNATURE_ANNOTATION: sign(ring.current, "ml", stored, NOW)
    }
    assert verify(ring, "ml", worker).ok  # genuinely signed: only its shape tells
    api.add(worker)
    api.finish(worker, 1, BAD)

    async def noted(body: dict[str, Any]) -> bool:
        answers = _answers(ring)
        said = answers.note(kopf.Body(copy.deepcopy(body)), NOW)
        assert answers.take() == (["ml"] if said else [])
        return said

    assert not asyncio.run(noted(worker))
    done = pf.run_once()
    assert done.deleted == [] and ("ml", worker["metadata"]["name"]) in api.pods
    # And epguard's own preflight still is.
    api.add(gated_pod("g"))
    pf.run_once()
    (preflight,) = [
        p for p in api.preflights() if p["metadata"]["name"] != f"epguard-preflight-{key}"
    ]
    api.finish(preflight, 1, BAD)
    assert asyncio.run(noted(preflight))


def test_a_pod_of_many_images_is_judged_on_its_first_few() -> None:
    """Found by a review helper: a pod of 1,500 containers on 1,500 images, each asking
    for mooncake, was 1,500 keys in every pass's tables; about a hundred such pods took
    the controller past its memory limit, and each restart listed them again."""
    from epguard.webhook.controller.gatekeeper import MAX_IMAGES, worker_keys

    pod = gated_pod("many")
    worker = pod["spec"]["containers"][0]
    pod["spec"]["containers"] = [
        {**worker, "name": f"w{i}", "image": f"r.example/sglang:{i}"} for i in range(1500)
    ]
    keys = worker_keys(pod)
    assert [k.image for k in keys] == [f"r.example/sglang:{i}" for i in range(MAX_IMAGES)]
    pf, api, _, _ = setup()
    api.add(pod)
    done = pf.run_once()
    assert len(done.created) == MAX_IMAGES
    for preflight in api.preflights():
        api.finish(preflight, 0, CLEAR)
    assert pf.run_once().ungated == ["Pod ml/many"]
