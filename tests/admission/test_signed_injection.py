"""Signed injection over real TLS: /mutate signs the probe it injects, /validate refuses a
pod whose epguard parts are not what was signed, and the controller's check (the same
``signing.verify``) accepts only the signed pod, unchanged."""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from epguard.webhook.engine.signing import (
    FORMAT,
    MAX_KEYS,
    SIGNATURE_ANNOTATION,
    KeyringError,
    keyring_from_secret,
    new_keyring,
    parse_keyring,
    rotated,
    sign,
    verify,
)
from tests.factory import TEST_RULES, container, pod, review
from tests.servers import RunningServer, running_server

INJECT = {"epguard.io/inject": "enabled"}
NOW = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
# A harmless image: no rule refuses it, so any refusal below is about the probe's parts.
GOOD = "lmsysorg/sglang:v0.5.18-cu130"


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tmp_path_factory.mktemp("signed"), TEST_RULES) as s:
        s.runtime.state.keys.set(new_keyring(NOW))
        yield s


def post(server: RunningServer, path: str, body: Any) -> dict[str, Any]:
    with server.client() as client:
        r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    response: dict[str, Any] = r.json()["response"]
    return response


def injected(server: RunningServer, obj: dict[str, Any]) -> dict[str, Any]:
    """The pod as the API server stores it after /mutate."""
    response = post(server, "/mutate", review(obj))
    ops = json.loads(base64.b64decode(response["patch"]))
    out: dict[str, Any] = jsonpatch.apply_patch(obj, ops)
    return out


def worker_pod(**kw: Any) -> dict[str, Any]:
    return pod([container(image=GOOD)], annotations=INJECT, **kw)


def test_the_injected_probe_is_signed_and_verifies(signed: RunningServer) -> None:
    stored = injected(signed, worker_pod())
    assert stored["metadata"]["annotations"][SIGNATURE_ANNOTATION].startswith(f"{FORMAT}:")
    ring = signed.runtime.state.keys.ring
    assert ring is not None and verify(ring, "ml", stored).ok
    assert post(signed, "/validate", review(stored))["allowed"] is True


def test_a_forged_probe_is_refused_naming_what_is_epguards(signed: RunningServer) -> None:
    forged = {
        "name": "epguard-probe",
        "image": GOOD,
        "command": [
            "python3",
            "-c",
            "print('epguard: ...'); raise SystemExit(1)",
            "/epguard/probe",
        ],
        "args": ["--", "python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "mooncake"],
    }
    obj = pod([container(image=GOOD)], init=[forged])
    obj["metadata"]["labels"] = {"epguard.io/probed": "true"}
    response = post(signed, "/validate", review(obj))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "carry no epguard.io/probe-signature" in message
    assert "epguard-*" in message and "epguard.io/inject=enabled" in message


def test_a_signed_pod_with_its_probe_image_patched_is_refused(signed: RunningServer) -> None:
    stored = injected(signed, worker_pod())
    patched = copy.deepcopy(stored)
    patched["spec"]["initContainers"][1]["image"] = "attacker/any:latest"
    response = post(signed, "/validate", review(patched, operation="UPDATE", old=stored))
    assert response["allowed"] is False
    assert "differ from what epguard signed" in response["status"]["message"]
    ring = signed.runtime.state.keys.ring
    assert ring is not None and not verify(ring, "ml", patched).ok


@pytest.mark.parametrize(
    "change",
    [
        lambda p: (
            p["spec"]["initContainers"][1]
            .setdefault("env", [])
            .append({"name": "PYTHONWARNINGS", "value": "error"})
        ),
        lambda p: p["spec"]["initContainers"][0].update(image="attacker/copy:1"),
        # The probe's image names the verdict (engine/outcome.py): patched after the run,
        # the pod is no evidence.
        lambda p: p["spec"]["initContainers"][1].update(image="registry.example.com/victim:1"),
        lambda p: p["spec"]["initContainers"][1]["command"].append("--extra"),
        lambda p: p["spec"]["volumes"][-1].update(emptyDir=None, hostPath={"path": "/"}),
        lambda p: p["spec"]["initContainers"].append({"name": "epguard-extra", "image": "x"}),
        # Issue 21.1: the probe's working dir and the pod's process settings are signed too.
        lambda p: p["spec"]["initContainers"][1].update(workingDir="/tmp/evil"),
        lambda p: p["spec"].update(shareProcessNamespace=True),
        lambda p: p["spec"].update(hostPID=True),
        lambda p: p["spec"].update(securityContext={"runAsUser": 1234}),
        lambda p: p["spec"]["initContainers"][1].update(restartPolicy="Always"),
    ],
    ids=[
        "env",
        "copy-image",
        "probe-image",
        "command",
        "volume",
        "extra-container",
        "working-dir",
        "share-process-namespace",
        "host-pid",
        "pod-user",
        "sidecar-probe",
    ],
)
def test_any_change_to_the_signed_parts_fails_verification(
    signed: RunningServer, change: Any
) -> None:
    stored = injected(signed, worker_pod())
    ring = signed.runtime.state.keys.ring
    assert ring is not None and verify(ring, "ml", stored).ok
    changed = copy.deepcopy(stored)
    change(changed)
    assert "differ from what epguard signed" in verify(ring, "ml", changed).reason
    assert post(signed, "/validate", review(changed))["allowed"] is False


def test_a_signed_spec_copied_to_another_namespace_does_not_verify(signed: RunningServer) -> None:
    stored = injected(signed, worker_pod())
    ring = signed.runtime.state.keys.ring
    assert ring is not None
    assert not verify(ring, "other-team", stored).ok
    copied = copy.deepcopy(stored)
    copied["metadata"]["namespace"] = "other-team"
    body = review(copied)
    body["request"]["namespace"] = "other-team"
    assert post(signed, "/validate", body)["allowed"] is False


def test_the_label_added_to_an_unsigned_pod_is_refused(signed: RunningServer) -> None:
    old = pod([container(image=GOOD)])
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"epguard.io/probed": "true"}
    assert post(signed, "/validate", review(new, operation="UPDATE", old=old))["allowed"] is False


