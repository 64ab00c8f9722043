"""The injection MutatingWebhookConfiguration as a real kube-apiserver (devcluster) applies
it: which pods it sends to /mutate. The rendered configuration is applied unchanged but
for its clientConfig, which points each webhook at a recording HTTPS server on loopback
(path = webhook name) instead of the in-cluster Service; the server allows everything and
records what it was sent. Pods are created with `--dry-run=server`: admission runs in
full (webhooks with sideEffects None are called), nothing is stored.

Also pins down why the namespace opt-in is a namespaceSelector and not CEL: the API
server declares `namespaceObject` for webhook matchConditions but leaves it null."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import os
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster import ControlPlane, MissingBinary
from epguard.webhook.controller import authority as certs
from tests.chart.chartlib import CACHE, NAMESPACE, render

pytestmark = pytest.mark.e2e

KUBECTL = CACHE / "bin" / "kubectl"
BY_NAMESPACE = "namespace.inject.epguard.io"
BY_ANNOTATION = "annotation.inject.epguard.io"
ON = {"epguard.io/inject": "enabled"}
FLAG = ["python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "mooncake"]
PLAIN = ["python3", "-m", "sglang.launch_server", "--tp", "8"]

Obj = dict[str, Any]


@dataclass
class Recorder:
    """Which webhook (request path) was called for which pod, in call order."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def called_for(self, pod: str) -> list[str]:
        with self.lock:
            return [hook for hook, name in self.calls if name == pod]


def serve(recorder: Recorder, cert_pem: bytes, key_pem: bytes) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            request = body["request"]
            with recorder.lock:
                recorder.calls.append((self.path.split("?")[0].strip("/"), request["name"]))
            answer = json.dumps(
                {
                    "apiVersion": "admission.k8s.io/v1",
                    "kind": "AdmissionReview",
                    "response": {"uid": request["uid"], "allowed": True},
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as tmp:
        crt, key = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        crt.write_bytes(cert_pem)
        key.write_bytes(key_pem)
        ctx.load_cert_chain(crt, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@dataclass
class Env:
    cp: ControlPlane
    recorder: Recorder
    base_url: str
    ca_bundle: str

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(KUBECTL), *args],
            input=stdin,
            env={**os.environ, "KUBECONFIG": str(self.cp.kubeconfig)},
            capture_output=True,
            text=True,
            timeout=120,
        )

    def apply(self, *objs: Obj) -> None:
        proc = self.kubectl("apply", "-f", "-", stdin="\n---\n".join(map(yaml.safe_dump, objs)))
        assert proc.returncode == 0, proc.stderr

    def create_dry_run(self, *pods: Obj) -> None:
        proc = self.kubectl(
            "create", "--dry-run=server", "-f", "-", stdin="\n---\n".join(map(yaml.safe_dump, pods))
        )
        assert proc.returncode == 0, proc.stderr

    def pointed_here(self, config: Obj) -> Obj:
        """The configuration with each webhook sent to this recorder, path = its name."""
        out: Obj = json.loads(json.dumps(config))
        for w in out["webhooks"]:
            w["clientConfig"] = {"url": f"{self.base_url}/{w['name']}", "caBundle": self.ca_bundle}
        return out

    def wait_active(self, namespace: str, annotations: dict[str, str], hook: str) -> None:
        """The API server picks up webhook configurations from an informer: send a pod
        that must reach `hook` until it does."""
        for attempt in range(120):
            name = f"warmup-{hook.split('.')[0]}-{attempt}"
            self.create_dry_run(pod(name, namespace, FLAG, annotations))
            if self.recorder.called_for(name):
                return
            time.sleep(0.25)
        raise AssertionError(f"the API server never called {hook}")


def pod(name: str, namespace: str, args: list[str], annotations: dict[str, str] | None) -> Obj:
    meta: Obj = {"name": name, "namespace": namespace}
    if annotations is not None:
        meta["annotations"] = annotations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "containers": [{"name": "worker", "image": "lmsysorg/sglang:v0.5.21", "args": args}]
        },
    }


