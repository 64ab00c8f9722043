"""The preflight gate's least privilege, through a real kube-apiserver: the chart's
controller RBAC and its ValidatingAdmissionPolicy (rendered by the real helm, applied
with the real kubectl), and every write made as the controller's ServiceAccount
(impersonated). The writes the gate needs pass; every other pod write by that account is
refused with the policy's message; other users are not affected."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from devcluster import ControlPlane
from epguard.webhook.engine.injection import InjectionSettings
from epguard.webhook.engine.outcome import PROBED_LABEL
from epguard.webhook.engine.preflight import (
    CONDITION,
    GATE,
    PreflightSettings,
    ProbeVolume,
    condition_patch,
    key_of,
    preflight_pod,
    signed,
    ungate_patch,
)
from epguard.webhook.engine.signing import new_keyring, verify
from tests.chart.chartlib import CHART, NAMESPACE, RELEASE, run_helm
from tests.control_plane import running_control_plane
from tests.e2e.e2e_kube import eventually, output

pytestmark = pytest.mark.e2e

POLICY = "epguard-preflight"
CONTROLLER = f"system:serviceaccount:{NAMESPACE}:epguard-controller"
TENANT = "team-a"
EXCLUDED = "gpu-operator"  # in webhook.excludeNamespaces
IGNORED = "addons"  # labelled epguard.io/ignore=true
EPGUARD_IMAGE = "registry.example/epguard:1"
WORKER_IMAGE = "registry.example/sglang:new"


@pytest.fixture(scope="module")
def cp() -> Iterator[ControlPlane]:
    with running_control_plane() as cp:
        for ns in (NAMESPACE, TENANT, EXCLUDED, IGNORED):
            cp.kubectl("create", "namespace", ns, check=True)
        cp.kubectl("label", "namespace", IGNORED, "epguard.io/ignore=true", check=True)
        cp.kubectl("create", "serviceaccount", "epguard-controller", "-n", NAMESPACE, check=True)
        for ns in ("kube-system", TENANT, EXCLUDED, IGNORED):
            cp.kubectl("create", "serviceaccount", "sglang", "-n", ns, check=True)
        rendered = run_helm(
            "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
            "--set", f"injection.image={EPGUARD_IMAGE}",
            "--set", f"webhook.excludeNamespaces={{{EXCLUDED}}}",
            "--show-only", "templates/preflight-policy.yaml",
            "--show-only", "templates/rbac-controller.yaml",
        ).stdout  # fmt: skip
        r = cp.kubectl("apply", "-f", "-", input=rendered)
        assert r.returncode == 0, output(r)
        eventually(lambda: "creates only preflight" in output(
            as_controller(cp, "create", "--dry-run=server", "-f", "-",
                          input=json.dumps(tenant_pod("probe-policy")))),
            within=30, what=f"the {POLICY} policy to be in force")  # fmt: skip
        yield cp


def as_controller(
    cp: ControlPlane, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    return cp.kubectl(f"--as={CONTROLLER}", *args, input=input)


def worker_spec() -> dict[str, Any]:
    return {
        "serviceAccountName": "sglang",
        "automountServiceAccountToken": False,
        "schedulingGates": [{"name": "kueue.x-k8s.io/admission"}, {"name": GATE}],
        "containers": [{
            "name": "worker",
            "image": WORKER_IMAGE,
            "args": ["--model-path", "/m", "--elastic-ep-backend", "mooncake"],
        }],
    }  # fmt: skip


def tenant_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": TENANT, "labels": {PROBED_LABEL: "true"}},
        "spec": worker_spec(),
    }


def preflight(probe_volume: ProbeVolume = "copy", **spec: Any) -> dict[str, Any]:
    key = key_of(TENANT, worker_spec(), WORKER_IMAGE)
    settings = PreflightSettings(InjectionSettings(EPGUARD_IMAGE), probe_volume=probe_volume)
    pod = preflight_pod(TENANT, worker_spec(), key, settings)
    assert pod is not None
    pod["spec"].update(spec)
    return pod


def create(cp: ControlPlane, pod: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return as_controller(cp, "create", "--dry-run=server", "-f", "-", input=json.dumps(pod))


def refused(r: subprocess.CompletedProcess[str], why: str) -> bool:
    return r.returncode != 0 and POLICY in r.stderr and why in r.stderr


def test_the_controller_may_create_a_preflight_pod_as_engine_preflight_builds_it(
    cp: ControlPlane,
) -> None:
    r = create(cp, preflight())
    assert r.returncode == 0, output(r)


def test_the_controller_may_give_the_preflight_the_workers_literal_env(cp: ControlPlane) -> None:
    # What admission read the flag's value from ($(EP), $EP in a script) the preflight's
    # probe must read too; a Secret, ConfigMap or field it gets none of.
    pod = preflight()
    pod["spec"]["initContainers"][1]["env"] = [{"name": "EPGUARD_POD_EP", "value": "mooncake"}]
    r = create(cp, pod)
    assert r.returncode == 0, output(r)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda p: p["metadata"]["labels"].pop("epguard.io/preflight-pod"), "only preflight pods"),
        (lambda p: p["spec"].update(hostNetwork=True), "shares nothing with the host"),
        (lambda p: p["spec"].update(automountServiceAccountToken=True), "no service account token"),
        (lambda p: p["spec"]["volumes"].append(
            {"name": "host", "hostPath": {"path": "/"}}), "mounts only the probe's volume"),
        (lambda p: p["spec"]["initContainers"][1].update(
            securityContext={"privileged": True}), "runs nothing privileged"),
        (lambda p: p["spec"]["containers"][0].update(image=WORKER_IMAGE),
         "its done container, in that order"),
        (lambda p: p["spec"]["containers"].append(
            {"name": "extra", "image": EPGUARD_IMAGE}), "its done container, in that order"),
        (lambda p: p["spec"]["containers"][0].update(command=["sh", "-c", "cat /secrets/*"]),
         "and nothing else"),
        (lambda p: p["spec"]["initContainers"][1]["command"].__setitem__(5, "--level"),
         "and nothing else"),
        (lambda p: p["spec"]["initContainers"][1].update(env=[{"name": "T", "valueFrom": {
            "secretKeyRef": {"name": "other-team", "key": "token"}}}]),
         "none from a Secret"),
        (lambda p: p["spec"]["initContainers"][1].update(env=[{"name": "PATH",
                                                                "value": "/tmp"}]),
         "only the worker's literal values"),
        (lambda p: p["spec"]["containers"][0].update(env=[{"name": "EPGUARD_POD_EP",
                                                         "value": "mooncake"}]),
         "env only on epguard-probe"),
        (lambda p: p["spec"]["containers"][0].update(ports=[{"containerPort": 80,
                                                            "hostPort": 80}]), "no port"),
        (lambda p: p["spec"].update(nodeName="node-0"), "no chosen node"),
        (lambda p: p["spec"]["securityContext"].update(seccompProfile={"type": "Unconfined"}),
         "default seccomp profile"),
    ],
    ids=["not-a-preflight", "host-network", "token", "host-path", "privileged",
         "other-image", "extra-container", "other-command", "probe-not-files-only",
         "secret-env", "unprefixed-env", "env-elsewhere", "host-port", "node-name",
         "unconfined"],
)  # fmt: skip
def test_any_other_pod_create_by_the_controller_is_refused(
    cp: ControlPlane, change: Any, why: str
) -> None:
    pod = preflight()
    change(pod)
    r = create(cp, pod)
    assert refused(r, why), output(r)


def test_the_controller_may_create_a_preflight_whose_probe_volume_is_the_epguard_image(
    cp: ControlPlane,
) -> None:
    """preflight.probeVolume: image, accepted whatever the release's value (a controller
    of the release before an upgrade is not refused)."""
    r = create(cp, preflight("image"))
    assert r.returncode == 0, output(r)


@pytest.mark.parametrize("probe_volume", ["copy", "image"])
def test_a_preflight_as_the_api_server_stores_it_still_verifies(
    cp: ControlPlane, probe_volume: ProbeVolume
) -> None:
    """What the API server defaults in a stored preflight (an image volume's source
    included) is not what epguard signed: the controller takes a preflight for its own
    only while its signature verifies, so a default there would make every preflight
    a changed one (deleted, its pods opened or held)."""
    ring = new_keyring(dt.datetime.now(dt.UTC))
    pod = signed(preflight(probe_volume), ring.current, dt.datetime.now(dt.UTC))
    r = as_controller(cp, "create", "--dry-run=server", "-o", "json", "-f", "-",
                      input=json.dumps(pod))  # fmt: skip
    assert r.returncode == 0, output(r)
    stored = json.loads(r.stdout)
    assert stored["spec"]["volumes"][0].keys() == pod["spec"]["volumes"][0].keys()
    checked = verify(ring, TENANT, stored)
    assert checked.ok, checked.reason


def _other_image(pod: dict[str, Any]) -> None:
    pod["spec"]["volumes"][0]["image"]["reference"] = "attacker.example/epguard:1"


def _copy_beside_the_image(pod: dict[str, Any]) -> None:
    copied = preflight()["spec"]["initContainers"][0]
    pod["spec"]["initContainers"].insert(0, copied)


def _image_in_a_copying_preflight(pod: dict[str, Any]) -> None:
    pod["spec"]["volumes"] = preflight("image")["spec"]["volumes"]


@pytest.mark.parametrize(
    ("probe_volume", "change", "why"),
    [
        ("image", _other_image, "mounts only the probe's volume"),
        ("image", _copy_beside_the_image, "mounts only the probe's volume"),
        ("copy", _image_in_a_copying_preflight, "mounts only the probe's volume"),
        ("image", lambda p: p["spec"]["initContainers"][0]["command"].__setitem__(
            2, "/epguard/probe"), "and nothing else"),
        ("copy", lambda p: p["spec"]["initContainers"][1]["command"].__setitem__(
            2, "/epguard/opt/epguard/probe"), "and nothing else"),
        ("image", lambda p: p["spec"]["initContainers"][0].update(args=["x"]),
         "and nothing else"),
        ("image", lambda p: p["spec"]["initContainers"].insert(0, {
            "name": "tenant", "image": EPGUARD_IMAGE}), "its done container, in that order"),
    ],
    ids=["other-image-as-volume", "copy-container-and-image", "image-where-copied",
         "copied-path-from-the-image", "image-path-in-the-copy", "probe-args",
         "init-before-the-probe"],
)  # fmt: skip
def test_a_preflight_of_either_probe_volume_is_held_to_its_own_shape(
    cp: ControlPlane, probe_volume: ProbeVolume, change: Any, why: str
) -> None:
    pod = preflight(probe_volume)
    change(pod)
    r = create(cp, pod)
    assert refused(r, why), output(r)


@pytest.fixture
def gated(cp: ControlPlane) -> Iterator[str]:
    """A tenant's gated pod (created by the admin, as /mutate would have left it)."""
    name = "w-gated"
    r = cp.kubectl("create", "-f", "-", input=json.dumps(tenant_pod(name)))
    assert r.returncode == 0, output(r)
    yield name
    cp.kubectl("delete", "pod", name, "-n", TENANT, "--wait=false", "--ignore-not-found")