def test_a_pod_without_the_flag_carrying_only_epguards_label_is_refused(
    signed: RunningServer,
) -> None:
    # The chart sends such a pod to /validate (its matchCondition tests the label too):
    # a tenant cannot put pods of its own on the list the controller reads each pass.
    plain = pod([container(image=GOOD, command=["nginx"], args=["-g", "daemon off;"])])
    plain["metadata"]["labels"] = {"epguard.io/probed": "true"}
    response = post(signed, "/validate", review(plain))
    assert response["allowed"] is False
    assert "are epguard's own: remove them" in response["status"]["message"]
    plain["metadata"]["labels"] = {"app": "web"}
    assert post(signed, "/validate", review(plain))["allowed"] is True


def test_an_update_that_leaves_the_parts_as_created_is_allowed(signed: RunningServer) -> None:
    stored = injected(signed, worker_pod())
    stale = copy.deepcopy(stored)
    stale["metadata"]["annotations"][SIGNATURE_ANNOTATION] = "v1:rotated-away:00"
    relabelled = copy.deepcopy(stale)
    relabelled["metadata"]["labels"]["team"] = "a"
    body = review(relabelled, operation="UPDATE", old=stale)
    assert post(signed, "/validate", body)["allowed"] is True


def test_mutate_removes_a_forged_probe_and_signs_its_own(signed: RunningServer) -> None:
    forged = {"name": "epguard-probe", "image": GOOD, "command": ["sh", "-c", "echo forged"]}
    obj = worker_pod()
    obj["spec"]["initContainers"] = [forged]
    obj["metadata"]["annotations"][SIGNATURE_ANNOTATION] = "v1:forged:00"
    stored = injected(signed, obj)
    probes = [c for c in stored["spec"]["initContainers"] if c["name"] == "epguard-probe"]
    assert len(probes) == 1 and "-I" in probes[0]["command"]
    ring = signed.runtime.state.keys.ring
    assert ring is not None and verify(ring, "ml", stored).ok


def test_without_a_key_the_probe_is_injected_unsigned_with_a_warning(
    tmp_path: Path,
) -> None:
    with running_server(tmp_path, TEST_RULES) as unkeyed:
        response = post(unkeyed, "/mutate", review(worker_pod()))
        assert response["allowed"] is True and "patch" in response
        assert any("injected unsigned" in w for w in response["warnings"])
        with unkeyed.client() as client:
            ready = client.get("/readyz").json()
        assert ready["probe_key"] is None and ready["probe_key_error"]


