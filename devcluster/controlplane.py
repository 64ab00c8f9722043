"""A real etcd + kube-apiserver on loopback, the way controller-runtime's envtest runs them.

There is no kubelet, scheduler or kube-controller-manager: objects are stored,
validated, defaulted and put through admission (webhooks and
ValidatingAdmissionPolicies included) exactly as in a cluster, but nothing runs
them. Consequences worth knowing:

* Deployments get no ReplicaSets and Pods stay ``Pending`` forever; tests write
  pod status themselves when they need it.
* No namespace gets a ``default`` ServiceAccount (the service-account controller
  makes those). With the ``ServiceAccount`` admission plugin on, every plain Pod
  would be refused with ``serviceaccount "default" not found``; like envtest, we
  disable that one plugin (``--disable-admission-plugins=ServiceAccount``) so
  ``kubectl apply`` of an ordinary Pod works. Everything else in the default
  admission chain stays on.
* Deleting a namespace leaves it ``Terminating`` (the namespace controller
  finalizes it): tests use fresh namespace names instead of deleting.

Usage::

    with ControlPlane() as cp:
        cp.kubectl("get", "ns")
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from devcluster import binaries, pki
from devcluster.process import ManagedProcess, free_port

# The first address of this range becomes the `kubernetes` Service's ClusterIP.
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
ADMIN_USER = "epguard-admin"
_PORT_ATTEMPTS = 3
_WORK_PREFIX = "epguard-cp-"
_DATA_PREFIX = "epguard-etcd-"
_OWNER_FILE = ".owner.json"
START_TIMEOUT = 180.0  # seconds; two shared cores make the first start slow
# Already on by default in 1.35; named so that a change of defaults cannot
# silently take away what epguard and its tests rely on.
ADMISSION_PLUGINS = "MutatingAdmissionWebhook,ValidatingAdmissionWebhook,ValidatingAdmissionPolicy"


class ControlPlaneError(RuntimeError):
    """The control plane could not start; the message carries the failing log's tail."""


@dataclass(frozen=True)
class Endpoints:
    etcd_client_port: int
    etcd_peer_port: int
    apiserver_port: int

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_client_port}"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"