def pod_json(cp: ControlPlane, name: str) -> dict[str, Any]:
    r = cp.kubectl("get", "pod", name, "-n", TENANT, "-o", "json")
    assert r.returncode == 0, output(r)
    pod: dict[str, Any] = json.loads(r.stdout)
    return pod


def gates(cp: ControlPlane, name: str) -> list[str]:
    return [g["name"] for g in pod_json(cp, name)["spec"].get("schedulingGates", [])]


def patch(
    cp: ControlPlane, name: str, ops: list[dict[str, Any]], *extra: str
) -> subprocess.CompletedProcess[str]:
    return as_controller(cp, "patch", "pod", name, "-n", TENANT, "--type=json",
                         "-p", json.dumps(ops), *extra)  # fmt: skip


def test_the_controller_may_remove_its_gate_and_nothing_else(cp: ControlPlane, gated: str) -> None:
    for ops, why in [
        ([{"op": "remove", "path": "/spec/schedulingGates/0"}], "only remove the epguard.io"),
        ([{"op": "add", "path": "/metadata/labels/x", "value": "y"}], "only remove"),
        ([{"op": "replace", "path": "/spec/containers/0/image", "value": "evil/other:1"}],
         "only remove"),
        ([{"op": "remove", "path": "/spec/schedulingGates/1"},
          {"op": "add", "path": "/metadata/annotations", "value": {"a": "b"}}], "only remove"),
    ]:  # fmt: skip
        r = patch(cp, gated, ops)
        assert refused(r, why), (ops, output(r))
    assert gates(cp, gated) == ["kueue.x-k8s.io/admission", GATE]
    # The patch the controller sends (engine.preflight.ungate_patch), guarded by the uid:
    # the same pod's passes; another pod's uid (one made again under the name) fails.
    listed = pod_json(cp, gated)
    other = {
        **listed,
        "metadata": {**listed["metadata"], "uid": "0" * 8 + "-0000-0000-0000-" + "0" * 12},
    }
    r = patch(cp, gated, ungate_patch(other))
    # A failed test is a 422 that no policy made (the controller reads it as a Conflict).
    assert r.returncode != 0 and "invalid" in r.stderr and POLICY not in r.stderr, output(r)
    assert gates(cp, gated) == ["kueue.x-k8s.io/admission", GATE]
    r = patch(cp, gated, ungate_patch(listed))
    assert r.returncode == 0, output(r)
    assert gates(cp, gated) == ["kueue.x-k8s.io/admission"]