def test_without_a_key_the_label_alone_is_refused_but_not_an_unsigned_probe(
    tmp_path: Path,
) -> None:
    # The label puts a pod on the controller's lists, and no injection makes it without a
    # signature; a signature this replica cannot check may be another replica's.
    with running_server(tmp_path, TEST_RULES) as unkeyed:
        unsigned = injected(unkeyed, worker_pod())
        assert "epguard.io/probed" not in unsigned["metadata"].get("labels", {})
        assert post(unkeyed, "/validate", review(unsigned))["allowed"] is True
        labelled = copy.deepcopy(unsigned)
        labelled["metadata"]["labels"] = {"epguard.io/probed": "true"}
        response = post(unkeyed, "/validate", review(labelled))
        assert response["allowed"] is False
        assert "comes with no epguard.io/probe-signature" in response["status"]["message"]
        # A pod created so before (its parts as created) may still be updated.
        again = post(unkeyed, "/validate", review(labelled, operation="UPDATE", old=labelled))
        assert again["allowed"] is True


def test_a_pod_signed_by_a_keyed_replica_passes_one_without_the_key(
    signed: RunningServer, tmp_path: Path
) -> None:
    stored = injected(signed, worker_pod())
    assert stored["metadata"]["labels"]["epguard.io/probed"] == "true"
    with running_server(tmp_path, TEST_RULES) as unkeyed:
        assert post(unkeyed, "/validate", review(stored))["allowed"] is True


def test_a_reinvocation_without_a_key_takes_epguards_gate_off_with_the_label(
    signed: RunningServer, tmp_path: Path
) -> None:
    # Gated and labelled by a keyed replica; reinvoked (reinvocationPolicy IfNeeded) on one
    # without the key: unlabelled, the pod would wait where the controller never looks.
    stored = injected(signed, worker_pod())
    assert {"name": "epguard.io/preflight"} in stored["spec"]["schedulingGates"]
    with running_server(tmp_path, TEST_RULES) as unkeyed:
        again = injected(unkeyed, stored)
    assert "epguard.io/probed" not in again["metadata"].get("labels", {})
    assert {"name": "epguard.io/preflight"} not in again["spec"].get("schedulingGates", [])


def test_the_keyring_round_trips_and_rotation_keeps_older_keys() -> None:
    ring = new_keyring(NOW)
    again = parse_keyring(ring.to_json())
    assert again == ring
    for i in range(MAX_KEYS + 2):
        ring = rotated(ring, NOW + dt.timedelta(days=i))
    assert len(ring.keys) == MAX_KEYS
    secret = {"data": {"keys.json": base64.b64encode(ring.to_json().encode()).decode()}}
    assert keyring_from_secret(secret) == ring
    assert "secret" not in repr(ring.current) and ring.current.secret.hex() not in repr(ring)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[]",
        '{"keys": []}',
        '{"keys": [{"id": "a", "key": "!!"}]}',
        '{"keys": [{"id": "a", "key": "c2hvcnQ="}]}',
        "x" * 70_000,
    ],
)
def test_a_keyring_that_does_not_parse_is_a_one_line_error(text: str) -> None:
    with pytest.raises(KeyringError) as exc:
        parse_keyring(text)
    assert "\n" not in str(exc.value)


# --- issue 21.1: signed parts replayed around an unsigned neighbour ---------------------


def _hand_made_copy(stored: dict[str, Any]) -> dict[str, Any]:
    """The tenant's pod: the signed parts copied verbatim, without the injection
    annotation (so /mutate never sees it)."""
    copied = copy.deepcopy(stored)
    copied["metadata"]["annotations"].pop("epguard.io/inject", None)
    return copied


_REWRITER = {
    "name": "rewrite",
    "image": GOOD,
    "command": ["sh", "-c", "echo 'print(\"usable\")' > /epguard/probe/__main__.py"],
    "volumeMounts": [{"name": "epguard-probe", "mountPath": "/epguard"}],
}


def _between(p: dict[str, Any]) -> None:
    p["spec"]["initContainers"].insert(1, dict(_REWRITER))


