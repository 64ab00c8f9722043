#!/usr/bin/env python3
"""Throughput and latency of epguard's /validate, beside the floor of the same stack.

Starts two servers as separate processes, both uvicorn + TLS on loopback:

* ``epguard``: the real webhook (``python -m epguard.webhook``) with the built-in rules plus
  one deny rule;
* ``floor``: a bare FastAPI endpoint that reads the body, validates the same
  AdmissionReview envelope and answers "allowed" (encoded as epguard encodes its
  answers) -- the least any Python webhook on this stack can do.

Then drives each over keep-alive TLS connections (1, 8, 32) with a realistic
~10 KB elastic-EP pod (the webhook judges it fully: shell script split, flag
found, image normalized, rules and verdicts consulted, probe found, allowed),
and prints requests/s, p50 and p99 latency, the ratio to the floor, and the
webhook's resident memory. A benchmark prints figures; it asserts nothing.

    .venv/bin/python bench/webhook_bench.py [--seconds 5] [--connections 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster.process import free_port  # noqa: E402

BENCH_RULES = """
rules:
  - id: bench-deny-0516-cu129
    image: "docker.io/lmsysorg/sglang:v0.5.16-cu129"
    reason: "the image's mooncake build has no ep_2_11_0 extension"
    remedy: "use lmsysorg/sglang:v0.5.18-cu130"
