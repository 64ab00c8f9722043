#!/usr/bin/env python3
"""Pod-create latency through a real kube-apiserver, side by side:

* ``none``:    no admission policy for the pod (the API server's own cost: authn,
               authz, defaulting, validation, the built-in admission plugins, etcd);
* ``vap``:     the same rule as epguard's written as a ValidatingAdmissionPolicy (CEL,
               evaluated inside the API server -- the floor for any admission check);
* ``vap-refused``: that VAP refusing the rule-denied image (a refusal writes nothing to
               etcd, so it is compared with a refusal);
* ``floor``:   the least any webhook costs on this path: a bare FastAPI endpoint in
               epguard's own image (uvicorn + TLS, as epguard serves) that reads the
               review and answers "allowed", deployed as a pod behind a Service and
               called by the API server exactly as epguard's webhook is (its own
               ValidatingWebhookConfiguration, scoped to its namespace). What it costs
               over ``none`` is the API server's webhook call: encoding the review, the
               Service hop, TLS, and the answer -- none of it epguard's judging;
* ``webhook``: epguard's chart installed with helm on the real one-node cluster, exactly
               as ``make up`` does it: the webhook runs as the chart's pods and the API
               server calls it through its Service (the chart's ``service``
               clientConfig, kube-proxy's rules, the pod network, TLS from the
               controller-issued certificate); the outage backstop is not bound here;
* ``backstop``: the default install: the same webhook plus epguard's outage backstop
               (the controller's ValidatingAdmissionPolicy over its parameter shards,
               docs/backstop.md), for an elastic-EP pod both admit;
* ``refused-rule``: the same, for a pod on the rule-denied image, which the backstop
               refuses (the API server evaluates policies before it calls webhooks);
* ``refused-verdict``: the same, for a pod pinned to the digest of the last verdict of
               the last parameter shard.

The backstop scenarios run at each verdict count (``--counts``, default 1,000, 10,000
and 100,000 Unusable verdicts, each its own image and digest). The controller is scaled
to zero once it has installed the policy (so it does not rewrite the parameters), and
the shards are written from the compiler's output directly: creating 100,000
ImageVerdicts one POST at a time is too slow on a 2-core machine. The baselines are
measured again at every count, interleaved with the backstop's creates.

Each scenario gets its own namespace in that cluster (devcluster: etcd, kube-apiserver,
the node). The benchmark pods name a node that does not exist (``spec.nodeName``), so
the create is the whole of it: nothing schedules or runs them. The admitted pod is an
SGLang worker that asks for ``--elastic-ep-backend mooncake`` on an image no rule or
verdict names, so every check runs in full and admits. Creates are sequential POSTs over
one keep-alive HTTPS connection with the admin client certificate (httpx; no kubectl
process per request), interleaved in rounds so that noise from a shared machine falls
on all alike. Prints p50/p90/p99 per scenario and the ratios per count, with the targets
(the default install <= 1.3x the VAP at p50, a refusal <= 1.1x the VAP's refusal) as met
or not. A benchmark prints figures; it asserts nothing.

    .venv/bin/python bench/admission_latency.py [--count 300] [--round 25] [--warmup 30]
        [--counts 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
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
from kubernetes import config as kube_config

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster import ControlPlane  # noqa: E402
from devcluster.images import EPGUARD_IMAGE  # noqa: E402
from devcluster.pki import CertificateAuthority  # noqa: E402
from devcluster.stack import CHART_DIR, Stack, deploy_chart, start_cluster  # noqa: E402
from epguard.webhook.controller.backstop import write_params  # noqa: E402
from epguard.webhook.controller.compiler import DIGEST_KEY, BackstopConfig, compile_params  # noqa: E402
from epguard.webhook.engine.text import stamp  # noqa: E402
from epguard.webhook.engine.verdicts import VerdictStore, verdict_from_object  # noqa: E402

SCENARIOS = (
    "none", "vap", "vap-refused", "floor", "webhook", "backstop", "refused-rule",
    "refused-verdict",
)  # fmt: skip
# vap-refused and refused-* reuse these
NAMESPACED = ("none", "vap", "floor", "webhook", "backstop")
FLOOR = "epguard-bench-floor"
# The floor webhook: read the review, answer "allowed" with its uid (what any webhook
# must do at the least), on epguard's server stack (uvicorn, httptools, TLS).
FLOOR_APP = """
import json, uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
app = FastAPI()
@app.post("/validate")
async def validate(request: Request) -> Response:
    body = await request.body()
    review = json.loads(body)
    response = {"uid": review["request"]["uid"], "allowed": b"floor-refuse" not in body}
    if not response["allowed"]:  # lets the benchmark check that it is called
        response["status"] = {"code": 403, "message": "refused by the floor webhook"}
    answer = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "response": response}
    return Response(json.dumps(answer), media_type="application/json")