def _between_without_mount(p: dict[str, Any]) -> None:
    p["spec"]["initContainers"].insert(
        1, {k: v for k, v in _REWRITER.items() if k != "volumeMounts"}
    )


def _sidecar_on_the_volume(p: dict[str, Any]) -> None:
    p["spec"]["initContainers"].append(dict(_REWRITER, restartPolicy="Always"))


def _worker_on_the_volume(p: dict[str, Any]) -> None:
    p["spec"]["containers"][0]["volumeMounts"] = _REWRITER["volumeMounts"]


def _ephemeral(p: dict[str, Any]) -> None:
    p["spec"]["ephemeralContainers"] = [{"name": "debug", "image": GOOD}]


def _shared_pid_behind_a_sidecar(p: dict[str, Any]) -> None:
    p["spec"]["initContainers"].insert(
        0, {"name": "mesh", "image": GOOD, "restartPolicy": "Always"}
    )
    p["spec"]["shareProcessNamespace"] = True


@pytest.mark.parametrize(
    "route",
    [
        _between,
        _between_without_mount,
        _sidecar_on_the_volume,
        _worker_on_the_volume,
        _ephemeral,
        _shared_pid_behind_a_sidecar,
    ],
    ids=[
        "neighbour-between-copy-and-probe",
        "neighbour-between-without-mount",
        "native-sidecar-on-the-probe-volume",
        "worker-on-the-probe-volume",
        "ephemeral-container",
        "shared-process-namespace",
    ],
)
def test_signed_parts_around_an_unsigned_neighbour_are_no_evidence(
    signed: RunningServer, route: Any
) -> None:
    """The controller (signing.verify) learns nothing from such a pod, and /validate says
    so (or refuses it when a signed field itself changed)."""
    stored = injected(signed, worker_pod())
    ring = signed.runtime.state.keys.ring
    assert ring is not None and verify(ring, "ml", stored).ok
    hand = _hand_made_copy(stored)
    route(hand)
    checked = verify(ring, "ml", hand)
    assert not checked.ok and checked.reason
    response = post(signed, "/validate", review(hand))
    said = " ".join(response.get("warnings") or []) + (response.get("status") or {}).get(
        "message", ""
    )
    assert "will not be learned" in said or response["allowed"] is False


@pytest.mark.parametrize(
    ("field", "value"),
    [
        # The kubelet mounts its own empty file at the path, over the image's file: the
        # probe then finds the image's mooncake package broken (found by a review helper).
        ("terminationMessagePath", "/usr/local/lib/python3.12/site-packages/mooncake/pg.py"),
        ("terminationMessagePolicy", "File"),
    ],
)
def test_the_probes_termination_message_settings_are_signed(
    signed: RunningServer, field: str, value: str
) -> None:
    stored = injected(signed, worker_pod())
    ring = signed.runtime.state.keys.ring
    assert ring is not None
    # As the API server stores it: the copy container's settings defaulted.
    for c in stored["spec"]["initContainers"]:
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
    assert verify(ring, "ml", stored).ok
    hand = _hand_made_copy(stored)
    probe = next(c for c in hand["spec"]["initContainers"] if c["name"] == "epguard-probe")
    assert probe[field] != value
    probe[field] = value
    assert not verify(ring, "ml", hand).ok
    response = post(signed, "/validate", review(hand))
    assert response["allowed"] is False
    assert "differ from what epguard signed" in response["status"]["message"]


def test_a_signature_of_the_older_format_is_admitted_and_never_evidence(
    signed: RunningServer,
) -> None:
    """A pod an old webhook replica mutated during an upgrade (format v2, which did not
    sign the termination message): admitted with a warning, so an upgrade refuses no
    pod, but never evidence, since what v2 left out is what a replayed probe would
    change. A v2 signature that does not verify is refused as any forged one."""
    stored = injected(signed, worker_pod())
    ring = signed.runtime.state.keys.ring
    assert ring is not None
    annotations = stored["metadata"]["annotations"]
    annotations[SIGNATURE_ANNOTATION] = sign(
        ring.current, "ml", stored, dt.datetime.now(dt.UTC), fmt="v2"
    )
    probe = next(c for c in stored["spec"]["initContainers"] if c["name"] == "epguard-probe")
    probe["terminationMessagePath"] = "/usr/lib/python3/dist-packages/mooncake/pg.py"
    checked = verify(ring, "ml", stored)
    assert not checked.ok and checked.outdated and "older epguard" in checked.reason
    response = post(signed, "/validate", review(stored))
    assert response["allowed"] is True
    assert any("will not be learned" in w and "older epguard" in w for w in response["warnings"])
    forged = annotations[SIGNATURE_ANNOTATION][:-4] + "0000"
    annotations[SIGNATURE_ANNOTATION] = forged
    assert not verify(ring, "ml", stored).outdated
    assert post(signed, "/validate", review(stored))["allowed"] is False


