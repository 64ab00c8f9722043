"""Builders for pods, workloads and AdmissionReviews used across the webhook tests."""

from __future__ import annotations

import itertools
from typing import Any

from epguard.webhook.engine.policy import PolicyConfig, PolicyState
from epguard.webhook.engine.review import AdmissionRequest
from epguard.webhook.engine.rules import RulesHolder, load_rules_text

_uid = itertools.count(1)

BAD_IMAGE = "lmsysorg/sglang:v0.5.16-cu129"
BAD_IMAGE_NORMALIZED = "docker.io/lmsysorg/sglang:v0.5.16-cu129"
GOOD_IMAGE = "lmsysorg/sglang:v0.5.18-cu130"
DIGEST = "sha256:" + "ab" * 32

TEST_RULES = f"""
rules:
  - id: sglang-0516-cu129-test
    image: "docker.io/lmsysorg/sglang:v0.5.16-cu129"
    reason: "the image's mooncake build has no ep_2_11_0 extension."
    remedy: "use lmsysorg/sglang:v0.5.18-cu130."
    evidence: "test fixture"
  - id: dynamo-16-warn-test
    image: "nvcr.io/nvidia/ai-dynamo/sglang-runtime:1.6.*"
    reason: "mooncake 0.3.14 JIT-compiles on first import"
    remedy: "prebuild the adapter"
    action: warn
  - id: pinned-digest-test
    digest: "{DIGEST}"
    reason: "this exact build lacks libibverbs"
    remedy: "rebuild with rdma-core"
"""

# Refuses every image: which objects are refused then shows exactly which ones epguard
# reads as requesting mooncake.
DENY_ALL_RULES = """
rules:
  - id: deny-everything
    image: "*"
    reason: "test: every image is refused"
    remedy: "none"
"""

MOONCAKE_ARGS = [
    "--model-path",
    "deepseek-ai/DeepSeek-V3",
    "--tp",
    "8",
    "--elastic-ep-backend",
    "mooncake",
]


def container(
    name: str = "worker",
    image: str | None = BAD_IMAGE,
    command: list[str] | None = None,
    args: list[str] | None = None,
    env: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name}
    if image is not None:
        c["image"] = image
    c["command"] = ["python3", "-m", "sglang.launch_server"] if command is None else command
    c["args"] = list(MOONCAKE_ARGS) if args is None else args
    if env is not None:
        c["env"] = env
    return c


def pod_spec(
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": containers if containers is not None else [container()]}
    if init is not None:
        spec["initContainers"] = init
    return spec


def pod(
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
    name: str = "worker-0",
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ml"}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec(containers, init)}


def template(
    spec: dict[str, Any] | None = None, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": {"app": "w"}}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec if spec is not None else pod_spec()}


def workload(
    kind: str,
    spec_template: dict[str, Any] | None = None,
    name: str = "w",
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A workload of ``kind`` whose pod template(s) hold ``spec_template``."""
    t = spec_template if spec_template is not None else template()
    meta: dict[str, Any] = {"name": name, "namespace": "ml"}
    if annotations:
        meta["annotations"] = annotations
    api = {
        "Deployment": "apps/v1",
        "StatefulSet": "apps/v1",
        "DaemonSet": "apps/v1",
        "ReplicaSet": "apps/v1",
        "Job": "batch/v1",
        "CronJob": "batch/v1",
        "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
        "ReplicationController": "v1",
    }[kind]
    if kind == "CronJob":
        spec: dict[str, Any] = {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": t}}}
    elif kind == "LeaderWorkerSet":
        spec = {"leaderWorkerTemplate": {"size": 2, "leaderTemplate": t, "workerTemplate": t}}
    else:
        spec = {"template": t}
    return {"apiVersion": api, "kind": kind, "metadata": meta, "spec": spec}


def gvk(obj: dict[str, Any]) -> tuple[str, str, str]:
    api = obj.get("apiVersion", "v1")
    group, _, version = api.rpartition("/")
    return group, version, obj["kind"]


def review(
    obj: Any,
    *,
    operation: str = "CREATE",
    namespace: str | None = "ml",
    old: Any = None,
    kind: tuple[str, str, str] | None = None,
    sub_resource: str | None = None,
    api_version: str = "admission.k8s.io/v1",
) -> dict[str, Any]:
    group, version, k = kind or gvk(obj)
    req: dict[str, Any] = {
        "uid": f"uid-{next(_uid)}",
        "kind": {"group": group, "version": version, "kind": k},
        "resource": {"group": group, "version": version, "resource": k.lower() + "s"},
        "operation": operation,
        "namespace": namespace,
        "object": obj,
        "oldObject": old,
        "userInfo": {"username": "alice"},
        "dryRun": False,
    }
    if sub_resource:
        req["subResource"] = sub_resource
    return {"apiVersion": api_version, "kind": "AdmissionReview", "request": req}


def request(obj: Any, **kw: Any) -> AdmissionRequest:
    return AdmissionRequest.model_validate(review(obj, **kw)["request"])


def make_state(**config: object) -> PolicyState:
    """Policy state holding TEST_RULES. (Here, not in conftest: several conftest modules
    share that import name, so `from conftest import` depends on collection order.)"""
    return PolicyState(
        rules=RulesHolder(load_rules_text(TEST_RULES, "test-rules")),
        config=PolicyConfig(**config),  # type: ignore[arg-type]
    )
