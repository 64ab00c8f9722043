#!/usr/bin/env python3
"""Pod-create latency through a real kube-apiserver, side by side:

* ``none``:    no admission policy for the pod (the API server's own cost: authn,
               authz, defaulting, validation, the built-in admission plugins, etcd);
* ``vap``:     the same rule as epguard's written as a ValidatingAdmissionPolicy (CEL,
               evaluated inside the API server -- the floor for any admission check);
* ``webhook``: epguard's chart installed with helm on the real one-node cluster, exactly
               as ``make up`` does it: the webhook runs as the chart's pods and the API
               server calls it through its Service (the chart's ``service``
               clientConfig, kube-proxy's rules, the pod network, TLS from the
               controller-issued certificate); the outage backstop is not bound here;
* ``backstop``: the same webhook plus epguard's outage backstop (the controller's
               ValidatingAdmissionPolicies, docs/backstop.md), for a pod both admit;
* ``refused``: the same, for a pod on the rule-denied image, which the backstop refuses
               (the API server evaluates policies before it calls webhooks).

Each scenario gets its own namespace in that cluster (devcluster: etcd, kube-apiserver,
the node). The benchmark pods name a node that does not exist (``spec.nodeName``), so
the create is the whole of it: nothing schedules or runs them. The pod is an SGLang
worker that asks for ``--elastic-ep-backend mooncake`` on an image the rule does not
name, so every check runs in full and admits (a denial would not measure a create).
Creates are sequential POSTs over one keep-alive HTTPS connection with the admin client
certificate (httpx; no kubectl process per request), interleaved in rounds so that noise
from a shared machine falls on all three alike. Prints p50/p90/p99 per scenario and the
ratios. A benchmark prints figures; it asserts nothing (the target, epguard p99 <= 1.5x
the VAP's, is printed as met or not).

    .venv/bin/python bench/admission_latency.py [--count 300] [--round 25] [--warmup 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster import ControlPlane  # noqa: E402
from devcluster.stack import CHART_DIR, Stack, deploy_chart, start_cluster  # noqa: E402

SCENARIOS = ("none", "vap", "webhook", "backstop", "refused")
BACKSTOP = "epguard-backstop"
EXPECTED = {"refused": 403}
BAD_PREFIX = "registry.example.com/bench/sglang:bad-"
GOOD_IMAGE = "registry.example.com/bench/sglang:v0.5.18-cu130"
RULE_ID = "bench-bad-image"
TARGET = 1.5

# The rule, as epguard reads it (added to the live rules ConfigMap) ...
RULE = {
    "id": RULE_ID,
    "image": BAD_PREFIX + "*",
    "reason": "benchmark rule",
    "remedy": "use another image",
    "action": "deny",
}
# ... and as CEL: deny a container on a matching image whose command + args ask for
# --elastic-ep-backend mooncake (either form), in containers and init containers.
_ARGV = "((has(c.command) ? c.command : []) + (has(c.args) ? c.args : []))"
_CONTAINERS = (
    "(object.spec.containers + (has(object.spec.initContainers) ? object.spec.initContainers : []))"
)
VAP_EXPRESSION = (
    f"!{_CONTAINERS}.exists(c, c.image.startsWith('{BAD_PREFIX}') && "
    f"({_ARGV}.exists(a, a == '--elastic-ep-backend=mooncake') || "
    f"({_ARGV}.exists(a, a == '--elastic-ep-backend') && {_ARGV}.exists(a, a == 'mooncake'))))"
)


def vap_objects(namespace: str) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": "bench-elastic-ep"},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE", "UPDATE"],
                            "resources": ["pods"],
                        }
                    ]
                },
                "validations": [
                    {
                        "expression": VAP_EXPRESSION,
                        "message": "image cannot serve --elastic-ep-backend mooncake",
                    }
                ],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": "bench-elastic-ep"},
            "spec": {
                "policyName": "bench-elastic-ep",
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                },
            },
        },
    ]


def worker_pod(name: str, image: str = GOOD_IMAGE) -> dict[str, Any]:
    """A realistic elastic-EP decode worker (~2 KB)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "sglang-decode", "role": "decode"}},
        "spec": {
            # No such node: the pod is created (all of admission, then etcd) and then
            # left alone by the scheduler and the kubelet.
            "nodeName": "bench-no-such-node",
            "restartPolicy": "Always",
            "containers": [
                {
                    "name": "worker",
                    "image": image,
                    "command": ["python3", "-m", "sglang.launch_server"],
                    "args": [
                        "--model-path",
                        "/models/deepseek-v3",
                        "--tp",
                        "8",
                        "--ep",
                        "8",
                        "--enable-dp-attention",
                        "--dp",
                        "8",
                        "--moe-a2a-backend",
                        "deepep",
                        "--elastic-ep-backend",
                        "mooncake",
                        "--mooncake-ib-device",
                        "mlx5_0",
                        "--host",
                        "0.0.0.0",
                        "--port",
                        "30000",
                    ],
                    "env": [
                        {"name": "NCCL_IB_HCA", "value": "mlx5"},
                        {"name": "MC_TE_METRIC", "value": "true"},
                        {"name": "CUDA_DEVICE_MAX_CONNECTIONS", "value": "1"},
                    ],
                    "resources": {
                        "limits": {"nvidia.com/gpu": "8", "rdma/ib": "1", "memory": "1Ti"},
                        "requests": {"cpu": "32", "memory": "512Gi"},
                    },
                    "volumeMounts": [
                        {"name": "models", "mountPath": "/models"},
                        {"name": "shm", "mountPath": "/dev/shm"},
                    ],
                },
                {"name": "metrics", "image": "prom/node-exporter:v1.8.2"},
            ],
            "volumes": [
                {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
            ],
        },
    }


