"""The detached dev stack behind ``python -m devcluster up|down|status`` (``make up``/``down``).

``up`` starts a real one-node cluster: the control plane (etcd + kube-apiserver), the
node (:mod:`devcluster.node`: containerd, runc, CNI, kubelet, kube-scheduler,
kube-controller-manager, kube-proxy), imports the epguard image built from the
``Dockerfile`` (:mod:`devcluster.images`), and ``helm install``s the chart as an admin
would: the webhook and the controller run as the chart's pods, with its
ServiceAccounts, RBAC and self-managed TLS, and the webhook configurations keep the
chart's ``service`` clientConfig. See :func:`deploy_chart`.

The e2e tests that predate the node still use the older arrangement below
(:func:`deploy_epguard`) on a control plane without a node, each stage guarded so
that it works with whatever parts of epguard exist:

1. the control plane (etcd + kube-apiserver, see :mod:`devcluster.controlplane`);
2. ``helm upgrade --install`` of ``charts/epguard`` into ``epguard-system`` (objects
   that need a kubelet are stored but never run);
3. the webhook (``python -m epguard.webhook``) as a local process on 127.0.0.1, with a
   serving certificate for 127.0.0.1 from a dev CA;
4. the controller (``python -m epguard.webhook.controller``) as a local process;
5. the chart's ValidatingWebhookConfiguration pointed at the local webhook:
   ``clientConfig.url`` plus the dev CA as ``caBundle``.

The controller runs with ``--manage-certs=false`` here: its certificates are
issued for the in-cluster Service name, which the API server cannot reach in a
cluster without Services; the local webhook's certificate must name 127.0.0.1.

Everything ``up`` starts is recorded in ``<run dir>/state.json`` (pids with
their start times, ports, paths) so that ``down`` stops exactly that and
nothing else, even from another shell.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from devcluster import binaries, images
from devcluster.controlplane import ControlPlane, ControlPlaneError
from devcluster.node import Node, node_ip
from devcluster.process import ManagedProcess, free_port
from devcluster.webhooktls import LocalWebhookTLS, WebhookTLSError, set_client_config
from epguard.webhook.engine.rules import default_rules_path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RUN_DIR = REPO_ROOT / ".run"
CHART_DIR = REPO_ROOT / "charts" / "epguard"
RELEASE = "epguard"
NAMESPACE = "epguard-system"
RULES_CONFIGMAP = "epguard-rules"
WEBHOOK_PATH = "/validate"
# The image the local webhook injects to copy the probe, and the one the local controller
# trusts probe outcomes from (no image is pulled here: no kubelet runs it).
PROBE_IMAGE = "epguard:dev"
WEBHOOK_START_TIMEOUT = 60.0


class StageError(RuntimeError):
    """A part of epguard that exists failed to come up."""


@dataclass
class Stack:
    """What ``up`` started, persisted as JSON in the run directory."""

    run_dir: Path
    # Set only when this stack owns (started, and will stop) the control plane.
    control_plane: ControlPlane | None = None
    node: Node | None = None
    # False for test fixtures: the processes then die with the test session.
    detached: bool = True
    extras: list[ManagedProcess] = field(default_factory=list)
    webhook_url: str | None = None
    stages: dict[str, str] = field(default_factory=dict)

    @property
    def state_file(self) -> Path:
        return self.run_dir / "state.json"

    def save(self) -> None:
        data: dict[str, Any] = {
            "control_plane": self.control_plane.to_dict() if self.control_plane else None,
            "node": self.node.to_dict() if self.node else None,
            "extras": [p.to_dict() for p in self.extras],
            "webhook_url": self.webhook_url,
            "stages": self.stages,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, run_dir: Path) -> Stack | None:
        try:
            data = json.loads((run_dir / "state.json").read_text())
        except (OSError, ValueError):
            return None
        cp_data, node_data = data.get("control_plane"), data.get("node")
        cp = ControlPlane.from_dict(cp_data) if cp_data else None
        return cls(
            run_dir=run_dir,
            control_plane=cp,
            node=Node.from_dict(cp, node_data) if cp and node_data else None,
            extras=[ManagedProcess.from_dict(p) for p in data.get("extras", [])],
            webhook_url=data.get("webhook_url"),
            stages=dict(data.get("stages", {})),
        )

    @property
    def webhook_tls(self) -> LocalWebhookTLS:
        return LocalWebhookTLS(self.run_dir / "webhook")

    def rotate_webhook_tls(self, cp: ControlPlane) -> None:
        """Rotate the local webhook's CA and certificate with no failed admission."""
        if self.webhook_url is None:
            raise StageError("no local webhook running")
        port = int(self.webhook_url.split(":")[2].split("/")[0])
        self.webhook_tls.rotate(cp, port)

    def processes(self) -> list[ManagedProcess]:
        cp = self.control_plane.processes if self.control_plane else []
        node = self.node.processes if self.node else []
        return [*cp, *node, *self.extras]

    def stop(self) -> None:
        # Local epguard processes first (they watch the API server), then the API
        # server, then etcd.
        for proc in reversed(self.extras):
            proc.stop()
        self.extras = []
        # The kubelet and the controllers before the API server: stopped the other way
        # round, kube-apiserver can hang for a minute on their open watches.
        if self.node is not None:
            self.node.stop()
            self.node = None
        if self.control_plane is not None:
            self.control_plane.stop()