def test_the_controller_may_set_its_own_condition_only(cp: ControlPlane, gated: str) -> None:
    def status(conditions: list[dict[str, Any]], **more: Any) -> subprocess.CompletedProcess[str]:
        return patch_status({"status": {"conditions": conditions, **more}})

    def patch_status(body: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return as_controller(cp, "patch", "pod", gated, "-n", TENANT, "--subresource=status",
                             "--type=strategic", "-p", json.dumps(body))  # fmt: skip

    ours = {"type": CONDITION, "status": "False", "reason": "PreflightRunning",
            "message": "waiting", "lastTransitionTime": "2026-12-03T00:00:00Z"}  # fmt: skip
    # The patch the controller sends (engine.preflight.condition_patch): with the pod's
    # uid it is written; with another's (a pod made again under the name) it is refused.
    uid = pod_json(cp, gated)["metadata"]["uid"]
    r = patch_status(condition_patch("0" * 8 + "-0000-0000-0000-" + "0" * 12, ours))
    assert r.returncode != 0 and "uid" in r.stderr.lower(), output(r)
    r = patch_status(condition_patch(uid, ours))
    assert r.returncode == 0, output(r)
    other = {**ours, "type": "Ready"}
    assert refused(status([other]), "its own epguard.io/Preflight condition")
    assert refused(status([ours], phase="Running"), "its own epguard.io/Preflight condition")
    assert refused(status([ours], podIPs=[{"ip": "10.0.0.9"}]), "its own epguard.io/Preflight")
    assert refused(status([ours], message="hello"), "its own epguard.io/Preflight condition")
    # The API server keeps labels, annotations and finalizers writable through
    # pods/status: relabelled as a preflight, any pod was the controller's to delete
    # (found by a review helper).
    for meta in ({"labels": {"epguard.io/preflight-pod": "true"}},
                 {"annotations": {"x": "y"}}, {"finalizers": ["example.com/hold"]}):  # fmt: skip
        assert refused(patch_status({"metadata": meta, "status": {"conditions": [ours]}}),
                       "its own epguard.io/Preflight condition"), meta  # fmt: skip
    got = json.loads(cp.kubectl("get", "pod", gated, "-n", TENANT, "-o", "json").stdout)
    types = [c["type"] for c in got["status"].get("conditions", [])]
    # The API server's own PodScheduled (reason SchedulingGated) and ours; not "Ready".
    assert sorted(types) == sorted(["PodScheduled", CONDITION]), types


def test_the_controller_deletes_only_preflight_pods(cp: ControlPlane, gated: str) -> None:
    r = as_controller(cp, "delete", "pod", gated, "-n", TENANT, "--wait=false")
    assert refused(r, "deletes only preflight pods"), output(r)
    pod = preflight()
    r = as_controller(cp, "create", "-f", "-", input=json.dumps(pod))
    assert r.returncode == 0, output(r)
    r = as_controller(cp, "delete", "pod", pod["metadata"]["name"], "-n", TENANT, "--wait=false")
    assert r.returncode == 0, output(r)


@pytest.mark.parametrize("namespace", ["kube-system", NAMESPACE, EXCLUDED, IGNORED])
def test_the_controller_creates_no_preflight_where_epguard_judges_nothing(
    cp: ControlPlane, namespace: str
) -> None:
    """No worker is gated where no webhook of epguard is called; only kube-system and
    the release namespace were refused (review helper): a stolen controller token could
    run a preflight-shaped pod of any image in an excluded add-on namespace."""
    pod = preflight()
    pod["metadata"]["namespace"] = namespace
    r = as_controller(cp, "create", "--dry-run=server", "-n", namespace, "-f", "-",
                      input=json.dumps(pod))  # fmt: skip
    assert refused(r, "in a namespace epguard does not judge"), output(r)
    pod["metadata"]["namespace"] = TENANT  # control: the same pod where workers are gated
    r = as_controller(cp, "create", "--dry-run=server", "-n", TENANT, "-f", "-",
                      input=json.dumps(pod))  # fmt: skip
    assert r.returncode == 0, output(r)


def test_other_users_are_not_held_by_the_policy(cp: ControlPlane, gated: str) -> None:
    r = cp.kubectl("label", "pod", gated, "-n", TENANT, "x=y")
    assert r.returncode == 0, output(r)


def test_nobody_but_the_controller_puts_the_preflight_labels_on_a_pod(
    cp: ControlPlane, gated: str
) -> None:
    """A tenant's running workers labelled as preflights were read by every pass and their
    probes' ends started answer runs beside other namespaces' (found by a review helper)."""
    labels_policy = "epguard-preflight-labels"
    made = preflight()
    made["metadata"]["name"] = "my-preflight"
    r = cp.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(made))
    assert r.returncode != 0 and labels_policy in r.stderr, output(r)
    assert "only epguard's controller sets them" in r.stderr
    for label in ("epguard.io/preflight-pod=true", "epguard.io/preflight-key=abc"):
        r = cp.kubectl("label", "pod", gated, "-n", TENANT, label)
        assert r.returncode != 0 and labels_policy in r.stderr, (label, output(r))
    # The controller's own preflight passes, and its labels stay as they are for others:
    # any other label of it may change, those two may not.
    pod = preflight()
    r = as_controller(cp, "create", "-f", "-", input=json.dumps(pod))
    assert r.returncode == 0, output(r)
    name = pod["metadata"]["name"]
    try:
        r = cp.kubectl("label", "pod", name, "-n", TENANT, "team=a")
        assert r.returncode == 0, output(r)
        r = cp.kubectl("label", "pod", name, "-n", TENANT, "epguard.io/preflight-pod-")
        assert r.returncode != 0 and labels_policy in r.stderr, output(r)
    finally:
        as_controller(cp, "delete", "pod", name, "-n", TENANT, "--wait=false")