class Creator:
    """Sequential pod creates over one keep-alive HTTPS connection, as the admin."""

    def __init__(self, cp: ControlPlane) -> None:
        self.client = httpx.Client(
            base_url=cp.server, verify=cp.ssl_context(), trust_env=False, timeout=30.0
        )
        self.seq = 0

    def create(self, namespace: str, image: str = GOOD_IMAGE) -> tuple[float, httpx.Response]:
        self.seq += 1
        body = json.dumps(worker_pod(f"w-{self.seq}", image)).encode()
        t0 = time.perf_counter()
        r = self.client.post(
            f"/api/v1/namespaces/{namespace}/pods",
            content=body,
            headers={"Content-Type": "application/json"},
        )
        return time.perf_counter() - t0, r

    def close(self) -> None:
        self.client.close()


def until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.2)


def setup(stack: Stack) -> tuple[ControlPlane, dict[str, str]]:
    """The cluster and epguard as `make up` brings them up, the rule, the VAP, and one
    namespace per scenario."""
    print("starting the one-node cluster and installing the chart ...", file=sys.stderr)
    start_cluster(stack)
    assert stack.control_plane is not None
    cp = stack.control_plane
    deploy_chart(stack, cp, CHART_DIR, [])
    # The rule in the live rules ConfigMap (the webhook pods watch it).
    cm = json.loads(
        cp.kubectl(
            "get", "configmap", "epguard-rules", "-n", "epguard-system", "-o", "json", check=True
        ).stdout
    )
    rules = yaml.safe_load(cm["data"]["rules.yaml"]) or {}
    rules["rules"] = [*(rules.get("rules") or []), RULE]
    patch = json.dumps({"data": {"rules.yaml": yaml.safe_dump(rules)}})
    cp.kubectl("patch", "configmap", "epguard-rules", "-n", "epguard-system", "--type=merge",
               "-p", patch, check=True)  # fmt: skip

    suffix = uuid.uuid4().hex[:6]
    namespaces = {s: f"bench-{s}-{suffix}" for s in SCENARIOS}
    for scenario, ns in namespaces.items():
        cp.kubectl("create", "namespace", ns, check=True)
        if scenario in ("none", "vap"):  # out of epguard's webhooks' and backstop's reach
            cp.kubectl("label", "namespace", ns, "epguard.io/ignore=true", check=True)
        # kube-controller-manager makes the `default` ServiceAccount a pod needs.
        until(lambda ns=ns: cp.kubectl("get", "sa", "default", "-n", ns).returncode == 0,
              f"the default ServiceAccount in {ns}")  # fmt: skip
    objs = vap_objects(namespaces["vap"])
    cp.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
               "items": objs}), check=True)  # fmt: skip
    rebind_backstop(cp, [namespaces["backstop"], namespaces["refused"]])
    return cp, namespaces


def rebind_backstop(cp: ControlPlane, namespaces: list[str]) -> None:
    """Narrow the controller's backstop bindings to the backstop scenarios' namespaces,
    so ``webhook`` measures the webhook alone. (The controller writes its bindings when it
    starts, not after, so the narrowing holds for the run.)"""
    until(lambda: cp.kubectl("get", "validatingadmissionpolicybinding",
                             f"{BACKSTOP}-enforce").returncode == 0,
          "the controller to install the backstop")  # fmt: skip
    for mode in ("enforce", "warn", "audit"):
        name = f"{BACKSTOP}-{mode}"
        binding = json.loads(cp.kubectl("get", "validatingadmissionpolicybinding", name,
                                        "-o", "json", check=True).stdout)  # fmt: skip
        selector = binding["spec"]["matchResources"]["namespaceSelector"]
        selector.setdefault("matchExpressions", []).append(
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": namespaces}
        )
        cp.kubectl("replace", "-f", "-", input=json.dumps(binding), check=True)