NAMESPACES: dict[str, dict[str, str]] = {
    "team-a": ON,
    "team-b": {},
    "team-c": {"epguard.io/inject": "disabled"},
    "team-d": {**ON, "epguard.io/ignore": "true"},
    NAMESPACE: ON,
    "kube-system": ON,  # created by the API server itself
}


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    now = dt.datetime.now(dt.UTC)
    policy = certs.TLSPolicy(
        dns_names=("localhost",), ip_addresses=(ipaddress.ip_address("127.0.0.1"),)
    )
    tls = certs.reconcile(None, policy, now).data
    recorder = Recorder()
    server = serve(recorder, tls[certs.TLS_CRT], tls[certs.TLS_KEY])
    cp = ControlPlane()
    try:
        cp.start()
    except MissingBinary as exc:
        server.shutdown()
        pytest.fail(f"{exc} (run scripts/tools.sh)", pytrace=False)
    try:
        e = Env(
            cp,
            recorder,
            f"https://127.0.0.1:{server.server_address[1]}",
            base64.b64encode(tls[certs.CA_CRT]).decode(),
        )
        for name, labels in NAMESPACES.items():
            e.apply(
                {
                    "apiVersion": "v1",
                    "kind": "Namespace",
                    "metadata": {"name": name, "labels": labels},
                }
            )
        yield e
    finally:
        cp.stop()
        server.shutdown()


@pytest.fixture(scope="module")
def injection(env: Env) -> Env:
    (mwc,) = [o for o in render().objects if o["kind"] == "MutatingWebhookConfiguration"]
    env.apply(env.pointed_here(mwc))
    env.wait_active("team-a", {}, BY_NAMESPACE)
    env.wait_active("team-b", ON, BY_ANNOTATION)
    return env


# (pod name, namespace, mentions the flag, annotations, webhooks called)
CASES: list[tuple[str, str, bool, dict[str, str] | None, list[str]]] = [
    ("ns-opt-in", "team-a", True, None, [BY_NAMESPACE]),
    ("ns-and-annotation-opt-in-sent-once", "team-a", True, ON, [BY_NAMESPACE]),
    ("ns-opt-in-no-flag", "team-a", False, ON, []),
    ("annotation-opt-in", "team-b", True, ON, [BY_ANNOTATION]),
    ("annotation-opt-in-no-flag", "team-b", False, ON, []),
    ("no-opt-in", "team-b", True, None, []),
    ("annotation-disabled", "team-b", True, {"epguard.io/inject": "disabled"}, []),
    ("ns-disabled-annotation-opt-in", "team-c", True, ON, [BY_ANNOTATION]),
    ("ignored-namespace", "team-d", True, ON, []),
    ("release-namespace", NAMESPACE, True, ON, []),
    ("kube-system", "kube-system", True, ON, []),
]


def test_the_api_server_sends_exactly_the_opted_in_pods_that_mention_the_flag(
    injection: Env,
) -> None:
    pods = [pod(n, ns, FLAG if flag else PLAIN, ann) for n, ns, flag, ann, _ in CASES]
    injection.create_dry_run(*pods)
    got = {n: injection.recorder.called_for(n) for n, *_ in CASES}
    assert got == {n: expected for n, *_, expected in CASES}


def test_the_api_server_leaves_namespace_object_null_in_webhook_match_conditions(
    env: Env,
) -> None:
    """Why the namespace opt-in is a namespaceSelector: a condition on namespaceObject's
    labels would never be true. If this fails, a future Kubernetes binds namespaceObject
    for webhooks and the two injection webhooks could become one."""
    hook = "nsobject.probe.epguard.io"
    probe = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "epguard-test-namespace-object"},
        "webhooks": [
            {
                "name": hook,
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Ignore",
                "timeoutSeconds": 5,
                "clientConfig": {},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["pods"],
                        "operations": ["CREATE"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}},
                "matchConditions": [{"name": "null", "expression": "namespaceObject == null"}],
            }
        ],
    }
    env.apply(env.pointed_here(probe))
    try:
        # team-a exists and carries labels, yet the condition sees no namespace object.
        env.wait_active("team-a", {}, hook)
    finally:
        env.kubectl("delete", "mutatingwebhookconfiguration", "epguard-test-namespace-object")