def test_nobody_but_the_controller_adds_a_finalizer_to_a_preflight(cp: ControlPlane) -> None:
    """A tenant's finalizer kept its finished preflights from ever being deleted, past
    the controller's cap on what it retains a namespace: each pass lists every one of
    them (review helper). Other metadata of a preflight stays the tenant's to change."""
    pod = preflight()
    r = as_controller(cp, "create", "-f", "-", input=json.dumps(pod))
    assert r.returncode == 0, output(r)
    name = pod["metadata"]["name"]
    try:
        add = json.dumps({"metadata": {"finalizers": ["tenant.example/keep"]}})
        r = cp.kubectl("patch", "pod", name, "-n", TENANT, "--type=merge", "-p", add)
        assert r.returncode != 0 and "epguard-preflight-labels" in r.stderr, output(r)
        assert "refuses a new finalizer on its preflight pod" in r.stderr
        r = cp.kubectl("annotate", "pod", name, "-n", TENANT, "team=a")
        assert r.returncode == 0, output(r)
        # A tenant's own pod is not held by it.
        r = cp.kubectl("create", "-f", "-", input=json.dumps(tenant_pod("w-finalized")))
        assert r.returncode == 0, output(r)
        r = cp.kubectl("patch", "pod", "w-finalized", "-n", TENANT, "--type=merge", "-p", add)
        assert r.returncode == 0, output(r)
    finally:
        drop = json.dumps({"metadata": {"finalizers": None}})
        for pod_name in (name, "w-finalized"):
            cp.kubectl("patch", "pod", pod_name, "-n", TENANT, "--type=merge", "-p", drop)
        as_controller(cp, "delete", "pod", name, "-n", TENANT, "--wait=false")
        cp.kubectl("delete", "pod", "w-finalized", "-n", TENANT, "--wait=false",
                   "--ignore-not-found")  # fmt: skip