"""


def realistic_pod() -> dict[str, Any]:
    """An elastic-EP SGLang worker pod as a StatefulSet controller would create it."""
    env = [{"name": f"NCCL_SETTING_{i}", "value": f"value-{i}"} for i in range(84)]
    env += [
        {"name": "MC_FORCE_TCP", "value": "0"},
        {"name": "MOONCAKE_PROTOCOL", "value": "rdma"},
        {
            "name": "POD_INDEX",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
            },
        },
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    ]
    script = (
        "set -euo pipefail\n"
        "echo starting rank $POD_INDEX\n"
        "exec python3 -m sglang.launch_server \\\n"
        "  --model-path /models/deepseek-ai/DeepSeek-V3-0324 \\\n"
        "  --served-model-name deepseek-v3 --trust-remote-code --host 0.0.0.0 --port 30000 \\\n"
        "  --tp 16 --dp 16 --enable-dp-attention --enable-dp-lm-head --moe-dense-tp-size 1 \\\n"
        "  --nnodes 2 --node-rank $POD_INDEX --dist-init-addr sglang-0.sglang:5000 \\\n"
        "  --moe-a2a-backend mooncake --deepep-mode low_latency --elastic-ep-backend mooncake \\\n"
        "  --mooncake-ib-device mlx5_0,mlx5_1,mlx5_2,mlx5_3 --enable-eplb \\\n"
        "  --ep-num-redundant-experts 32 --mem-fraction-static 0.82 --cuda-graph-max-bs 128\n"
    )
    resources = {
        "limits": {"nvidia.com/gpu": "8", "rdma/ib": "4", "memory": "1600Gi", "cpu": "180"},
        "requests": {"nvidia.com/gpu": "8", "rdma/ib": "4", "memory": "1600Gi", "cpu": "180"},
    }
    mounts = [
        {"name": "models", "mountPath": "/models", "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
        {
            "name": "kube-api-access-abcde",
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True,
        },
    ]
    worker = {
        "name": "worker",
        "image": "lmsysorg/sglang:v0.5.18-cu130",
        "imagePullPolicy": "IfNotPresent",
        "command": ["/bin/bash", "-c"],
        "args": [script],
        "env": env,
        "ports": [{"containerPort": 30000, "name": "http", "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": mounts,
        "readinessProbe": {"httpGet": {"path": "/health", "port": 30000}, "periodSeconds": 10},
        "securityContext": {"capabilities": {"add": ["IPC_LOCK", "SYS_RESOURCE"]}},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    probe = {
        "name": "epguard-probe",
        "image": "lmsysorg/sglang:v0.5.18-cu130",
        "command": ["python3", "/epguard/probe", "--termination-log", "/dev/termination-log", "--"],
        "args": ["/bin/bash", "-c", script],
        "env": env[:6],
        "resources": resources,
        "volumeMounts": [{"name": "epguard-probe", "mountPath": "/epguard"}],
    }
    download = {
        "name": "model-download",
        "image": "ghcr.io/example/hf-downloader:1.4",
        "args": ["--repo", "deepseek-ai/DeepSeek-V3-0324", "--dest", "/models"],
        "volumeMounts": mounts[:1],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "sglang-ep-1",
            "generateName": "sglang-ep-",
            "namespace": "inference",
            "labels": {
                "app": "sglang-ep",
                "apps.kubernetes.io/pod-index": "1",
                "controller-revision-hash": "sglang-ep-7c9d8f6b5d",
                "statefulset.kubernetes.io/pod-name": "sglang-ep-1",
            },
            "annotations": {
                "kubectl.kubernetes.io/default-container": "worker",
                "prometheus.io/scrape": "true",
                "prometheus.io/port": "30000",
            },
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "StatefulSet",
                    "name": "sglang-ep",
                    "uid": "0b6f1c1e-4a5e-4f1e-9a53-2f7c1d1e5b11",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "initContainers": [probe, download],
            "containers": [worker],
            "volumes": [
                {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
                {"name": "epguard-probe", "emptyDir": {}},
            ],
            "hostname": "sglang-ep-1",
            "subdomain": "sglang",
            "serviceAccountName": "default",
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 60,
            "dnsPolicy": "ClusterFirst",
            "schedulerName": "default-scheduler",
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                },
            ],
            "affinity": {
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {"matchLabels": {"app": "sglang-ep"}},
                            "topologyKey": "kubernetes.io/hostname",
                        }
                    ]
                }
            },
        },
    }


def review_bytes(obj: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "inference",
                "operation": "CREATE",
                "userInfo": {
                    "username": "system:serviceaccount:kube-system:statefulset-controller",
                    "uid": "c1a2",
                    "groups": ["system:serviceaccounts", "system:authenticated"],
                },
                "object": obj,
                "oldObject": None,
                "dryRun": False,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
            },
        }
    ).encode()


# -- the floor server -------------------------------------------------------------


def floor_app() -> Any:
    from epguard.webhook.admission.completion import encode
    from epguard.webhook.admission.handler import Outcome
    from epguard.webhook.engine.review import AdmissionReviewRequest

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    allowed = Outcome(True, "allowed")

    @app.post("/validate")
    async def validate(request: Request) -> Response:
        review = AdmissionReviewRequest.model_validate_json(await request.body())
        out = encode(review.apiVersion, review.request.uid, allowed)
        return Response(out, media_type="application/json")

    return app


def serve_floor(port: int, cert: str, key: str) -> None:
    import uvicorn

    uvicorn.run(
        floor_app(),
        host="127.0.0.1",
        port=port,
        ssl_certfile=cert,
        ssl_keyfile=key,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=75,
    )


# -- the load generator -------------------------------------------------------------


def _request(port: int, body: bytes) -> bytes:
    return (
        f"POST /validate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes) -> bytes:
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"unexpected response: {head[:200]!r}")
    return await reader.readexactly(length)


async def _drive(
    port: int, ctx: ssl.SSLContext, req: bytes, conns: int, seconds: float, warmup: float
) -> tuple[int, list[float], int]:
    streams = [
        await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")
        for _ in range(conns)
    ]
    latencies: list[float] = []
    count = 0
    everything = 0
    start = time.perf_counter()
    measure_from = start + warmup
    stop_at = measure_from + seconds

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count, everything
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            await _one(reader, writer, req)
            t1 = time.perf_counter()
            everything += 1
            if t0 >= measure_from:
                latencies.append(t1 - t0)
                count += 1

    await asyncio.gather(*(worker(r, w) for r, w in streams))
    for _, w in streams:
        w.close()
    return count, latencies, everything


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited early ({proc.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not start")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU the process has used (from /proc), to compare cost per request
    independently of how busy the rest of the machine is."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _rss_kib(pid: int) -> tuple[int, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            fields[k] = v.strip()
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=0.5, help="warm-up seconds per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per level")
    p.add_argument("--connections", default="1,8,32")
    p.add_argument("--serve-floor", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cert", help=argparse.SUPPRESS)
    p.add_argument("--key", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_floor:
        serve_floor(args.port, args.cert, args.key)
        return 0

    from tests.pki import issue, make_ca, write_pair

    levels = [int(x) for x in args.connections.split(",")]
    body = review_bytes(realistic_pod())
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        issued = issue(make_ca())
        write_pair(issued, t / "tls.crt", t / "tls.key")
        (t / "ca.crt").write_bytes(issued.ca_pem)
        (t / "rules.yaml").write_text(BENCH_RULES)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("EPGUARD_") and k != "KUBECONFIG"
        }
        wh_port, floor_port = free_port(), free_port()
        webhook = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "webhook",
                "--rules",
                str(t / "rules.yaml"),
                "--tls-cert",
                str(t / "tls.crt"),
                "--tls-key",
                str(t / "tls.key"),
                "--host",
                "127.0.0.1",
                "--port",
                str(wh_port),
                "--log-level",
                "warning",
            ],
            cwd=REPO,
            env=env,
        )
        floor = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve-floor",
                "--port",
                str(floor_port),
                "--cert",
                str(t / "tls.crt"),
                "--key",
                str(t / "tls.key"),
            ],
            cwd=REPO,
            env=env,
        )
        try:
            _wait_port(wh_port, webhook, "webhook")
            _wait_port(floor_port, floor, "floor server")
            ctx = ssl.create_default_context(cafile=str(t / "ca.crt"))
            results: dict[tuple[str, int], tuple[float, float, float]] = {}
            try:
                import uvloop

                uvloop.install()
            except ImportError:
                pass

            async def check() -> None:
                r, w = await asyncio.open_connection(
                    "127.0.0.1", wh_port, ssl=ctx, server_hostname="localhost"
                )
                answer = json.loads(await _one(r, w, _request(wh_port, body)))
                w.close()
                assert answer["response"]["allowed"] is True, answer
                assert "warnings" not in answer["response"], answer

            asyncio.run(check())
            rss_idle = _rss_kib(webhook.pid)[0]
            # The machine may be shared: alternate floor and epguard in short rounds and
            # pool the rounds, so a burst of someone else's load hits both alike.
            per_round = args.seconds / args.rounds
            cpu = {"floor": 0.0, "epguard": 0.0}
            served = {"floor": 0, "epguard": 0}
            for conns in levels:
                pooled: dict[str, tuple[int, list[float]]] = {"floor": (0, []), "epguard": (0, [])}
                for _ in range(args.rounds):
                    for name, port, pid in (
                        ("floor", floor_port, floor.pid),
                        ("epguard", wh_port, webhook.pid),
                    ):
                        cpu0 = _cpu_seconds(pid)
                        count, lat, everything = asyncio.run(
                            _drive(port, ctx, _request(port, body), conns, per_round, args.warmup)
                        )
                        cpu[name] += _cpu_seconds(pid) - cpu0
                        served[name] += everything
                        total, all_lat = pooled[name]
                        pooled[name] = (total + count, all_lat + lat)
                for name, (total, all_lat) in pooled.items():
                    results[(name, conns)] = (
                        total / args.seconds,
                        _pct(all_lat, 50) * 1e3,
                        _pct(all_lat, 99) * 1e3,
                    )
            rss, hwm = _rss_kib(webhook.pid)
        finally:
            for proc in (webhook, floor):
                proc.terminate()
            for proc in (webhook, floor):
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()

    print(
        f"epguard /validate benchmark: {len(body)} byte AdmissionReview (elastic-EP pod, judged "
        f"and allowed), TLS keep-alive, {args.seconds:.0f}s per level in "
        f"{args.rounds} alternating rounds (each after {args.warmup:.1f}s warm-up), "
        f"{os.cpu_count()} CPU(s)"
    )
    print(
        f"{'conns':>5} | {'floor req/s':>11} {'p50 ms':>7} {'p99 ms':>7} | "
        f"{'epguard req/s':>13} {'p50 ms':>7} {'p99 ms':>7} | {'ratio':>5}"
    )
    for conns in levels:
        f_rps, f50, f99 = results[("floor", conns)]
        e_rps, e50, e99 = results[("epguard", conns)]
        print(
            f"{conns:>5} | {f_rps:>11.0f} {f50:>7.2f} {f99:>7.2f} | {e_rps:>13.0f} {e50:>7.2f} "
            f"{e99:>7.2f} | {e_rps / f_rps:>5.2f}"
        )
    us = {n: cpu[n] / max(served[n], 1) * 1e6 for n in cpu}
    print(
        f"server CPU per request (all levels): floor {us['floor']:.0f} us, "
        f"epguard {us['epguard']:.0f} us -> {us['floor'] / us['epguard']:.2f}x the floor's "
        "throughput per core"
    )
    print(
        f"webhook resident memory: {rss / 1024:.1f} MiB after the run "
        f"({rss_idle / 1024:.1f} MiB idle, peak {hwm / 1024:.1f} MiB)"
    )
    ratios = {c: results[("epguard", c)][0] / results[("floor", c)][0] for c in levels}
    print("ratio to the floor: " + ", ".join(f"{c} conn {r:.2f}x" for c, r in ratios.items()))
    worst = min(ratios.values())
    p99_1 = results[("epguard", levels[0])][2]
    print(
        f"targets: throughput >= 0.90x floor (worst {worst:.2f}x); "
        f"p99 <= 2 ms at {levels[0]} connection(s) ({p99_1:.2f} ms; the floor's "
        f"{results[('floor', levels[0])][2]:.2f} ms)"
    )
    try:
        load1, load5, _ = os.getloadavg()
        print(f"machine load average during the run: {load1:.2f} (1 min), {load5:.2f} (5 min)")
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
