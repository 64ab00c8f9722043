"""The chart's preflight policy pins what a preflight pod runs: the commands in its CEL
are the ones the engine writes (engine/preflight.py, engine/injection.py), so a change on
one side that the other does not follow fails here, not as refused preflights in a
cluster. The policy's behaviour on a real API server: tests/e2e/test_preflight_policy.py."""

from __future__ import annotations

import json
from typing import Any

from epguard.webhook.engine.injection import InjectionSettings
from epguard.webhook.engine.preflight import PreflightSettings, ProbeVolume, key_of, preflight_pod
from tests.chart.chartlib import (
    CHART,
    NAMESPACE,
    RELEASE,
    Rendered,
    notes,
    render,
    run_helm,
    vap_refusal,
)


def _policy_text(r: Rendered) -> str:
    (policy,) = [
        o for o in r.objects
        if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] == "epguard-preflight"
    ]  # fmt: skip
    return json.dumps(policy["spec"]["validations"])


def _preflight(probe_volume: ProbeVolume = "copy") -> dict[str, Any]:
    spec = {"containers": [{"name": "w", "image": "r.example/s:1",
                            "command": ["python3", "-m", "sglang.launch_server"],
                            "args": ["--elastic-ep-backend", "mooncake"]}]}  # fmt: skip
    settings = PreflightSettings(
        InjectionSettings("r.example/epguard:1"), probe_volume=probe_volume
    )
    pod = preflight_pod("t", spec, key_of("t", spec, "r.example/s:1"), settings)
    assert pod is not None
    return pod


def _cel_list(items: list[str]) -> str:
    return "[" + ", ".join(f"'{a}'" for a in items) + "]"


def test_the_policy_pins_the_commands_the_engine_writes(defaults: Rendered) -> None:
    """Both probe volumes (the policy admits either, whatever the release's value): the
    copy command, the done container's, and the probe's own arguments, its path the
    one each way gives it."""
    text = _policy_text(defaults)
    copy, copied = _preflight("copy")["spec"]["initContainers"]
    mounted, *more = _preflight("image")["spec"]["initContainers"]
    assert not more
    (done,) = _preflight()["spec"]["containers"]
    assert _cel_list(copy["command"]) in text
    assert _cel_list(done["command"]) in text
    own = copied["command"][: copied["command"].index("--") + 1]
    assert len(own) == mounted["command"].index("--") + 1
    paths = f"(variables.copied ? '{copied['command'][2]}' : '{mounted['command'][2]}')"
    for i, arg in enumerate(own):
        if i == 2:
            assert f"variables.probe.command[2] == {paths}" in text
        else:
            assert f"variables.probe.command[{i}] == '{arg}'" in text, arg
            assert mounted["command"][i] == arg
    assert f"size(variables.probe.command) >= {len(own)}" in text


def test_the_engines_preflight_has_none_of_what_the_policy_refuses() -> None:
    pod = _preflight()
    spec = pod["spec"]
    containers = spec["initContainers"] + spec["containers"]
    assert all("env" not in c and "envFrom" not in c and "ports" not in c for c in containers)
    assert "nodeName" not in spec and spec["securityContext"]["seccompProfile"] == {
        "type": "RuntimeDefault"
    }


# -- the preflight labels are epguard's ---------------------------------------------------

LABELS_POLICY = "epguard-preflight-labels"
CONTROLLER = "system:serviceaccount:epguard-system:epguard-controller"


def _labels_refusal(
    defaults: Rendered,
    operation: str,
    labels: dict[str, str],
    old: dict[str, str] | None,
    user: str = "alice",
) -> str | None:
    """None: not evaluated past the matchConditions or admitted; else the message."""
    spec = defaults.one("ValidatingAdmissionPolicy", LABELS_POLICY)["spec"]
    request = {"operation": operation, "userInfo": {"username": user}, "namespace": "t",
               "name": "p"}  # fmt: skip
    return vap_refusal(
        spec,
        request,
        {"metadata": {"labels": labels}},
        None if old is None else {"metadata": {"labels": old}},
    )


def test_nobody_but_the_controller_sets_or_changes_the_preflight_labels(
    defaults: Rendered,
) -> None:
    pod, key = "epguard.io/preflight-pod", "epguard.io/preflight-key"
    refused = "only epguard's controller sets them"
    assert refused in str(_labels_refusal(defaults, "CREATE", {pod: "true"}, None))
    assert refused in str(_labels_refusal(defaults, "CREATE", {key: "abc"}, None))
    assert refused in str(_labels_refusal(defaults, "UPDATE", {"a": "b", pod: "true"}, {"a": "b"}))
    assert refused in str(_labels_refusal(defaults, "UPDATE", {pod: "true", key: "x"},
                                          {pod: "true", key: "y"}))  # fmt: skip
    assert refused in str(_labels_refusal(defaults, "UPDATE", {}, {pod: "true"}))
    # What is left: the controller's own writes, a preflight's other labels (the kubelet's
    # status writes keep them), and every pod without the labels.
    assert _labels_refusal(defaults, "CREATE", {pod: "true", key: "x"}, None, CONTROLLER) is None
    assert _labels_refusal(defaults, "UPDATE", {pod: "true", "a": "b"}, {pod: "true"}) is None
    assert _labels_refusal(defaults, "CREATE", {"app": "sglang"}, None) is None
    assert _labels_refusal(defaults, "UPDATE", {"app": "x"}, {"app": "y"}) is None


def test_the_labels_policy_names_the_labels_the_engine_writes(defaults: Rendered) -> None:
    from epguard.webhook.engine.preflight import KEY_LABEL, PREFLIGHT_LABEL

    text = json.dumps(defaults.one("ValidatingAdmissionPolicy", LABELS_POLICY)["spec"])
    assert f"'{PREFLIGHT_LABEL}'" in text and f"'{KEY_LABEL}'" in text
    assert f"'{CONTROLLER}'" in text


def test_the_image_probe_volume_reaches_the_controller_and_the_notes_warn_of_it() -> None:
    env = {
        e["name"]: e.get("value")
        for o in render("--set", "preflight.probeVolume=image", "--kube-version", "1.35.0").objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "epguard-controller"
        for e in o["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["EPGUARD_PREFLIGHT_PROBE_VOLUME"] == "image"
    warned = "preflight.probeVolume is image: every node that may run a preflight"
    assert warned in notes("--set", "preflight.probeVolume=image")
    assert "probeVolume" not in notes()


def test_the_image_probe_volume_fails_the_install_where_the_api_server_has_none() -> None:
    for version, fails in (("1.32.9", True), ("1.33.0", False)):
        r = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                     "--set", "preflight.probeVolume=image", "--kube-version", version,
                     check=False)  # fmt: skip
        assert (r.returncode != 0) == fails, (version, r.stderr[-500:])
        assert ("preflight.probeVolume: image needs image volumes" in r.stderr) == fails