def test_a_limitrange_default_changes_what_epguard_signed_and_the_create_shows_it(
    cp: ControlPlane,
) -> None:
    """What the controller's create returns is the pod as stored, after the built-in
    LimitRanger: a default ephemeral-storage on each container without one. That
    changes a signed preflight, which the controller now finds at once (it was taken for
    a tenant's pod under the preflight's name). Created as the controller's account
    (impersonated), through the controller's own KubePreflightApi."""
    import datetime as dt

    from kubernetes import client, config

    from epguard.webhook.controller.gatekeeper import KubePreflightApi, _made_by_epguard
    from epguard.webhook.engine.preflight import signed
    from epguard.webhook.engine.signing import new_keyring

    namespace = "team-limits"
    cp.kubectl("create", "namespace", namespace, check=True)
    cp.kubectl("create", "serviceaccount", "sglang", "-n", namespace, check=True)
    limits = {"apiVersion": "v1", "kind": "LimitRange",
              "metadata": {"name": "storage", "namespace": namespace},
              "spec": {"limits": [{"type": "Container",
                                   "default": {"ephemeral-storage": "2Gi"},
                                   "defaultRequest": {"ephemeral-storage": "1Gi"}}]}}  # fmt: skip
    cp.kubectl("apply", "-f", "-", input=json.dumps(limits), check=True)
    ring = new_keyring(dt.datetime.now(dt.UTC))
    as_it = config.new_client_from_config(str(cp.kubeconfig))
    as_it.set_default_header("Impersonate-User", CONTROLLER)
    api = KubePreflightApi(as_it)
    try:
        for ns, stays_signed in ((TENANT, True), (namespace, False)):
            key = key_of(ns, worker_spec(), WORKER_IMAGE)
            body = preflight_pod(ns, worker_spec(), key,
                                 PreflightSettings(InjectionSettings(EPGUARD_IMAGE)))  # fmt: skip
            assert body is not None
            stored = api.create_pod(ns, signed(body, ring.current, dt.datetime.now(dt.UTC)))
            containers = stored["spec"]["initContainers"]
            assert stored["metadata"]["uid"] and len(containers) == 2
            defaulted = all(
                "ephemeral-storage" in c["resources"].get("requests", {}) for c in containers
            )
            assert defaulted is not stays_signed
            assert _made_by_epguard(stored, ring) is stays_signed
            api.delete_pod(ns, key.pod_name, stored["metadata"]["uid"])
    finally:
        api.api.close()
        assert isinstance(api.api, client.ApiClient)
