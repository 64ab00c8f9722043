"""Objects and kubectl helpers shared by the end-to-end tests (real kube-apiserver, real
kubectl, epguard's webhook and controller as local processes; see conftest.py)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from devcluster import ControlPlane
from devcluster.stack import NAMESPACE as RELEASE_NAMESPACE
from devcluster.stack import RULES_CONFIGMAP

# The image the session's deny rule names (added by the `deny_rule` fixture).
BAD_IMAGE = "registry.example.com/e2e/sglang:bad-1"
DENY_RULE_ID = "e2e-bad-image"
DENY_RULE = {
    "id": DENY_RULE_ID,
    "image": "registry.example.com/e2e/sglang:bad-*",
    "reason": "torch 2.14.1 with mooncake 0.3.13.post1 (no pg_2_14_1 extension)",
    "remedy": "use the e2e good image",
    "action": "deny",
}
GOOD_IMAGE = "registry.example.com/e2e/sglang:good-1"

WORKER_COMMAND = ["python3", "-m", "sglang.launch_server"]
WORKER_ARGS = ["--model-path", "/models/m", "--elastic-ep-backend", "mooncake"]


def worker(image: str, name: str = "worker", **extra: Any) -> dict[str, Any]:
    """An SGLang container that asks for mooncake elastic EP."""
    return {
        "name": name,
        "image": image,
        "command": list(WORKER_COMMAND),
        "args": list(WORKER_ARGS),
        **extra,
    }


def plain(image: str = "nginx:1.27", name: str = "web") -> dict[str, Any]:
    return {"name": name, "image": image}


def pod_spec(*containers: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    return {"containers": [dict(c) for c in containers], **extra}


def pod(
    name: str,
    namespace: str,
    *containers: Mapping[str, Any],
    annotations: Mapping[str, str] | None = None,
    **spec_extra: Any,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": pod_spec(*containers, **spec_extra),
    }


def _template(
    spec: Mapping[str, Any], annotations: Mapping[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": {"app": "sglang"}}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"metadata": meta, "spec": dict(spec)}


def workload(
    kind: str,
    name: str,
    namespace: str,
    image: str,
    *,
    template_annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A workload of ``kind`` whose pods run one elastic-EP worker on ``image``."""
    spec = pod_spec(worker(image))
    tmpl = _template(spec, template_annotations)
    selector = {"matchLabels": {"app": "sglang"}}
    meta = {"name": name, "namespace": namespace}
    if kind in ("Deployment", "ReplicaSet", "DaemonSet"):
        body: dict[str, Any] = {"selector": selector, "template": tmpl}
        return {"apiVersion": "apps/v1", "kind": kind, "metadata": meta, "spec": body}
    if kind == "StatefulSet":
        body = {"selector": selector, "serviceName": name, "template": tmpl}
        return {"apiVersion": "apps/v1", "kind": kind, "metadata": meta, "spec": body}
    job_template = _template({**spec, "restartPolicy": "Never"}, template_annotations)
    if kind == "Job":
        return {"apiVersion": "batch/v1", "kind": kind, "metadata": meta,
                "spec": {"template": job_template}}  # fmt: skip
    if kind == "CronJob":
        return {
            "apiVersion": "batch/v1",
            "kind": kind,
            "metadata": meta,
            "spec": {
                "schedule": "*/5 * * * *",
                "jobTemplate": {"spec": {"template": job_template}},
            },
        }
    if kind == "LeaderWorkerSet":
        leader = _template(pod_spec(plain(GOOD_IMAGE, "leader")))
        return {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": kind,
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "leaderWorkerTemplate": {
                    "size": 2,
                    "leaderTemplate": leader,
                    "workerTemplate": tmpl,
                },
            },
        }
    if kind == "DynamoGraphDeployment":  # v1alpha1: services map, mainContainer
        return {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": kind,
            "metadata": meta,
            "spec": {
                "services": {
                    "decode": {
                        "replicas": 2,
                        "extraPodSpec": {"mainContainer": worker(image, name="main")},
                    }
                }
            },
        }
    if kind == "DynamoGraphDeployment/v1beta1":
        return {
            "apiVersion": "nvidia.com/v1beta1",
            "kind": "DynamoGraphDeployment",
            "metadata": meta,
            "spec": {"components": [{"name": "decode", "podTemplate": tmpl}]},
        }
    raise ValueError(f"no e2e manifest for {kind}")


