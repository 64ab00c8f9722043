"""The chart's preflight policy pins what a preflight pod runs: the commands in its CEL
are the ones the engine writes (engine/preflight.py, engine/injection.py), so a change on
one side that the other does not follow fails here, not as refused preflights in a
cluster. The policy's behaviour on a real API server: tests/e2e/test_preflight_policy.py."""

from __future__ import annotations

import json
from typing import Any

from epguard.webhook.engine.injection import InjectionSettings
from epguard.webhook.engine.preflight import PreflightSettings, key_of, preflight_pod
from tests.chart.chartlib import Rendered


def _policy_text(r: Rendered) -> str:
    (policy,) = [
        o for o in r.objects
        if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] == "epguard-preflight"
    ]  # fmt: skip
    return json.dumps(policy["spec"]["validations"])


def _preflight() -> dict[str, Any]:
    spec = {"containers": [{"name": "w", "image": "r.example/s:1",
                            "command": ["python3", "-m", "sglang.launch_server"],
                            "args": ["--elastic-ep-backend", "mooncake"]}]}  # fmt: skip
    pod = preflight_pod("t", spec, key_of("t", spec, "r.example/s:1"),
                        PreflightSettings(InjectionSettings("r.example/epguard:1")))  # fmt: skip
    assert pod is not None
    return pod


def _cel_list(items: list[str]) -> str:
    return "[" + ", ".join(f"'{a}'" for a in items) + "]"


def test_the_policy_pins_the_commands_the_engine_writes(defaults: Rendered) -> None:
    text = _policy_text(defaults)
    pod = _preflight()
    copy, probe = pod["spec"]["initContainers"]
    (done,) = pod["spec"]["containers"]
    assert _cel_list(copy["command"]) in text
    assert _cel_list(done["command"]) in text
    own = probe["command"][: probe["command"].index("--") + 1]
    for i, arg in enumerate(own):
        assert f"initContainers[1].command[{i}] == '{arg}'" in text, arg
    assert f"size(object.spec.initContainers[1].command) >= {len(own)}" in text


def test_the_engines_preflight_has_none_of_what_the_policy_refuses() -> None:
    pod = _preflight()
    spec = pod["spec"]
    containers = spec["initContainers"] + spec["containers"]
    assert all("env" not in c and "envFrom" not in c and "ports" not in c for c in containers)
    assert "nodeName" not in spec and spec["securityContext"]["seccompProfile"] == {
        "type": "RuntimeDefault"
    }