uvicorn.run(app, host="0.0.0.0", port=8443, ssl_certfile="/tls/tls.crt",
            ssl_keyfile="/tls/tls.key", log_level="warning", http="httptools")
"""
BACKSTOP = "epguard-backstop"
EXPECTED = {"vap-refused": 403, "refused-rule": 403, "refused-verdict": 403}
TARGET_ADMITTED = 1.3  # the default install's p50 over the VAP's
TARGET_REFUSED = 1.1  # a backstop refusal's p50 over the VAP's refusal
BAD_PREFIX = "registry.example.com/bench/sglang:bad-"
GOOD_IMAGE = "registry.example.com/bench/sglang:v0.5.18-cu130"
RULE_ID = "bench-bad-image"

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
                        # As the backstop's refusal: 403, not the default 422.
                        "reason": "Forbidden",
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
    """The cluster and epguard as `make up` brings them up, the rule, the VAP, one
    namespace per measured place; the controller stopped once its policy holds the
    rule, and the backstop's bindings narrowed to the backstop's namespace."""
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
    namespaces = {s: f"bench-{s}-{suffix}" for s in NAMESPACED}
    namespaces["vap-refused"] = namespaces["vap"]
    namespaces["refused-rule"] = namespaces["refused-verdict"] = namespaces["backstop"]
    for scenario, ns in namespaces.items():
        if scenario not in NAMESPACED:
            continue
        cp.kubectl("create", "namespace", ns, check=True)
        if scenario in ("none", "vap", "floor"):  # out of epguard's webhooks' and backstop's reach
            cp.kubectl("label", "namespace", ns, "epguard.io/ignore=true", check=True)
        # kube-controller-manager makes the `default` ServiceAccount a pod needs.
        until(lambda ns=ns: cp.kubectl("get", "sa", "default", "-n", ns).returncode == 0,
              f"the default ServiceAccount in {ns}")  # fmt: skip
    deploy_floor(cp, namespaces["floor"])
    objs = vap_objects(namespaces["vap"])
    cp.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
               "items": objs}), check=True)  # fmt: skip
    # The controller puts the rule into the policy; then it is stopped, so the shards
    # written below stay as written and the bindings as narrowed.
    until(lambda: RULE_ID in cp.kubectl("get", "validatingadmissionpolicy", BACKSTOP,
                                        "-o", "json").stdout,
          "the controller to compile the rule into the backstop policy", timeout=120)  # fmt: skip
    cp.kubectl("scale", "deployment", "epguard-controller", "-n", "epguard-system",
               "--replicas=0", check=True)  # fmt: skip
    until(lambda: cp.kubectl("get", "pods", "-n", "epguard-system", "-l",
                             "app.kubernetes.io/component=controller", "-o", "name"
                             ).stdout.strip() == "",
          "the controller to stop", timeout=120)  # fmt: skip
    rebind_backstop(cp, [namespaces["backstop"]])
    return cp, namespaces


def deploy_floor(cp: ControlPlane, namespace: str) -> None:
    """The floor webhook (see the module's docstring) as a pod, a Service and a
    ValidatingWebhookConfiguration for ``namespace`` only, with a serving certificate
    from a CA made here."""
    ca = CertificateAuthority()
    host = f"{FLOOR}.epguard-system.svc"
    pair = ca.issue_serving(FLOOR, dns_names=[host], ips=[])
    labels = {"app": FLOOR}
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
         "metadata": {"name": FLOOR, "namespace": "epguard-system"},
         "data": {"tls.crt": base64.b64encode(pair.cert).decode(),
                  "tls.key": base64.b64encode(pair.key).decode()}},
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": FLOOR, "namespace": "epguard-system", "labels": labels},
         "spec": {"containers": [{
             "name": "floor", "image": EPGUARD_IMAGE, "imagePullPolicy": "IfNotPresent",
             "command": ["python3", "-c", FLOOR_APP],
             "ports": [{"containerPort": 8443}],
             "readinessProbe": {"tcpSocket": {"port": 8443}, "periodSeconds": 1},
             "volumeMounts": [{"name": "tls", "mountPath": "/tls", "readOnly": True}]}],
             "volumes": [{"name": "tls", "secret": {"secretName": FLOOR}}]}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": FLOOR, "namespace": "epguard-system"},
         "spec": {"selector": labels, "ports": [{"port": 443, "targetPort": 8443}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1",
         "kind": "ValidatingWebhookConfiguration", "metadata": {"name": FLOOR},
         "webhooks": [{
             "name": "floor.bench.epguard.io", "admissionReviewVersions": ["v1"],
             "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 5,
             "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
             "rules": [{"apiGroups": [""], "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"], "resources": ["pods"]}],
             "clientConfig": {"caBundle": base64.b64encode(ca.cert_pem).decode(),
                              "service": {"name": FLOOR, "namespace": "epguard-system",
                                          "path": "/validate", "port": 443}}}]},
    ]  # fmt: skip
    cp.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
               "items": objects}), check=True)  # fmt: skip
    cp.kubectl("wait", "--for=condition=Ready", f"pod/{FLOOR}", "-n", "epguard-system",
               "--timeout=120s", check=True)  # fmt: skip


def rebind_backstop(cp: ControlPlane, namespaces: list[str]) -> None:
    """Narrow the backstop's bindings to the backstop scenarios' namespace, so
    ``webhook`` measures the webhook alone."""
    for mode in ("enforce", "warn", "audit"):
        name = f"{BACKSTOP}-{mode}"
        binding = json.loads(cp.kubectl("get", "validatingadmissionpolicybinding", name,
                                        "-o", "json", check=True).stdout)  # fmt: skip
        selector = binding["spec"]["matchResources"]["namespaceSelector"]
        selector.setdefault("matchExpressions", []).append(
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": namespaces}
        )
        cp.kubectl("replace", "-f", "-", input=json.dumps(binding), check=True)


def bench_digest(n: int, i: int) -> str:
    return "sha256:" + f"{n:08x}{i:08x}" * 4


def write_verdicts(cp: ControlPlane, n: int) -> str:
    """Write the parameters for ``n`` Unusable verdicts, each its own image and digest
    (as the controller would compile them); returns the image of the last digest entry
    of the last shard, once the API server refuses it."""
    now = dt.datetime.now(dt.UTC)
    seen = stamp(now)
    store = VerdictStore(tag_ttl=dt.timedelta(hours=24), cap=max(n, 1))
    objects = (
        {
            "metadata": {"name": bench_digest(n, i).replace(":", "-")},
            "spec": {
                "image": f"registry.example.com/team-{i % 100}/sglang:n{n}-b{i}",
                "digest": bench_digest(n, i),
                "verdict": "Unusable",
                "reason": f"libcudart.so.12 is missing (build {i % 7})",
                "pod": "ml/sglang-0",
                "lastSeen": seen,
            },
        }
        for i in range(n)
    )
    store.replace(v for v in map(verdict_from_object, objects) if v is not None)
    t0 = time.perf_counter()
    params = compile_params(store, now)
    took = time.perf_counter() - t0
    api = kube_config.new_client_from_config(str(cp.kubeconfig))
    try:
        write_params(api, BackstopConfig(params_namespace="epguard-system", name=BACKSTOP), params)
    finally:
        api.close()
    print(f"{n} verdicts: compiled in {took:.2f}s into {len(params.shards)} shards "
          f"({params.kept} entries, {params.dropped} dropped)", file=sys.stderr)  # fmt: skip
    by_key = {bench_digest(n, i)[7 : 7 + DIGEST_KEY]: i for i in range(n)}
    last = list(params.shards[-1]["d"])[-1]
    return f"registry.example.com/team-{by_key[last] % 100}/sglang@{bench_digest(n, by_key[last])}"


class Images:
    """What each scenario creates."""

    def __init__(self) -> None:
        self.verdict_image = GOOD_IMAGE

    def __call__(self, scenario: str) -> str:
        if scenario in ("vap-refused", "refused-rule"):
            return BAD_PREFIX + "1"
        if scenario == "refused-verdict":
            return self.verdict_image
        return GOOD_IMAGE


def check_policies(creator: Creator, namespaces: dict[str, str], image: Images) -> None:
    """Each scenario does what it claims: the bad image is refused by the VAP and by
    epguard, and admitted where no policy applies."""
    _, r = creator.create(namespaces["none"], BAD_PREFIX + "1")
    if r.status_code != 201:
        raise SystemExit(f"none: expected 201, got {r.status_code}: {r.text}")

    def refused(scenario: str, marker: str, img: str = BAD_PREFIX + "1") -> bool:
        _, r = creator.create(namespaces[scenario], img)
        return r.status_code in (403, 422) and marker in r.text

    until(lambda: refused("vap", "ValidatingAdmissionPolicy"), "the VAP to take effect")
    until(lambda: refused("floor", "refused by the floor webhook", GOOD_IMAGE + "-floor-refuse"),
          "the floor webhook to be called")  # fmt: skip
    until(lambda: refused("webhook", f"[epguard rule {RULE_ID}]"), "epguard to judge")
    until(lambda: not refused("webhook", "ValidatingAdmissionPolicy"), "the rebinding")
    until(lambda: refused("backstop", f"'{BACKSTOP}-enforce'"), "the backstop to refuse")
    until(lambda: refused("backstop", f"'{BACKSTOP}-enforce'", image("refused-verdict")),
          "the backstop to refuse the last verdict")  # fmt: skip
    for scenario, ns in namespaces.items():
        _, r = creator.create(ns, image(scenario))
        if r.status_code != EXPECTED.get(scenario, 201):
            raise SystemExit(f"{scenario}: unexpected answer {r.status_code}: {r.text}")


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def measure(
    creator: Creator, namespaces: dict[str, str], image: Images, args: argparse.Namespace
) -> dict[str, list[float]]:
    for _ in range(args.warmup):
        for scenario, ns in namespaces.items():
            creator.create(ns, image(scenario))
    samples: dict[str, list[float]] = {s: [] for s in SCENARIOS}
    while any(len(v) < args.count for v in samples.values()):
        for scenario in SCENARIOS:
            for _ in range(min(args.round, args.count - len(samples[scenario]))):
                took, r = creator.create(namespaces[scenario], image(scenario))
                if r.status_code != EXPECTED.get(scenario, 201):
                    raise SystemExit(f"{scenario}: create failed: {r.status_code} {r.text}")
                samples[scenario].append(took)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300, help="measured creates per scenario")
    parser.add_argument("--round", type=int, default=25, help="creates per scenario per round")
    parser.add_argument("--warmup", type=int, default=30, help="unmeasured creates per scenario")
    parser.add_argument("--counts", default="1000,10000,100000", help="verdict counts")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="epguard-bench-") as tmp:
        stack = Stack(run_dir=Path(tmp) / "run", detached=False)
        creator: Creator | None = None
        try:
            cp, namespaces = setup(stack)
            creator = Creator(cp)
            image = Images()
            summary: list[tuple[int, dict[str, dict[str, float]]]] = []
            for n in (int(c) for c in args.counts.split(",")):
                image.verdict_image = write_verdicts(cp, n)
                check_policies(creator, namespaces, image)
                print(f"measuring {args.count} creates per scenario at {n} verdicts ...",
                      file=sys.stderr)  # fmt: skip
                summary.append((n, report(n, measure(creator, namespaces, image, args), args)))
            print("\nsummary (p50 ms; ratio to the VAP's p50 for the same answer)")
            print(f"{'verdicts':>9}{'vap':>8}{'backstop':>10}{'ratio':>7}{'vap-ref':>9}"
                  f"{'rule':>8}{'ratio':>7}{'verdict':>9}{'ratio':>7}")  # fmt: skip
            for n, st in summary:
                v, vr = st["vap"]["p50"], st["vap-refused"]["p50"]
                print(f"{n:>9}{v:>8.2f}{st['backstop']['p50']:>10.2f}"
                      f"{st['backstop']['p50'] / v:>7.2f}{vr:>9.2f}"
                      f"{st['refused-rule']['p50']:>8.2f}{st['refused-rule']['p50'] / vr:>7.2f}"
                      f"{st['refused-verdict']['p50']:>9.2f}"
                      f"{st['refused-verdict']['p50'] / vr:>7.2f}")  # fmt: skip
        finally:
            if creator is not None:
                creator.close()
            stack.stop()
    return 0


def report(
    n: int, samples: dict[str, list[float]], args: argparse.Namespace
) -> dict[str, dict[str, float]]:
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
        f"\n{n} verdicts: pod create through kube-apiserver, {args.count} creates per "
        f"scenario, sequential, interleaved in rounds of {args.round} (after {args.warmup} "
        f"warm-up each); {os.cpu_count()} CPUs"
    )
    print(f"{'scenario':<16}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}"
          f"{'p50/vap':>9}{'p99/vap':>9}")  # fmt: skip
    for s in SCENARIOS:
        st = stats[s]
        base = stats["vap-refused" if EXPECTED.get(s) == 403 else "vap"]
        print(
            f"{s:<16}{st['p50']:>9.2f}{st['p90']:>9.2f}{st['p99']:>9.2f}{st['mean']:>9.2f}"
            f"{st['p50'] / base['p50']:>9.2f}{st['p99'] / base['p99']:>9.2f}"
        )
    admitted = stats["backstop"]["p50"] / stats["vap"]["p50"]
    print(
        f"default install (webhook + backstop) p50 / VAP p50 = {admitted:.2f} "
        f"(target <= {TARGET_ADMITTED}: {'met' if admitted <= TARGET_ADMITTED else 'NOT met'})"
    )
    for s in ("refused-rule", "refused-verdict"):
        r = stats[s]["p50"] / stats["vap-refused"]["p50"]
        print(
            f"{s} p50 / VAP refusal p50 = {r:.2f} "
            f"(target <= {TARGET_REFUSED}: {'met' if r <= TARGET_REFUSED else 'NOT met'})"
        )
    floor = stats["floor"]["p50"] / stats["vap"]["p50"]
    print(
        f"the floor webhook (answers allowed, judges nothing) p50 / VAP p50 = {floor:.2f}: "
        f"what any webhook on this path costs; epguard's webhook is "
        f"{stats['webhook']['p50'] - stats['floor']['p50']:+.2f} ms beside it"
    )
    extra = stats["backstop"]["p50"] - stats["webhook"]["p50"]
    print(
        f"the backstop adds {extra:.2f} ms at p50 over the webhook alone; "
        f"the webhook adds {stats['webhook']['p50'] - stats['none']['p50']:.2f} ms over none"
    )
    return stats


if __name__ == "__main__":
    raise SystemExit(main())