def as_yaml(*objects: Mapping[str, Any]) -> str:
    return "---\n".join(yaml.safe_dump(dict(o), sort_keys=False) for o in objects)


def apply(
    cp: ControlPlane, *objects: Mapping[str, Any], dry_run: bool = False
) -> subprocess.CompletedProcess[str]:
    """``kubectl apply -f -`` (``--dry-run=server`` on request); never raises."""
    args = ["apply", "-f", "-"] + (["--dry-run=server"] if dry_run else [])
    return cp.kubectl(*args, input=as_yaml(*objects))


def output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


def exists(cp: ControlPlane, resource: str, name: str, namespace: str | None = None) -> bool:
    args = ["get", resource, name, "-o", "name"] + (["-n", namespace] if namespace else [])
    r = cp.kubectl(*args)
    if r.returncode != 0 and "NotFound" not in r.stderr:
        raise AssertionError(f"kubectl get {resource} {name}: {r.stderr}")
    return r.returncode == 0


def eventually(
    check: Callable[[], bool], *, within: float = 30.0, what: str = "the change", every: float = 0.2
) -> float:
    """Poll ``check`` until true; returns the seconds it took. Fails after ``within``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > within:
            raise AssertionError(f"gave up after {within:.0f}s waiting for {what}")
        time.sleep(every)
    return time.monotonic() - start


def denied_by_epguard(result: subprocess.CompletedProcess[str]) -> bool:
    """Refused by epguard: its webhook, or its outage backstop. The API server evaluates
    ValidatingAdmissionPolicies before it calls webhooks, so for a rule-denied image or
    an Unusable digest the backstop answers first, with the webhook's own message."""
    err = result.stderr
    return result.returncode != 0 and (
        "denied the request" in err or "denied request: epguard (backstop policy)" in err
    )


# --- the live rules ------------------------------------------------------------------


def rules_text(cp: ControlPlane) -> str:
    r = cp.kubectl(
        "get", "configmap", RULES_CONFIGMAP, "-n", RELEASE_NAMESPACE, "-o", "json", check=True
    )
    text: str = json.loads(r.stdout)["data"]["rules.yaml"]
    return text


def set_rules_text(cp: ControlPlane, text: str) -> None:
    patch = json.dumps({"data": {"rules.yaml": text}})
    cp.kubectl(
        "patch", "configmap", RULES_CONFIGMAP, "-n", RELEASE_NAMESPACE, "--type=merge", "-p", patch,
        check=True,
    )  # fmt: skip


def with_rule(text: str, rule: Mapping[str, Any]) -> str:
    """The rules file ``text`` with ``rule`` appended (comments are not kept)."""
    doc = yaml.safe_load(text) or {}
    rules = [r for r in doc.get("rules") or [] if r.get("id") != rule["id"]]
    return yaml.safe_dump({**doc, "rules": [*rules, dict(rule)]}, sort_keys=False)


def without_rule(text: str, rule_id: str) -> str:
    doc = yaml.safe_load(text) or {}
    rules = [r for r in doc.get("rules") or [] if r.get("id") != rule_id]
    return yaml.safe_dump({**doc, "rules": rules}, sort_keys=False)


def minimal_crd(group: str, kind: str, plural: str, versions: list[str]) -> dict[str, object]:
    """A minimal CRD: any spec is stored (x-kubernetes-preserve-unknown-fields)."""
    schema = {
        "openAPIV3Schema": {
            "type": "object",
            "properties": {
                "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
            },
        }
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "plural": plural,
                "singular": kind.lower(),
                "listKind": f"{kind}List",
            },
            "versions": [
                {"name": v, "served": True, "storage": i == 0, "schema": schema}
                for i, v in enumerate(versions)
            ],
        },
    }


def wait_event(
    cp: ControlPlane, namespace: str, about: str, reason: str, within: float = 60.0
) -> list[dict[str, Any]]:
    """The Events with ``reason`` about the object named ``about``, once there is one."""
    found: list[dict[str, Any]] = []

    def posted() -> bool:
        r = cp.kubectl(
            "get", "events", "-n", namespace, "-o", "json",
            f"--field-selector=involvedObject.name={about},reason={reason}",
        )  # fmt: skip
        found[:] = json.loads(r.stdout)["items"] if r.returncode == 0 else []
        return bool(found)

    eventually(posted, within=within, what=f"a {reason} Event on {about}")
    return found