class ControlPlane:
    """etcd + kube-apiserver with generated PKI, RBAC, and a kubeconfig for an admin.

    ``workdir`` holds certificates, the kubeconfig and the logs; by default a
    fresh temporary directory, removed by :meth:`stop`. etcd's data always lives
    in its own temporary directory. ``detached`` processes survive this Python
    process (for ``python -m devcluster up``); attached ones die with it.
    """

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        detached: bool = False,
        node_ip: str | None = None,
    ) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix=_WORK_PREFIX)) if workdir is None else workdir
        self.detached = detached
        # Set when a real node (devcluster.node) joins: the API server then also listens
        # on the node's address, so pods reach it through the `kubernetes` Service, and
        # runs the admission and authorization a kubelet needs (Node, NodeRestriction).
        self.node_ip = node_ip
        self.processes: list[ManagedProcess] = []
        self.endpoints: Endpoints | None = None
        self.data_dir: Path | None = None

    # --- paths -----------------------------------------------------------------

    @property
    def pki_dir(self) -> Path:
        return self.workdir / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.pki_dir / "ca.crt"

    @property
    def server(self) -> str:
        if self.endpoints is None:
            raise ControlPlaneError("control plane not started")
        return self.endpoints.server

    # --- lifecycle -------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        etcd = binaries.find("etcd")
        apiserver = binaries.find("kube-apiserver")
        _remove_orphaned_dirs()
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self.data_dir = Path(tempfile.mkdtemp(prefix=_DATA_PREFIX))
        if not self.detached:
            # Belt and braces with PDEATHSIG: a normal interpreter exit that skipped
            # stop() (an exception in a test session, a forgotten `with`) still cleans up.
            atexit.register(self.stop)
        try:
            self._write_pki()
            for attempt in range(_PORT_ATTEMPTS):
                self.endpoints = Endpoints(free_port(), free_port(), free_port())
                try:
                    self._start_etcd(etcd)
                    self._start_apiserver(apiserver)
                    break
                except ControlPlaneError as e:
                    # free_port() cannot reserve a port: another process may bind it
                    # first. Rare, and the cure is simply other ports.
                    if "address already in use" not in str(e) or attempt + 1 == _PORT_ATTEMPTS:
                        raise
                    self._stop_processes()
                    shutil.rmtree(self.data_dir, ignore_errors=True)
                    self.data_dir.mkdir()
            self._write_kubeconfig()
        except BaseException:
            self.stop()
            raise

    def _stop_processes(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes = []

    def stop(self) -> None:
        """Stop the API server first (it would log etcd errors otherwise), then etcd."""
        self._stop_processes()
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path) -> Path:
        """A kubeconfig that acts as ServiceAccount ``namespace/name`` (a TokenRequest
        token), so a local process runs with exactly the RBAC the chart gives it in a
        cluster rather than as cluster-admin."""
        r = self.kubectl("create", "token", name, "-n", namespace, "--duration=24h")
        if r.returncode != 0:
            raise ControlPlaneError(f"no token for {namespace}/{name}: {r.stderr.strip()}")
        write_kubeconfig(
            path,
            server=self.server,
            ca=self.ca_file.read_bytes(),
            user=f"system:serviceaccount:{namespace}:{name}",
            credentials={"token": r.stdout.strip()},
        )
        return path

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again on the same port, with etcd (and so
        every object) kept: what clients see when a control plane is upgraded."""
        apiserver = [p for p in self.processes if p.name == "kube-apiserver"]
        for proc in apiserver:
            proc.stop()
            self.processes.remove(proc)
        self._start_apiserver(binaries.find("kube-apiserver"))

    def alive(self) -> bool:
        return bool(self.processes) and all(p.alive() for p in self.processes)

    # --- persisted state (for the detached CLI) ----------------------------------

    def to_dict(self) -> dict[str, Any]:
        if self.endpoints is None:
            raise ControlPlaneError("control plane not started")
        return {
            "workdir": str(self.workdir),
            "data_dir": str(self.data_dir) if self.data_dir else None,
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "etcd_client_port": self.endpoints.etcd_client_port,
            "etcd_peer_port": self.endpoints.etcd_peer_port,
            "apiserver_port": self.endpoints.apiserver_port,
            "node_ip": self.node_ip,
            "processes": [p.to_dict() for p in self.processes],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ControlPlane:
        """Re-attach to a detached control plane started by an earlier process."""
        cp = cls(Path(data["workdir"]), detached=True, node_ip=data.get("node_ip"))
        cp.data_dir = Path(data["data_dir"]) if data.get("data_dir") else None
        cp.endpoints = Endpoints(
            int(data["etcd_client_port"]), int(data["etcd_peer_port"]), int(data["apiserver_port"])
        )
        cp.processes = [ManagedProcess.from_dict(p) for p in data["processes"]]
        return cp

    # --- clients ---------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = False, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this control plane; output is captured as text."""
        return subprocess.run(
            [str(binaries.find("kubectl")), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            env=_client_env(),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """Client TLS for talking to the API server as the admin (CA-verified)."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.pki_dir / "admin.crt"), str(self.pki_dir / "admin.key"))
        return ctx

    # --- internals -------------------------------------------------------------

    def _write_pki(self) -> None:
        self.pki_dir.mkdir(parents=True, exist_ok=True)
        ca = pki.CertificateAuthority()
        self.ca_file.write_bytes(ca.cert_pem)
        pki.write_private(self.pki_dir / "ca.key", ca.pair.key)
        # 10.0.0.1 and the kubernetes.default names: what in-cluster clients would
        # dial; harmless here, and it keeps the certificate a realistic one.
        ca.issue_serving(
            "kube-apiserver",
            dns_names=[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            ips=["127.0.0.1", "::1", "10.0.0.1", *([self.node_ip] if self.node_ip else [])],
        ).write(self.pki_dir / "apiserver.crt", self.pki_dir / "apiserver.key")
        # What the API server shows a kubelet when it asks for logs or exec.
        ca.issue_client("kube-apiserver-kubelet-client", ["system:masters"]).write(
            self.pki_dir / "apiserver-kubelet-client.crt",
            self.pki_dir / "apiserver-kubelet-client.key",
        )
        ca.issue_client(ADMIN_USER, ["system:masters"]).write(
            self.pki_dir / "admin.crt", self.pki_dir / "admin.key"
        )
        sa_key, sa_pub = pki.service_account_keys()
        pki.write_private(self.pki_dir / "sa.key", sa_key)
        (self.pki_dir / "sa.pub").write_bytes(sa_pub)

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess.spawn(
            name,
            argv,
            self.workdir / "logs" / f"{name}.log",
            env=_server_env(),
            detached=self.detached,
        )
        self.processes.append(proc)
        return proc

    def _start_etcd(self, etcd: Path) -> None:
        assert self.endpoints is not None and self.data_dir is not None
        ep = self.endpoints
        peer = f"http://127.0.0.1:{ep.etcd_peer_port}"
        proc = self._spawn(
            "etcd",
            [
                str(etcd),
                "--name=default",
                f"--data-dir={self.data_dir}",
                f"--listen-client-urls={ep.etcd_url}",
                f"--advertise-client-urls={ep.etcd_url}",
                # The peer port must be explicit too: the default (2380) would collide
                # with any other etcd on the machine, including another test session.
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                # Throwaway data: durability buys nothing and fsync dominates write latency.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        # The temporary directories belong to this etcd: once it is gone (even if
        # whoever started it was SIGKILLed and never cleaned up), they are garbage.
        for d in (self.data_dir, self.workdir if self._own_workdir else None):
            if d is not None:
                (d / _OWNER_FILE).write_text(json.dumps(proc.to_dict()))
        self._wait(proc, lambda c: _etcd_healthy(c, ep.etcd_url), "etcd /health")

    def apiserver_args(self) -> list[str]:
        assert self.endpoints is not None
        ep, d = self.endpoints, self.pki_dir
        return [
            f"--etcd-servers={ep.etcd_url}",
            *self._placement_args(),
            f"--secure-port={ep.apiserver_port}",
            f"--cert-dir={d}",
            f"--tls-cert-file={d / 'apiserver.crt'}",
            f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--client-ca-file={self.ca_file}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            f"--service-account-issuer={ep.server}",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--allow-privileged=true",
            "--profiling=false",
        ]

    def _placement_args(self) -> list[str]:
        d = self.pki_dir
        if self.node_ip is None:
            return [
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                "--authorization-mode=RBAC",
                f"--enable-admission-plugins={ADMISSION_PLUGINS}",
                # See the module docstring: no controller creates default ServiceAccounts.
                "--disable-admission-plugins=ServiceAccount",
            ]
        return [
            # Pods reach the API server at the `kubernetes` Service's endpoint, which is
            # the advertised address: the node's own, so it must listen there too.
            "--bind-address=0.0.0.0",
            f"--advertise-address={self.node_ip}",
            "--authorization-mode=Node,RBAC",
            # kube-controller-manager makes default ServiceAccounts, so the
            # ServiceAccount plugin stays on, as in any cluster.
            f"--enable-admission-plugins={ADMISSION_PLUGINS},NodeRestriction",
            f"--kubelet-client-certificate={d / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={d / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={self.ca_file}",
            "--kubelet-preferred-address-types=InternalIP",
        ]

    def _start_apiserver(self, apiserver: Path) -> None:
        proc = self._spawn("kube-apiserver", [str(apiserver), *self.apiserver_args()])
        ctx = self.ssl_context()
        self._wait(proc, lambda c: _apiserver_ready(c, self.server, ctx), "kube-apiserver /readyz")

    def _wait(
        self,
        proc: ManagedProcess,
        ready: Callable[[httpx.Client], bool],
        what: str,
        timeout: float = START_TIMEOUT,
    ) -> None:
        deadline = time.monotonic() + timeout
        last_error = ""
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                if not proc.alive():
                    raise ControlPlaneError(
                        f"{proc.name} exited during start-up; last log lines:\n{proc.log_tail()}"
                    )
                try:
                    if ready(client):
                        return
                except httpx.HTTPError as e:
                    last_error = repr(e)
                if time.monotonic() > deadline:
                    raise ControlPlaneError(
                        f"{what} not ready after {timeout:.0f}s ({last_error}); "
                        f"last log lines:\n{proc.log_tail()}"
                    )
                time.sleep(0.2)

    def _write_kubeconfig(self) -> None:
        write_kubeconfig(
            self.kubeconfig,
            server=self.server,
            ca=self.ca_file.read_bytes(),
            client_cert=(self.pki_dir / "admin.crt").read_bytes(),
            client_key=(self.pki_dir / "admin.key").read_bytes(),
        )


def _remove_orphaned_dirs() -> None:
    """Delete temporary control-plane directories whose etcd no longer runs."""
    tmp = Path(tempfile.gettempdir())
    for d in [*tmp.glob(f"{_WORK_PREFIX}*"), *tmp.glob(f"{_DATA_PREFIX}*")]:
        try:
            owner = ManagedProcess.from_dict(json.loads((d / _OWNER_FILE).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours to judge: being created right now, or not a devcluster dir
        if not owner.alive():
            shutil.rmtree(d, ignore_errors=True)


def _etcd_healthy(client: httpx.Client, url: str) -> bool:
    r = client.get(f"{url}/health")
    return r.status_code == 200 and json.loads(r.text).get("health") == "true"


def _apiserver_ready(client: httpx.Client, server: str, ctx: ssl.SSLContext) -> bool:
    # A per-request verify context is deprecated in httpx; a short-lived client is cheap.
    with httpx.Client(verify=ctx, timeout=5.0, trust_env=False) as tls:
        return tls.get(f"{server}/readyz").status_code == 200


def write_kubeconfig(
    path: Path,
    *,
    server: str,
    ca: bytes,
    user: str = "",
    credentials: Mapping[str, str] | None = None,
    client_cert: bytes = b"",
    client_key: bytes = b"",
) -> None:
    """A self-contained kubeconfig (credentials embedded), readable by its owner only:
    a client certificate, or other ``credentials`` such as ``{"token": ...}``."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    user = user or ADMIN_USER
    creds = dict(credentials or {}) or {
        "client-certificate-data": b64(client_cert),
        "client-key-data": b64(client_key),
    }

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "epguard-dev",
                "cluster": {"server": server, "certificate-authority-data": b64(ca)},
            }
        ],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "epguard-dev", "context": {"cluster": "epguard-dev", "user": user}}],
        "current-context": "epguard-dev",
    }
    pki.write_private(path, yaml.safe_dump(config, sort_keys=False).encode())


def _server_env() -> dict[str, str]:
    # The API server dials webhooks on 127.0.0.1; a proxy inherited from the
    # developer's shell must never sit in between.
    env = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARS}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost,::1"
    return env


def _client_env() -> dict[str, str]:
    env = _server_env()
    # A KUBECONFIG from the caller's shell must not merge into ours.
    env.pop("KUBECONFIG", None)
    return env


_PROXY_VARS = frozenset({"http_proxy", "https_proxy", "all_proxy", "no_proxy"})