def test_a_mesh_init_container_before_the_probe_is_still_evidence(signed: RunningServer) -> None:
    """What a service mesh does after epguard (its own init container first, no shared
    process namespace, not on the probe's volume) cannot reach the probe."""
    stored = injected(signed, worker_pod())
    ring = signed.runtime.state.keys.ring
    assert ring is not None
    meshed = copy.deepcopy(stored)
    meshed["spec"]["initContainers"].insert(0, {"name": "istio-init", "image": "proxy:1"})
    assert verify(ring, "ml", meshed).ok


def test_a_signature_made_for_another_pod_is_refused_at_create(signed: RunningServer) -> None:
    stored = injected(signed, worker_pod())
    ring = signed.runtime.state.keys.ring
    assert ring is not None
    old = _hand_made_copy(stored)
    an_hour_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    old["metadata"]["annotations"][SIGNATURE_ANNOTATION] = sign(
        ring.current, "ml", old, an_hour_ago
    )
    assert verify(ring, "ml", old).ok  # genuinely signed, only not for this pod
    response = post(signed, "/validate", review(old))
    assert response["allowed"] is False
    assert "a signature is used once" in response["status"]["message"]
    # An UPDATE of a pod created with it long ago (a label) is not a new use.
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"]["team"] = "a"
    assert post(signed, "/validate", review(relabelled, operation="UPDATE", old=old))["allowed"]


# --- issue 21.3: an UPDATE that swaps the worker's image under a signed probe ------------


def test_an_update_that_changes_the_probed_workers_image_is_refused(signed: RunningServer) -> None:
    stored = injected(signed, worker_pod())
    swapped = copy.deepcopy(stored)
    swapped["spec"]["containers"][0]["image"] = "registry.example/team/other:1"
    response = post(signed, "/validate", review(swapped, operation="UPDATE", old=stored))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "probe checked another image" in message and "recreate the pod" in message
    # The same pod, unchanged image, updates freely.
    relabelled = copy.deepcopy(stored)
    relabelled["metadata"]["labels"]["team"] = "a"
    assert post(signed, "/validate", review(relabelled, operation="UPDATE", old=stored))["allowed"]


def test_the_injected_images_pull_secrets_are_added_and_signed_with_the_probe(
    tmp_path: Path,
) -> None:
    """`injection.imagePullSecrets`: a pod the probe is injected into also gets the
    secrets for the injected image's registry (its own kept first, none twice), so a
    namespace that pulls from a private registry with a secret does not leave the worker
    scheduled on its GPU node and stuck in ErrImagePull on epguard's init container (the
    chart passed the admin's secrets only to epguard's own pods). The pod as stored is
    what was signed."""
    with running_server(tmp_path, TEST_RULES, inject_pull_secrets=("corp-pull",)) as server:
        server.runtime.state.keys.set(new_keyring(NOW))
        own = worker_pod()
        own["spec"]["imagePullSecrets"] = [{"name": "team-registry"}]
        stored = injected(server, own)
        assert stored["spec"]["imagePullSecrets"] == [
            {"name": "team-registry"}, {"name": "corp-pull"}]  # fmt: skip
        ring = server.runtime.state.keys.ring
        assert ring is not None and verify(ring, "ml", stored).ok
        assert post(server, "/validate", review(stored))["allowed"] is True
        # Injected again (a later webhook changed the pod): no second copy.
        assert injected(server, stored)["spec"]["imagePullSecrets"] == stored["spec"][
            "imagePullSecrets"]  # fmt: skip
        # A pod that does not ask for mooncake gets nothing.
        plain = pod([container(image=GOOD, args=["--model-path", "m"])], annotations=INJECT)
        assert "imagePullSecrets" not in injected(server, plain)["spec"]