# --- stages ------------------------------------------------------------------------


def install_chart(cp: ControlPlane, chart: Path, helm_args: list[str]) -> str:
    """``helm upgrade --install`` the chart; returns what happened, in words."""
    if not (chart / "Chart.yaml").is_file():
        return f"skipped: no chart at {chart}"
    helm = binaries.find("helm")
    cmd = [
        str(helm), "upgrade", "--install", RELEASE, str(chart),
        "--namespace", NAMESPACE, "--create-namespace",
        "--kubeconfig", str(cp.kubeconfig),
        *helm_args,
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise StageError(f"helm install failed:\n{r.stdout}{r.stderr}")
    return f"installed release {RELEASE} in {NAMESPACE}"


def _rules_file(cp: ControlPlane, webhook_dir: Path) -> Path:
    """The rules the webhook starts with: the chart's ConfigMap if installed, else the
    webhook's shipped defaults. (In the cluster the webhook also watches the ConfigMap,
    so later edits apply either way.)"""
    dest = webhook_dir / "rules.yaml"
    r = cp.kubectl("get", "configmap", RULES_CONFIGMAP, "-n", NAMESPACE, "-o", "json")
    if r.returncode == 0:
        text = json.loads(r.stdout).get("data", {}).get("rules.yaml")
        if text:
            dest.write_text(text)
            return dest
    shutil.copyfile(default_rules_path(), dest)
    return dest


def _child_env(cp: ControlPlane, kubeconfig: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # Cluster credentials: the webhook then also watches the live rules ConfigMap.
    env["KUBECONFIG"] = str(kubeconfig or cp.kubeconfig)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _credentials(stack: Stack, cp: ControlPlane, service_account: str) -> Path:
    """The chart's ServiceAccount's credentials when the chart made it, so the local
    process runs with exactly the RBAC it has in a cluster (a missing permission fails
    here as it would there); the admin's otherwise."""
    if cp.kubectl("get", "serviceaccount", service_account, "-n", NAMESPACE).returncode != 0:
        return cp.kubeconfig
    path = stack.run_dir / f"{service_account}.kubeconfig"
    return cp.service_account_kubeconfig(NAMESPACE, service_account, path)


def _wait_https(
    proc: ManagedProcess, url: str, ca_file: Path, timeout: float = WEBHOOK_START_TIMEOUT
) -> None:
    deadline = time.monotonic() + timeout
    verify = ssl.create_default_context(cafile=str(ca_file))
    with httpx.Client(verify=verify, timeout=2.0, trust_env=False) as client:
        while True:
            if not proc.alive():
                raise StageError(f"{proc.name} exited; last log lines:\n{proc.log_tail()}")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise StageError(
                    f"{proc.name}: {url} not ready after {timeout:.0f}s; "
                    f"last log lines:\n{proc.log_tail()}"
                )
            time.sleep(0.2)


def start_webhook(stack: Stack, cp: ControlPlane) -> str:
    if not (REPO_ROOT / "webhook" / "__main__.py").is_file():
        return "skipped: webhook/__main__.py does not exist yet"
    webhook_dir = stack.run_dir / "webhook"
    webhook_dir.mkdir(parents=True, exist_ok=True)
    tls = stack.webhook_tls
    tls.issue()
    rules = _rules_file(cp, webhook_dir)
    credentials = _credentials(stack, cp, "epguard-webhook")
    port = free_port()
    proc = ManagedProcess.spawn(
        "webhook",
        [
            sys.executable,
            "-m",
            "epguard.webhook",
            "--rules",
            str(rules),
            "--tls-cert",
            str(tls.cert_file),
            "--tls-key",
            str(tls.key_file),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kubeconfig",
            str(credentials),
            "--namespace",
            NAMESPACE,
            "--inject-image",
            PROBE_IMAGE,
            # No node runs a preflight here: a gated pod would wait for its deadline.
            # The preflight gate is tested on the node (tests/e2e/test_preflight_on_node.py).
            "--preflight-mode",
            "off",
        ],
        stack.run_dir / "logs" / "webhook.log",
        env=_child_env(cp, credentials),
        cwd=REPO_ROOT,
        detached=stack.detached,
    )
    stack.extras.append(proc)
    stack.save()
    base = f"https://127.0.0.1:{port}"
    _wait_https(proc, f"{base}/readyz", tls.bundle_file)
    stack.webhook_url = base + WEBHOOK_PATH
    return f"running on {base} (pid {proc.pid}), rules from {rules}"


def start_controller(stack: Stack, cp: ControlPlane) -> str:
    if not (REPO_ROOT / "webhook" / "controller" / "__main__.py").is_file():
        return "skipped: webhook/controller/__main__.py does not exist yet"
    proc = ManagedProcess.spawn(
        "controller",
        [
            sys.executable,
            "-m",
            "epguard.webhook.controller",
            "--namespace",
            NAMESPACE,
            # See the module docstring: the local webhook's certificate is ours.
            "--manage-certs",
            "false",
            # One local replica: no peering object, and no fixed liveness port to
            # collide with anything else on the machine.
            "--peering",
            "",
            "--liveness",
            "",
            "--probe-image",
            PROBE_IMAGE,
        ],
        stack.run_dir / "logs" / "controller.log",
        env=_child_env(cp, _credentials(stack, cp, "epguard-controller")),
        cwd=REPO_ROOT,
        detached=stack.detached,
    )
    stack.extras.append(proc)
    stack.save()
    # kopf has no readiness endpoint without a liveness URL: give it a moment to
    # fail on a bad flag or missing credentials, which is what is worth catching.
    time.sleep(3)
    if not proc.alive():
        raise StageError(f"controller exited; last log lines:\n{proc.log_tail()}")
    return f"running (pid {proc.pid})"


def point_webhook_config(stack: Stack, cp: ControlPlane) -> str:
    """Patch every epguard ValidatingWebhookConfiguration to call the local webhook."""
    if stack.webhook_url is None:
        return "skipped: no local webhook running"
    try:
        names = set_client_config(
            cp, bundle=stack.webhook_tls.bundle_file.read_bytes(), url=stack.webhook_url
        )
    except WebhookTLSError as e:
        raise StageError(str(e)) from e
    if not names:
        return "skipped: the chart installed no ValidatingWebhookConfiguration"
    origin = stack.webhook_url.removesuffix(WEBHOOK_PATH)
    return f"{', '.join(names)} -> {origin} (each webhook keeps its path: /validate, /mutate)"


def deploy_epguard(
    stack: Stack,
    cp: ControlPlane,
    chart: Path = CHART_DIR,
    helm_args: Sequence[str] = (),
    say: Callable[[str], None] = lambda _: None,
) -> bool:
    """Stages 2-5 against a running control plane; False once one fails (later ones
    are not attempted). What each did, in words, lands in ``stack.stages``."""
    stack.run_dir.mkdir(parents=True, exist_ok=True)
    (stack.run_dir / "logs").mkdir(exist_ok=True)
    stages: list[tuple[str, Callable[[], str]]] = [
        ("chart", lambda: install_chart(cp, chart, list(helm_args))),
        ("webhook", lambda: start_webhook(stack, cp)),
        ("controller", lambda: start_controller(stack, cp)),
        ("webhook-config", lambda: point_webhook_config(stack, cp)),
    ]
    for name, stage in stages:
        try:
            stack.stages[name] = stage()
        except (StageError, binaries.MissingBinary, subprocess.TimeoutExpired) as e:
            # Keep what runs: the logs and the cluster are what one debugs with.
            stack.stages[name] = f"FAILED: {e}"
            stack.save()
            say(f"{name}: {stack.stages[name]}")
            return False
        stack.save()
        say(f"{name}: {stack.stages[name]}")
    return True


# The chart's image values for the locally built image (devcluster.images): the node
# pushes it into its registry at start, and the kubelet pulls it from there.
IMAGE_VALUES = (
    "--set=image.registry=localhost",
    "--set=image.repository=epguard/epguard",
    "--set=image.tag=dev",
    "--set=image.pullPolicy=IfNotPresent",
)
CHART_READY_TIMEOUT = "5m"
# What the node advertises as nvidia.com/gpu so that worker pods with a GPU request
# schedule (there is no GPU: see Node.advertise).
FAKE_GPUS = 8


def deploy_chart(stack: Stack, cp: ControlPlane, chart: Path, helm_args: Sequence[str]) -> str:
    """``helm upgrade --install`` as an admin would, with the local image, waiting until
    the webhook and controller Deployments are available and the controller has
    injected the CA into every epguard webhook configuration."""
    what = install_chart(
        cp, chart, [*IMAGE_VALUES, "--wait", f"--timeout={CHART_READY_TIMEOUT}", *helm_args]
    )
    deadline = time.monotonic() + 120
    while True:
        r = cp.kubectl(
            "get", "validatingwebhookconfigurations,mutatingwebhookconfigurations",
            "-l", f"app.kubernetes.io/instance={RELEASE}",
            "-o", "jsonpath={range .items[*].webhooks[*]}{.clientConfig.caBundle}{'\\n'}{end}",
        )  # fmt: skip
        bundles = r.stdout.splitlines()
        if r.returncode == 0 and bundles and all(bundles):
            break
        if time.monotonic() > deadline:
            raise StageError(f"the controller injected no caBundle in 120s: {r.stderr}")
        time.sleep(0.5)
    pods = cp.kubectl("get", "pods", "-n", NAMESPACE, "-o", "name").stdout.split()
    return f"{what}; pods: {', '.join(p.removeprefix('pod/') for p in pods)}"


def start_cluster(stack: Stack, say: Callable[[str], None] = lambda _: None) -> None:
    """The epguard image (built if its sources changed), the control plane and a Ready
    node with every built image imported and fake GPUs advertised, recorded in
    ``stack`` (detached or not, as ``stack.detached`` says). Raises on failure, leaving
    what started in ``stack`` for :meth:`Stack.stop`."""
    run_dir = stack.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    # Before anything starts: a changed source tree means a new image (cached by
    # content, so an unchanged one costs a hash of the sources).
    started = time.monotonic()
    image = images.build_epguard()
    stack.stages["image"] = f"{images.EPGUARD_IMAGE} ({time.monotonic() - started:.1f}s)"
    say(f"image: {stack.stages['image']}")
    cp = ControlPlane(run_dir / "controlplane", detached=stack.detached, node_ip=node_ip())
    stack.control_plane = cp
    say("starting etcd and kube-apiserver ...")
    started = time.monotonic()
    cp.start()
    stack.stages["control-plane"] = f"{cp.server} (up in {time.monotonic() - started:.1f}s)"
    stack.save()
    say(f"control plane: {stack.stages['control-plane']}")
    started = time.monotonic()
    stack.node = Node(cp, run_dir / "node")
    stack.save()
    stack.node.start(images=[image, *images.built_workers()])
    stack.node.advertise("nvidia.com/gpu", FAKE_GPUS)
    stack.stages["node"] = f"Ready (in {time.monotonic() - started:.1f}s)"
    stack.save()
    say(f"node: {stack.stages['node']}")


# --- commands ----------------------------------------------------------------------


def _say(msg: str) -> None:
    # Progress goes to stderr so that stdout's last line is the export line.
    print(msg, file=sys.stderr, flush=True)


def up(
    run_dir: Path = DEFAULT_RUN_DIR,
    helm_args: list[str] | None = None,
    chart: Path = CHART_DIR,
) -> int:
    existing = Stack.load(run_dir)
    if existing is not None:
        if existing.processes() and all(p.alive() for p in existing.processes()):
            _say(f"already up (state in {existing.state_file}); `make down` to stop it")
            assert existing.control_plane is not None
            print(f"export KUBECONFIG={existing.control_plane.kubeconfig}")
            return 0
        _say("cleaning up a previous, partly dead stack")
        if down(run_dir, quiet=True) != 0:
            return 1

    stack = Stack(run_dir=run_dir)
    try:
        start_cluster(stack, _say)
    except (ControlPlaneError, binaries.MissingBinary, subprocess.CalledProcessError) as e:
        _say(f"cluster failed: {e}")
        stack.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        return 1
    assert stack.control_plane is not None and stack.node is not None
    cp = stack.control_plane
    started = time.monotonic()
    failed = False
    try:
        stack.stages["chart"] = deploy_chart(stack, cp, chart, helm_args or [])
        stack.stages["chart"] += f" (ready in {time.monotonic() - started:.1f}s)"
    except (StageError, subprocess.TimeoutExpired) as e:
        # Keep what runs: the pods' logs and the cluster are what one debugs with.
        stack.stages["chart"] = f"FAILED: {e}"
        failed = True
    stack.save()
    _say(f"chart: {stack.stages['chart']}")
    _say(f"logs: {cp.workdir / 'logs'} and {stack.node.workdir / 'logs'}; stop with `make down`")
    print(f"export KUBECONFIG={cp.kubeconfig}")
    return 1 if failed else 0


def down(run_dir: Path = DEFAULT_RUN_DIR, *, quiet: bool = False) -> int:
    stack = Stack.load(run_dir)
    if stack is None:
        if not quiet:
            _say(f"nothing to stop (no state in {run_dir / 'state.json'})")
        shutil.rmtree(run_dir, ignore_errors=True)
        return 0
    procs = stack.processes()
    stack.stop()
    # A process that outlived SIGKILL (stuck in the kernel, or no longer leading the
    # group it was started in) keeps state.json, the record of every process, so that
    # `make down` can be run again (the rest is undone already: the host's changes, the
    # control plane's data), and is reported: a caller that goes on as if the machine
    # were free would start a second node on ports and a containerd still taken.
    left = [f"{p.name} (pid {p.pid})" for p in procs if p.alive()]
    if left:
        _say(f"still running after stop: {', '.join(left)}; state kept in {run_dir}")
        return 1
    shutil.rmtree(run_dir, ignore_errors=True)
    if not quiet:
        names = [f"{p.name} (pid {p.pid})" for p in procs]
        _say("stopped " + (", ".join(names) if names else "nothing") + f"; removed {run_dir}")
    return 0


def status(run_dir: Path = DEFAULT_RUN_DIR) -> int:
    """Print what runs; exit 0 when everything ``up`` started is alive, else 1."""
    stack = Stack.load(run_dir)
    if stack is None:
        print("down")
        return 1
    procs = stack.processes()
    for p in procs:
        print(f"{p.name:15} pid {p.pid:<8} {'running' if p.alive() else 'DEAD'}  log {p.log}")
    for name, what in stack.stages.items():
        print(f"{name:15} {what}")
    if stack.control_plane is not None:
        print(f"export KUBECONFIG={stack.control_plane.kubeconfig}")
    return 0 if procs and all(p.alive() for p in procs) else 1


def model(run_dir: Path = DEFAULT_RUN_DIR, *, forget: bool = False) -> int:
    """Print the node registry's model image as shell assignments: ``MODEL_REF`` (what a
    pod's image volume names) and ``MODEL_SERVED`` (bytes of its layers the registry has
    served to anyone since the node started, from the access log). ``forget`` first
    removes it from containerd's store, so that the next use must pull it."""
    stack = Stack.load(run_dir)
    if stack is None or stack.node is None:
        print("down", file=sys.stderr)
        return 1
    registry = stack.node.registry
    if forget:
        stack.node.forget_image(registry.model_ref)
    served = registry.blob_gets()
    layers = registry.model_layers()
    print(f"MODEL_REF={registry.model_ref}")
    print(f"MODEL_SERVED={sum(served[d].bytes for d in layers if d in served)}")
    return 0