def check_policies(creator: Creator, namespaces: dict[str, str]) -> None:
    """Each scenario does what it claims: the bad image is refused by the VAP and by
    epguard, and admitted where no policy applies."""
    _, r = creator.create(namespaces["none"], BAD_PREFIX + "1")
    if r.status_code != 201:
        raise SystemExit(f"none: expected 201, got {r.status_code}: {r.text}")

    def refused(scenario: str, marker: str) -> bool:
        _, r = creator.create(namespaces[scenario], BAD_PREFIX + "1")
        return r.status_code in (403, 422) and marker in r.text

    until(lambda: refused("vap", "ValidatingAdmissionPolicy"), "the VAP to take effect")
    until(lambda: refused("webhook", f"[epguard rule {RULE_ID}]"), "epguard to judge")
    until(lambda: refused("refused", f"'{BACKSTOP}-enforce'"), "the backstop to refuse")
    for scenario, ns in namespaces.items():
        _, r = creator.create(ns, image(scenario))
        if r.status_code != EXPECTED.get(scenario, 201):
            raise SystemExit(f"{scenario}: unexpected answer {r.status_code}: {r.text}")


def image(scenario: str) -> str:
    """The refused scenario creates the rule-denied image; the others a good one."""
    return BAD_PREFIX + "1" if scenario == "refused" else GOOD_IMAGE


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300, help="measured creates per scenario")
    parser.add_argument("--round", type=int, default=25, help="creates per scenario per round")
    parser.add_argument("--warmup", type=int, default=30, help="unmeasured creates per scenario")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="epguard-bench-") as tmp:
        stack = Stack(run_dir=Path(tmp) / "run", detached=False)
        creator: Creator | None = None
        try:
            cp, namespaces = setup(stack)
            creator = Creator(cp)
            check_policies(creator, namespaces)
            for _ in range(args.warmup):
                for scenario, ns in namespaces.items():
                    creator.create(ns, image(scenario))
            samples: dict[str, list[float]] = {s: [] for s in SCENARIOS}
            print(f"measuring {args.count} creates per scenario ...", file=sys.stderr)
            while any(len(v) < args.count for v in samples.values()):
                for scenario in SCENARIOS:
                    for _ in range(min(args.round, args.count - len(samples[scenario]))):
                        took, r = creator.create(namespaces[scenario], image(scenario))
                        if r.status_code != EXPECTED.get(scenario, 201):
                            raise SystemExit(f"{scenario}: create failed: {r.status_code} {r.text}")
                        samples[scenario].append(took)
            report(samples, args)
        finally:
            if creator is not None:
                creator.close()
            stack.stop()
    return 0


def report(samples: dict[str, list[float]], args: argparse.Namespace) -> None:
    ms = {s: [v * 1000 for v in vals] for s, vals in samples.items()}
    stats = {
        s: {
            "p50": percentile(v, 50),
            "p90": percentile(v, 90),
            "p99": percentile(v, 99),
            "mean": statistics.fmean(v),
        }
        for s, v in ms.items()
    }
    print(
        f"\npod create through kube-apiserver, {args.count} creates per scenario, sequential, "
        f"interleaved in rounds of {args.round} (after {args.warmup} warm-up each); "
        f"{os.cpu_count()} CPUs"
    )
    print(f"{'scenario':<10}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}"
          f"{'p50/vap':>9}{'p99/vap':>9}{'p99/none':>9}")  # fmt: skip
    for s in SCENARIOS:
        st = stats[s]
        print(
            f"{s:<10}{st['p50']:>9.2f}{st['p90']:>9.2f}{st['p99']:>9.2f}{st['mean']:>9.2f}"
            f"{st['p50'] / stats['vap']['p50']:>9.2f}{st['p99'] / stats['vap']['p99']:>9.2f}"
            f"{st['p99'] / stats['none']['p99']:>9.2f}"
        )
    ratio = stats["webhook"]["p99"] / stats["vap"]["p99"]
    verdict = "met" if ratio <= TARGET else "NOT met"
    print(f"\nwebhook p99 / VAP p99 = {ratio:.2f} (target <= {TARGET}: {verdict})")
    added = stats["webhook"]["p50"] - stats["none"]["p50"]
    print(f"the webhook adds {added:.2f} ms at p50 over no policy (a webhook round trip)")
    extra = stats["backstop"]["p50"] - stats["webhook"]["p50"]
    print(f"the backstop adds {extra:.2f} ms at p50 over the webhook alone")


if __name__ == "__main__":
    raise SystemExit(main())
