"""Probe injection: what the mutating webhook adds to worker pods."""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest

from epguard.webhook.engine.injection import (
    COPY_CONTAINER,
    InjectionSettings,
    metadata_patch,
    plan,
)
from epguard.webhook.engine.namespaces import INJECT_KEY, opts_in, settings_from_labels

SETTINGS = InjectionSettings(epguard_image="ghcr.io/epguard/epguard:0.1.0")
IMAGE = "docker.io/lmsysorg/sglang:v0.5.18-cu130"


def worker(**extra: Any) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": "worker",
        "image": IMAGE,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": ["--model-path", "/models/x", "--elastic-ep-backend", "mooncake"],
        "resources": {
            "limits": {"nvidia.com/gpu": "8", "rdma/ib": "1", "cpu": "64", "memory": "1Ti"},
            "requests": {"nvidia.com/gpu": "8", "cpu": "32"},
        },
        "env": [
            {"name": "MC_FORCE_TCP", "value": "1"},
            {"name": "NCCL_DEBUG", "value": "INFO"},
        ],
        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
    }
    c.update(extra)
    return c


def apply(spec: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply the patch as RFC 6902 says (the API server's semantics: add replaces a member)."""
    assert all(op["path"].startswith("/spec/") for op in patch)
    out: dict[str, Any] = jsonpatch.apply_patch({"spec": spec}, patch)
    return out["spec"]


def test_probe_goes_first_before_the_model_download_init_container() -> None:
    download = {"name": "download-model", "image": "busybox", "command": ["sh", "-c", "pull"]}
    spec = {"initContainers": [download], "containers": [worker()], "volumes": [{"name": "models"}]}
    result = plan(spec, SETTINGS)
    assert result.probes == ("epguard-probe",)
    new = apply(spec, result.patch)
    names = [c["name"] for c in new["initContainers"]]
    assert names == [COPY_CONTAINER, "epguard-probe", "download-model"]
    assert [v["name"] for v in new["volumes"]] == ["models", "epguard-probe"]


def test_probe_runs_the_worker_image_with_the_worker_argv() -> None:
    new = apply({"containers": [worker()]}, plan({"containers": [worker()]}, SETTINGS).patch)
    probe = new["initContainers"][1]
    assert probe["image"] == IMAGE
    assert probe["command"][:3] == ["python3", "-I", "/epguard/probe"]
    sep = probe["command"].index("--")
    assert probe["command"][sep + 1 :] == worker()["command"] + worker()["args"]
    assert probe["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_probe_requests_the_worker_gpus_and_rdma_and_cpu_but_not_its_memory() -> None:
    # The worker's cpu (for a namespace's cpu quota) leaves the pod's effective cpu as it
    # was: an init container counts as the most of them, beside the sum of the others.
    new = apply({"containers": [worker()]}, plan({"containers": [worker()]}, SETTINGS).patch)
    resources = new["initContainers"][1]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "8"
    assert resources["limits"]["rdma/ib"] == "1"
    assert resources["requests"]["nvidia.com/gpu"] == "8"
    assert resources["limits"]["memory"] == "4Gi"
    assert resources["limits"]["cpu"] == "64" and resources["requests"]["cpu"] == "32"


def test_probe_inherits_env_renamed_but_no_model_volume() -> None:
    new = apply({"containers": [worker()]}, plan({"containers": [worker()]}, SETTINGS).patch)
    probe = new["initContainers"][1]
    # Renamed: the probe's interpreter and its verdict about the image see only the image.
    assert {e["name"] for e in probe["env"]} == {
        "EPGUARD_POD_MC_FORCE_TCP",
        "EPGUARD_POD_NCCL_DEBUG",
    }
    assert [m["name"] for m in probe["volumeMounts"]] == ["epguard-probe"]


def test_the_pods_path_and_envfrom_never_reach_the_probes_interpreter() -> None:
    w = worker()
    w["env"] = [
        {"name": "PATH", "value": "/usr/bin:/bin"},
        {"name": "MODEL", "value": "/models/$(PATH)/x"},
        {"name": "HOME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    w["envFrom"] = [{"configMapRef": {"name": "c"}}, {"prefix": "X_", "secretRef": {"name": "s"}}]
    w["args"] = [*w.get("args", []), "--tokenizer-path", "$(MODEL)", "$$(MODEL)", "$(OTHER)"]
    probe = apply({"containers": [w]}, plan({"containers": [w]}, SETTINGS).patch)["initContainers"][
        1
    ]
    names = [e["name"] for e in probe["env"]]
    assert names == ["EPGUARD_POD_PATH", "EPGUARD_POD_MODEL", "EPGUARD_POD_HOME"]
    assert probe["env"][1]["value"] == "/models/$(EPGUARD_POD_PATH)/x"
    assert probe["env"][2]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert [s.get("prefix") for s in probe["envFrom"]] == ["EPGUARD_POD_", "EPGUARD_POD_X_"]
    # The kubelet still expands the worker's own references, and nothing else changes.
    argv = probe["command"][probe["command"].index("--") + 1 :]
    assert argv[-3:] == ["$(EPGUARD_POD_MODEL)", "$$(MODEL)", "$(OTHER)"]
    assert probe["command"][0] == "python3"


def test_injection_is_idempotent_on_reinvocation() -> None:
    spec = {"containers": [worker()]}
    once = apply(spec, plan(spec, SETTINGS).patch)
    again = apply(once, plan(once, SETTINGS).patch)
    assert again == once
    assert [c["name"] for c in again["initContainers"]] == [COPY_CONTAINER, "epguard-probe"]


def test_a_probe_the_tenant_wrote_is_replaced_by_the_injected_one() -> None:
    forged = {
        "name": "epguard-probe",
        "image": IMAGE,
        "command": ["python3", "-c", "print('epguard: ... unusable'); raise SystemExit(1)"],
    }
    own_copy = {"name": COPY_CONTAINER, "image": SETTINGS.epguard_image, "command": ["true"]}
    spec = {"containers": [worker()], "initContainers": [own_copy, forged, {"name": "fetch"}]}
    new = apply(spec, plan(spec, SETTINGS).patch)
    names = [c["name"] for c in new["initContainers"]]
    assert names == [COPY_CONTAINER, "epguard-probe", "fetch"]
    assert new["initContainers"][1]["command"][:3] == ["python3", "-I", "/epguard/probe"]
    assert new["initContainers"][0]["command"] != ["true"]


def test_a_volume_the_tenant_named_epguard_probe_becomes_an_empty_dir() -> None:
    spec = {
        "containers": [worker()],
        "volumes": [{"name": "epguard-probe", "hostPath": {"path": "/"}}, {"name": "models"}],
    }
    new = apply(spec, plan(spec, SETTINGS).patch)
    assert new["volumes"] == [
        {"name": "models"},
        {"name": "epguard-probe", "emptyDir": {"sizeLimit": "16Mi"}},
    ]


def test_a_pod_without_mooncake_loses_the_epguard_parts_it_brought() -> None:
    plain = {"name": "web", "image": "nginx"}
    spec = {
        "containers": [plain],
        "initContainers": [{"name": "epguard-probe", "image": "x"}],
        "volumes": [{"name": "epguard-probe", "emptyDir": {}}],
    }
    result = plan(spec, SETTINGS)
    assert result.removed and not result.probes
    assert apply(spec, result.patch) == {"containers": [plain]}


def test_pods_that_do_not_ask_for_mooncake_are_never_touched() -> None:
    plain = worker(args=["--model-path", "/m", "--elastic-ep-backend", "nixl"])
    assert not plan({"containers": [plain]}, SETTINGS).changed
    assert not plan({"containers": [{"name": "nginx", "image": "nginx"}]}, SETTINGS).changed


def test_each_requesting_container_gets_its_own_named_probe() -> None:
    spec = {"containers": [worker(name="prefill"), worker(name="decode"), {"name": "side"}]}
    assert plan(spec, SETTINGS).probes == ("epguard-probe-prefill", "epguard-probe-decode")


def test_workers_whose_long_names_share_a_prefix_get_distinct_valid_probe_names() -> None:
    """Cut at 63 characters, both probes were named alike and the API server refused the
    tenant's whole pod as a duplicate (found by a review helper)."""
    import re

    stem = "sglang-elastic-ep-decode-worker-mooncake-backend-rank-"
    spec = {"containers": [worker(name=stem + "0"), worker(name=stem + "1")]}
    names = plan(spec, SETTINGS).probes
    assert len(names) == 2 and len(set(names)) == 2
    assert all(len(n) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) for n in names)
    assert all(n.startswith("epguard-probe-sglang-elastic-ep") for n in names)


def test_injected_containers_pass_a_cpu_quota_and_restricted_pod_security() -> None:
    """A quota on limits.cpu refuses a pod any of whose containers sets none (LimitRange
    defaults are filled in before webhooks run), and restricted PodSecurity refuses a
    container without a seccomp profile where the pod sets it per container: the injected
    containers made the tenant's valid pod invalid (found by a review helper)."""
    w = worker()
    w["resources"] = {"requests": {"cpu": "8"}, "limits": {"cpu": "16", "nvidia.com/gpu": 8}}
    w["securityContext"] = {"seccompProfile": {"type": "RuntimeDefault"}}
    spec = plan({"containers": [w]}, SETTINGS).spec
    assert spec is not None
    copy, probe = spec["initContainers"][:2]
    assert copy["resources"]["limits"]["cpu"] == "100m"
    assert probe["resources"]["limits"]["cpu"] == "16"
    assert probe["resources"]["requests"]["cpu"] == "8"  # the worker's: same effective cpu
    assert all(c["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
               for c in (copy, probe))  # fmt: skip
    # A limit only: the API server makes it the request too.
    w["resources"] = {"limits": {"cpu": "50m"}}
    (_, probe) = plan({"containers": [w]}, SETTINGS).spec["initContainers"][:2]  # type: ignore[index]
    assert probe["resources"]["requests"]["cpu"] == probe["resources"]["limits"]["cpu"] == "50m"


def test_shell_wrapped_launch_line_is_injected() -> None:
    c = worker(
        command=["/bin/bash", "-c"],
        args=["python3 -m sglang.launch_server --elastic-ep-backend=mooncake --tp 8"],
    )
    assert plan({"containers": [c]}, SETTINGS).probes == ("epguard-probe",)


@pytest.mark.parametrize("spec", [None, {}, {"containers": "x"}, {"containers": [1, None]}])
def test_malformed_specs_are_left_alone(spec: Any) -> None:
    assert not plan(spec, SETTINGS).changed


def test_opt_in_is_the_namespace_label_or_the_pod_annotation() -> None:
    assert settings_from_labels({"epguard.io/inject": "enabled"}).inject
    assert opts_in({"epguard.io/inject": "enabled"}.get(INJECT_KEY))
    assert not settings_from_labels({"epguard.io/inject": "disabled"}).inject
    assert not opts_in({}.get(INJECT_KEY))
    # Exactly as the chart's namespaceSelector and CEL compare it: "Enabled" sends
    # nothing to /mutate, so /validate must not take the pod for probed (review helper).
    for loose in ("Enabled", " enabled", "TRUE"):
        assert not opts_in(loose) and not settings_from_labels({INJECT_KEY: loose}).inject


def test_copy_container_runs_as_the_epguard_user_even_in_a_root_pod() -> None:
    spec = {"securityContext": {"runAsUser": 0}, "containers": [worker()]}
    copy_container = apply(spec, plan(spec, SETTINGS).patch)["initContainers"][0]
    context = copy_container["securityContext"]
    assert context["runAsUser"] == 65532 and context["runAsNonRoot"] is True


def test_probe_keeps_the_worker_user_so_the_image_runs_as_it_was_built() -> None:
    root_worker = worker(securityContext={"runAsUser": 0})
    probe = apply(
        {"containers": [root_worker]}, plan({"containers": [root_worker]}, SETTINGS).patch
    )["initContainers"][1]
    assert probe["securityContext"] == {"runAsUser": 0}


def test_metadata_patch_adds_the_maps_when_the_pod_has_no_labels_or_annotations() -> None:
    assert metadata_patch({"name": "x"}, probed=True, signature="v1:k:s") == [
        {"op": "add", "path": "/metadata/labels", "value": {"epguard.io/probed": "true"}},
        {
            "op": "add",
            "path": "/metadata/annotations",
            "value": {"epguard.io/probe-signature": "v1:k:s"},
        },
    ]


def test_metadata_patch_escapes_the_slash_when_adding_beside_other_labels() -> None:
    ops = metadata_patch({"labels": {"app": "sglang"}}, probed=True, signature=None)
    assert ops == [{"op": "add", "path": "/metadata/labels/epguard.io~1probed", "value": "true"}]


def test_metadata_patch_removes_a_label_and_signature_the_tenant_wrote() -> None:
    meta = {
        "labels": {"app": "x", "epguard.io/probed": "true"},
        "annotations": {"epguard.io/probe-signature": "v1:forged:00"},
    }
    pod = jsonpatch.apply_patch({"metadata": meta}, metadata_patch(meta, False, None))
    assert pod["metadata"] == {"labels": {"app": "x"}, "annotations": {}}


def test_text_only_the_safe_side_reads_gets_no_probe_and_no_gate() -> None:
    """A busybox helper that writes the launch script in a here-document mentions the flag
    and mooncake; the safe-side reading (probe/cmdline.py UNPLACED) judges its image by
    rules and verdicts, but a probe there would be `python3` in busybox: the tenant's pod
    would never start (found by a review helper)."""
    helper = {
        "name": "write-script",
        "image": "busybox:1.36",
        "command": ["sh", "-c"],
        "args": ["cat > /shared/run.sh <<'EOF'\n"
                 "python3 -m sglang.launch_server --elastic-ep-backend mooncake\nEOF"],
    }  # fmt: skip
    alone = plan({"containers": [helper]}, SETTINGS)
    assert alone.probes == () and alone.settled == ()
    both = plan({"initContainers": [helper], "containers": [worker()]}, SETTINGS)
    assert both.probes == ("epguard-probe",) and both.settled == (worker()["image"],)
