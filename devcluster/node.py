"""A real node for the local control plane: containerd + runc, a CNI bridge, a kubelet,
kube-scheduler, kube-controller-manager and kube-proxy.

Every Kubernetes binary is the pinned v1.35.4 build in ``$EPGUARD_CACHE/bin``, and so
are containerd v2.4.2, its runc shim and ``ctr`` (``scripts/tools.d/10-kube.sh``; Debian's
containerd 1.6 cannot mount image volumes); runc and the CNI plugins are Debian's
(``scripts/tools.d/05-system.sh``). A real OCI registry runs on the node's address
(:mod:`devcluster.registry`) and serves the model image that image-volume tests mount.
The recipe and every obstacle met on this kind of machine are in
``/work/shared/notes/local-node.md`` and docs/devcluster.md; the ones the code below
depends on:

* the VM lacks ``CAP_SYS_RESOURCE``, so runc cannot lower the sandbox's
  ``oom_score_adj`` and every pod would fail with ``can't get final child's PID from
  pipe``: containerd's CRI plugin runs with ``restrict_oom_score_adj = true``;
* no outside registry is reachable: every image is built here (the pause image, pinned
  as containerd's sandbox image, busybox, epguard, the workers), pushed into the node's
  registry at start, and pulled from it by the kubelet like the model image; containerd
  discards a layer's blob once it is unpacked (the registry keeps the one copy);
* the kubelet runs on cgroup v1 (``failCgroupV1: false``) with the cgroupfs driver.

A kubelet changes host state whatever its ``--root-dir``: mounts, cgroups,
``/var/lib/kubelet/device-plugins``, ``/var/log/containers``, sysctls; the CNI bridge
plugin adds an interface and turns on ``ip_forward``; kube-proxy adds iptables chains.
:meth:`Node.start` records what was there before, and :meth:`Node.stop` puts it back,
so ``make down`` leaves the machine as ``make up`` found it (tests/devcluster/test_node.py
checks this).

Only one node can run on a machine at a time (it owns fixed host paths and the
``epguard0`` bridge); a second start fails with a message naming the first.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from devcluster import binaries, pki
from devcluster.controlplane import ControlPlane, ControlPlaneError, write_kubeconfig
from devcluster.process import ManagedProcess, free_port
from devcluster.registry import PRIVATE_PORT, Registry

NODE_NAME = "node-0"
POD_CIDR = "10.88.0.0/16"
BRIDGE = "epguard0"
# containerd's state and socket: a directory of our own, so a system containerd (if
# any) is never touched.
RUNTIME_STATE = Path("/run/epguard-containerd")
SOCKET = RUNTIME_STATE / "containerd.sock"
PAUSE_IMAGE = "localhost/epguard/pause:3.10"
CNI_BIN = Path("/usr/lib/cni")
RUNC = Path("/usr/sbin/runc")
READY_TIMEOUT = 120.0
# Paths the kubelet, containerd and CNI create whatever they are told: removed on
# stop unless they existed before start.
HOST_PATHS = (
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/var/lib/cni",
    "/run/netns",
    "/usr/libexec/kubernetes",
    str(RUNTIME_STATE),
)
# Kernel settings the kubelet (vm.*, kernel.*), the bridge plugin (ip_forward) and
# kube-proxy (route_localnet, conntrack) may change: restored on stop.
SYSCTLS = (
    "vm/overcommit_memory",
    "kernel/panic",
    "kernel/panic_on_oops",
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/ipv4/conf/all/forwarding",
    "net/ipv4/conf/default/forwarding",
    "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables",
    "net/netfilter/nf_conntrack_max",
)
_LOCK = Path("/run/epguard-node.lock")
_RECORD = "node.json"


class NodeError(ControlPlaneError):
    """The node could not start; the message says which part and why."""


def node_ip() -> str:
    """The first global IPv4 address of this machine (the host name may resolve to
    127.0.0.1, which a pod cannot use to reach the API server)."""
    out = subprocess.run(
        ["ip", "-j", "-4", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for link in json.loads(out):
        for addr in link.get("addr_info", []):
            if addr.get("local"):
                return str(addr["local"])
    raise NodeError("no global IPv4 address on this machine for the node")


def _run(*argv: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout)


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name


def read_sysctls() -> dict[str, str]:
    """The current value of every setting in :data:`SYSCTLS` that exists here."""
    values = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = _sysctl_path(name).read_text().strip()
    return values


def _mountpoints() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # Field 5 is the mount point, octal-escaped (\040 for a space).
        points.append(line.split()[4].encode().decode("unicode_escape"))
    return points


def _cgroup_tops() -> dict[str, list[str]]:
    """The top-level child cgroups of each mounted hierarchy."""
    tops: dict[str, list[str]] = {}
    for hierarchy in sorted(Path("/sys/fs/cgroup").iterdir()):
        if hierarchy.is_dir() and not hierarchy.is_symlink():
            tops[str(hierarchy)] = sorted(p.name for p in hierarchy.iterdir() if p.is_dir())
    return tops


def _links() -> list[str]:
    out = _run("ip", "-j", "link", "show").stdout
    return sorted(str(link["ifname"]) for link in json.loads(out))


def host_snapshot() -> dict[str, Any]:
    """What a node changes on the host, as comparable data: the processes of the node's
    binaries, mount points, top-level cgroups, network interfaces, iptables chains and
    rules, kernel settings and the hard-coded paths. Equal before ``up`` and after
    ``down`` means nothing was left behind."""
    # The node's own binaries (comm is cut at 15 characters). Not etcd or kube-apiserver:
    # other control planes (test sessions, another checkout) may come and go meanwhile;
    # callers check those by pid.
    names = {"kubelet", "kube-proxy", "kube-scheduler", "kube-controller", "containerd",
             "containerd-shim", "pause", "docker-registry"}  # fmt: skip
    procs = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            text = stat.read_text()
            comm = text[text.index("(") + 1 : text.rindex(")")]
            # A zombie has exited already; only its parent's wait is pending.
            exited = text[text.rindex(")") + 2] == "Z"
            if not exited and comm in names:
                procs.append(comm)
    return {
        "processes": sorted(procs),
        "mounts": sorted(_mountpoints()),
        "cgroups": _cgroup_tops(),
        "links": _links(),
        "iptables": {tool: _rules(tool) for tool in ("iptables-save", "ip6tables-save")},
        "sysctls": read_sysctls(),
        "paths": sorted(p for p in HOST_PATHS if os.path.lexists(p)),
    }


def _rules(save: str) -> list[str]:
    """iptables-save output without comments and packet counters."""
    r = _run(save, check=False)
    return without_empty_tables(
        [
            line.split(" [")[0] if line.startswith(":") else line
            for line in r.stdout.splitlines()
            if line and not line.startswith("#")
        ]
    )


def without_empty_tables(lines: list[str]) -> list[str]:
    """The tables that hold something: a table with only its built-in chains, each
    accepting, and no rule filters nothing, as if it were not there. A fresh kernel lists
    no table until the first program touches one, and a table cannot be unloaded, so the
    first node start on a fresh machine leaves empty ones behind (found by CI on a fresh
    machine, where the host check ran before any node had started)."""
    out: list[str] = []
    table: list[str] = []
    for line in lines:
        if line.startswith("*"):
            table = [line]
        elif table:
            table.append(line)
            if line == "COMMIT":
                body = table[1:-1]
                if not all(x.startswith(":") and x.endswith(" ACCEPT") for x in body):
                    out.extend(table)
                table = []
        else:
            out.append(line)
    return out + table


class Node:
    """One real node joined to ``cp`` (a :class:`ControlPlane` started with ``node_ip``).

    ``workdir`` holds the node's certificates, configs, kubelet root and logs;
    containerd's store lives in ``$EPGUARD_CACHE/containerd`` so pulled images survive
    ``down`` (an image it holds at the digest the registry serves is not pulled again).
    """

    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        if cp.node_ip is None:
            raise NodeError("the control plane was not started for a node (node_ip unset)")
        self.cp = cp
        self.ip = cp.node_ip
        self.workdir = workdir
        self.processes: list[ManagedProcess] = []
        self.before: dict[str, Any] = {}

    # --- paths ----------------------------------------------------------------------

    @property
    def kubelet_root(self) -> Path:
        return self.workdir / "kubelet"

    @staticmethod
    def containerd_root() -> Path:
        # The store of Debian's containerd 1.6 before: containerd 2 opens it in place
        # (its metadata is migrated), so no image is imported or stored twice.
        return binaries.cache_dir() / "containerd"

    @property
    def registry(self) -> Registry:
        return Registry(self.workdir / "registry", self.ip)

    @property
    def private_registry(self) -> Registry:
        """Every pull from it needs credentials: a namespace without the pull secret."""
        return Registry(self.workdir / "private-registry", self.ip, PRIVATE_PORT, private=True)

    def _logs(self) -> Path:
        return self.workdir / "logs"

    # --- persisted state --------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "workdir": str(self.workdir),
            "processes": [p.to_dict() for p in self.processes],
            "before": self.before,
        }

    @classmethod
    def from_dict(cls, cp: ControlPlane, data: Mapping[str, Any]) -> Node:
        node = cls(cp, Path(data["workdir"]))
        node.processes = [ManagedProcess.from_dict(p) for p in data["processes"]]
        node.before = dict(data["before"])
        return node

    def alive(self) -> bool:
        return bool(self.processes) and all(p.alive() for p in self.processes)

    # --- lifecycle --------------------------------------------------------------------

    def start(self, images: Sequence[Path] = ()) -> None:
        """Start the registries and containerd, push the pause image and ``images`` (OCI
        archives) and the model into the registry, start kube-controller-manager,
        kube-scheduler, kube-proxy and the kubelet, and wait for the node to be Ready and
        the ``default`` ServiceAccount to exist."""
        if os.geteuid() != 0:
            raise NodeError("a real node needs root (containerd, runc, CNI, the kubelet)")
        for tool in ("containerd", "containerd-shim-runc-v2", "ctr"):
            binaries.find(tool)  # MissingBinary says to run `make tools`
        if not (CNI_BIN / "bridge").exists() or not RUNC.exists():
            raise NodeError("runc or the CNI plugins are missing: run `make tools`")
        self._lock()
        self.before = host_snapshot()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._logs().mkdir(exist_ok=True)
        self._record()
        try:
            ca = self._write_pki()
            self._start_registry(ca)
            self._start_containerd()
            self.publish_images([binaries.cache_dir() / "images" / "pause.oci.tar", *images])
            self.registry.push_model()
            self._start_controllers()
            self._start_kubelet()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _lock(self) -> None:
        try:
            fd = os.open(_LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = Path(_LOCK.read_text().strip())
            stale = _recorded(holder)
            if stale is not None and any(p.alive() for p in stale.processes):
                raise NodeError(
                    f"a node already runs on this machine (state in {holder}); stop it first "
                    "(`make down`, or `python -m devcluster --run-dir <dir> down`)"
                ) from None
            if stale is not None:
                # Its owner died without stopping it (a killed test session): its own
                # record says what to undo on the host.
                stale.stop()
            _LOCK.unlink(missing_ok=True)
            fd = os.open(_LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(str(self.workdir))

    def stop(self) -> None:
        """Stop everything in the order that lets each part shut down cleanly (kubelet,
        then the controllers, then the containers and containerd), then undo what they
        did to the host. Safe to call again, and on a partly started node."""
        for proc in reversed(self.processes):
            if proc.name != "containerd":
                proc.stop(grace=10.0)
        self._remove_containers()
        for proc in self.processes:
            if proc.name == "containerd":
                proc.stop(grace=10.0)
        self.processes = []
        _kill_shims()
        self._restore_host()
        with contextlib.suppress(FileNotFoundError):
            if _LOCK.read_text().strip() == str(self.workdir):
                _LOCK.unlink()

    def advertise(self, resource: str, count: int) -> None:
        """Advertise an extended resource in the node's capacity, the documented way
        (a status patch): GPU-requesting worker pods then schedule here. No device
        plugin and no device exist, so containers see no GPU, as the probe reports."""
        path = "/status/capacity/" + resource.replace("~", "~0").replace("/", "~1")
        patch = json.dumps([{"op": "add", "path": path, "value": str(count)}])
        r = self.cp.kubectl(
            "patch", "node", NODE_NAME, "--subresource=status", "--type=json", "-p", patch
        )
        if r.returncode != 0:
            raise NodeError(f"could not advertise {resource}: {r.stderr.strip()}")
        deadline = time.monotonic() + 30
        jsonpath = "{.status.allocatable." + resource.replace(".", "\\.") + "}"
        while self.cp.kubectl("get", "node", NODE_NAME, "-o", f"jsonpath={jsonpath}").stdout != str(
            count
        ):
            if time.monotonic() > deadline:
                raise NodeError(f"{resource} never became allocatable on {NODE_NAME}")
            time.sleep(0.2)

    # --- images -----------------------------------------------------------------------

    def ctr(self, *args: str, check: bool = True, timeout: float = 600.0) -> str:
        r = _run(str(binaries.find("ctr")), "--address", str(SOCKET), "-n", "k8s.io", *args,
                 check=False, timeout=timeout)  # fmt: skip
        if check and r.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)} failed: {r.stderr.strip()}")
        return r.stdout

    def image_digests(self) -> dict[str, str]:
        """{image name: manifest digest} of what containerd holds for the kubelet."""
        rows = [line.split() for line in self.ctr("images", "ls").splitlines()[1:]]
        return {row[0]: row[2] for row in rows if len(row) > 2}

    def forget_image(self, ref: str) -> None:
        """Remove an image from containerd's store so the next use pulls it again: every
        name CRI gave it (the tag, ``repo@sha256:<manifest>`` and ``sha256:<config>``)
        points at the same manifest, and the content goes when the last name does."""
        held = self.image_digests()
        if ref not in held:
            return
        names = [name for name, digest in held.items() if digest == held[ref]]
        self.ctr("images", "rm", "--sync", *names)

    def publish_images(self, archives: Iterable[Path]) -> dict[str, str]:
        """Push OCI archives into the node's registry (a tag already serving the same
        manifest is skipped), and drop from containerd any image held under one of their
        names at another digest (a rebuilt ``epguard:dev``), so that the next pod pulls
        the new one. Returns {image name: manifest digest}."""
        pushed: dict[str, str] = {}
        for archive in archives:
            if not archive.is_file():
                raise NodeError(f"image archive {archive} missing: run `make tools`")
            pushed.update(self.registry.push_archive(archive))
        for name in stale_images(pushed, self.image_digests()):
            self.forget_image(name)
        return pushed

    # --- internals --------------------------------------------------------------------

    def _pki(self, name: str) -> Path:
        return self.workdir / "pki" / name

    def _write_pki(self) -> pki.CertificateAuthority:
        (self.workdir / "pki").mkdir(parents=True, exist_ok=True)
        cp_pki = self.cp.pki_dir
        ca = pki.CertificateAuthority.load(
            (cp_pki / "ca.crt").read_bytes(), (cp_pki / "ca.key").read_bytes()
        )
        ca.issue_serving(
            NODE_NAME, dns_names=[NODE_NAME, "localhost"], ips=[self.ip, "127.0.0.1"]
        ).write(self._pki("kubelet-serving.crt"), self._pki("kubelet-serving.key"))
        # The identities every cluster uses: the API server's default RBAC and the
        # Node authorizer grant each exactly its job.
        clients = {
            "kubelet": (f"system:node:{NODE_NAME}", ["system:nodes"]),
            "kube-scheduler": ("system:kube-scheduler", []),
            "kube-controller-manager": ("system:kube-controller-manager", []),
            "kube-proxy": ("system:kube-proxy", []),
        }
        for name, (user, groups) in clients.items():
            pair = ca.issue_client(user, groups)
            write_kubeconfig(
                self._pki(f"{name}.kubeconfig"),
                server=self.cp.server,
                ca=self.cp.ca_file.read_bytes(),
                user=user,
                client_cert=pair.cert,
                client_key=pair.key,
            )
        return ca

    def _spawn(
        self,
        name: str,
        argv: list[str],
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
    ) -> ManagedProcess:
        proc = ManagedProcess.spawn(
            name, argv, log or self._logs() / f"{name}.log", env=env, detached=self.cp.detached
        )
        self.processes.append(proc)
        self._record()
        return proc

    def _record(self) -> None:
        """What :func:`_recorded` needs to stop this node if its owner dies first."""
        path = self.workdir / _RECORD
        path.with_suffix(".tmp").write_text(json.dumps(self.to_dict()))
        path.with_suffix(".tmp").replace(path)

    def _start_registry(self, ca: pki.CertificateAuthority) -> None:
        for name, registry in (("registry", self.registry), ("private-registry",
                                                             self.private_registry)):
            argv = registry.prepare(ca)
            if not registry.private:
                registry.collect_garbage()
            registry.wait_ready(self._spawn(name, argv, log=registry.log))

    def _start_containerd(self) -> None:
        cni = self.workdir / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        conflist = {
            "cniVersion": "0.4.0",
            "name": "epguard",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    # No masquerade: nothing leaves this machine, and no NAT rules to undo.
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(cni / "ipam"),
                        "ranges": [[{"subnet": POD_CIDR}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                }
            ],
        }
        (cni / "net.d" / "10-epguard.conflist").write_text(json.dumps(conflist, indent=1))
        root = self.containerd_root()
        root.mkdir(parents=True, exist_ok=True)
        config = f"""version = 3
root = "{root}"
state = "{RUNTIME_STATE}"
[grpc]
  address = "{SOCKET}"
[ttrpc]
  address = "{SOCKET}.ttrpc"
[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = "overlayfs"
    # The registry keeps each blob; containerd keeps the unpacked snapshot only.
    discard_unpacked_layers = true
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = "{PAUSE_IMAGE}"
    [plugins.'io.containerd.cri.v1.images'.registry]
      config_path = "{self.registry.hosts_dir}"
  [plugins.'io.containerd.cri.v1.runtime']
    # This VM's root lacks CAP_SYS_RESOURCE: runc cannot set the sandbox's
    # oom_score_adj to -998 and every pod would fail to start.
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = "runc"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          SystemdCgroup = false
          BinaryName = "{RUNC}"
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ["{CNI_BIN}"]
      conf_dir = "{cni / "net.d"}"
"""
        path = self.workdir / "containerd.toml"
        path.write_text(config)
        # containerd finds its shim on PATH: ours first, not Debian's 1.6 one.
        env = {**os.environ, "PATH": f"{binaries.bin_dir()}:{os.environ.get('PATH', '')}"}
        proc = self._spawn(
            "containerd", [str(binaries.find("containerd")), "--config", str(path)], env=env
        )
        deadline = time.monotonic() + 60
        ctr = str(binaries.find("ctr"))
        while _run(ctr, "--address", str(SOCKET), "version", check=False).returncode != 0:
            if not proc.alive() or time.monotonic() > deadline:
                raise NodeError(f"containerd did not start; last log lines:\n{proc.log_tail()}")
            time.sleep(0.2)

    def _controller_args(self, name: str) -> list[str]:
        kubeconfig = str(self._pki(f"{name}.kubeconfig"))
        return [
            str(binaries.find(name)),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
        ]

    def _start_controllers(self) -> None:
        cp_pki = self.cp.pki_dir
        self._spawn(
            "kube-controller-manager",
            [
                *self._controller_args("kube-controller-manager"),
                # Each controller acts as its own ServiceAccount, as kubeadm sets it up:
                # the default RBAC grants those, not the manager's own identity.
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={cp_pki / 'sa.key'}",
                f"--root-ca-file={self.cp.ca_file}",
                f"--cluster-cidr={POD_CIDR}",
            ],
        )
        self._spawn("kube-scheduler", self._controller_args("kube-scheduler"))
        proxy_config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self._pki("kube-proxy.kubeconfig"))},
            "mode": "iptables",
            "clusterCIDR": POD_CIDR,
            "hostnameOverride": NODE_NAME,
            "bindAddress": self.ip,
            "healthzBindAddress": f"127.0.0.1:{free_port()}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            # Leave the host's conntrack table sizes and timeouts alone.
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
            # No NodePorts on 127.0.0.1: that needs route_localnet=1, a host-wide change.
            "iptables": {"localhostNodePorts": False},
            "nodePortAddresses": ["primary"],
        }
        path = self.workdir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(proxy_config))
        self._spawn("kube-proxy", [str(binaries.find("kube-proxy")), f"--config={path}"])

    def _start_kubelet(self) -> None:
        self.kubelet_root.mkdir(parents=True, exist_ok=True)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            # This machine has cgroup v1 only; 1.35 refuses it unless told otherwise.
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{SOCKET}",
            "podLogsDir": str(self.workdir / "pod-logs"),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.cp.ca_file)},
            },
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": str(self._pki("kubelet-serving.crt")),
            "tlsPrivateKeyFile": str(self._pki("kubelet-serving.key")),
            "address": self.ip,
            "port": free_port(),
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port(),
            "readOnlyPort": 0,
            "clusterDomain": "cluster.local",
            "resolvConf": "/etc/resolv.conf",
            "registerNode": True,
            # Never delete an image: the node's registry has them all, but pulling a
            # 5.7 GB worker image back costs ~45 s of a test's time on two cores.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi"},
            "volumePluginDir": str(self.workdir / "volume-plugins"),
            "serializeImagePulls": False,
        }
        path = self.workdir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        self._spawn(
            "kubelet",
            [
                str(binaries.find("kubelet")),
                f"--config={path}",
                f"--kubeconfig={self._pki('kubelet.kubeconfig')}",
                f"--root-dir={self.kubelet_root}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={self.ip}",
            ],
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        ready = "jsonpath={.status.conditions[?(@.type=='Ready')].status}"
        cri_until = time.monotonic() + CRI_WAIT
        raced = False
        since = 0  # where the running kubelet's lines begin in its log (each start appends)
        while True:
            dead = [p for p in self.processes if not p.alive()]
            why = _kubelet_transient(dead[0], since) if dead else None
            # The data race once; containerd's CRI not yet up for CRI_WAIT at the most.
            late = time.monotonic() > cri_until
            if why and not (why == KUBELET_RACE and raced) and not (why == CRI_NOT_READY and late):
                raced = raced or why == KUBELET_RACE
                print(f"devcluster: the kubelet hit {why!r}; starting it again",
                      file=sys.stderr)  # fmt: skip
                self.processes.remove(dead[0])
                since = Path(dead[0].log).stat().st_size
                if why == CRI_NOT_READY:
                    time.sleep(1)
                self._start_kubelet()
                continue
            if dead:
                said = f"{dead[0].name} exited; last log lines:\n{dead[0].log_tail()}"
                if why == CRI_NOT_READY:
                    cri = next((p for p in self.processes if p.name == "containerd"), None)
                    said += f"\ncontainerd's CRI never came up; its log:\n{cri and cri.log_tail()}"
                raise NodeError(said)
            node = self.cp.kubectl("get", "node", NODE_NAME, "-o", ready)
            sa = self.cp.kubectl("get", "serviceaccount", "default", "-n", "default")
            if node.stdout.strip() == "True" and sa.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise NodeError(
                    f"node {NODE_NAME} not Ready after {READY_TIMEOUT:.0f}s; kubelet log:\n"
                    + next(p for p in self.processes if p.name == "kubelet").log_tail()
                )
            time.sleep(0.3)

    def _remove_containers(self) -> None:
        """Kill and delete every container the kubelet left (the kubelet is stopped, so
        nothing restarts them); the pause containers hold the pods' network namespaces."""
        if not SOCKET.exists():
            return
        for task in self.ctr("tasks", "ls", "-q", check=False).split():
            # rm -f kills a running task first.
            self.ctr("tasks", "rm", "-f", task, check=False, timeout=30)
        for container in self.ctr("containers", "ls", "-q", check=False).split():
            self.ctr("containers", "rm", container, check=False)

    def _restore_host(self) -> None:
        before: Mapping[str, Any] = self.before
        if not before:
            return
        # Mounts first (pod volumes, the kubelet's bind mount of its root, network
        # namespaces, containerd's shm and rootfs mounts), deepest first.
        keep = set(before.get("mounts", []))
        prefixes = [str(self.workdir), str(RUNTIME_STATE), "/run/netns", "/var/lib/kubelet",
                    str(self.containerd_root())]  # fmt: skip
        for point in sorted(set(_mountpoints()) - keep, key=len, reverse=True):
            ours = any(point == p or point.startswith(p + "/") for p in prefixes)
            if ours and _run("umount", point, check=False).returncode != 0:
                _run("umount", "-l", point, check=False)
        _remove_iptables_chains()
        for link in sorted(set(_links()) - set(before.get("links", []))):
            if link == BRIDGE or link.startswith("veth"):
                _run("ip", "link", "delete", link, check=False)
        _remove_new_cgroups(before.get("cgroups", {}))
        for name, value in before.get("sysctls", {}).items():
            with contextlib.suppress(OSError):
                if _sysctl_path(name).read_text().strip() != value:
                    _sysctl_path(name).write_text(value)
        existed = set(before.get("paths", []))
        for path in HOST_PATHS:
            if path not in existed and os.path.lexists(path):
                _remove_tree(Path(path))
        _remove_tree(self.workdir)


def stale_images(pushed: Mapping[str, str], held: Mapping[str, str]) -> list[str]:
    """The names containerd holds (``held``: name -> digest) that the kubelet should pull
    again from what the registry now serves (``pushed``): held at another digest (a
    rebuilt ``epguard:dev``), or not pulled at all -- an image ``ctr images import``ed by
    an older checkout has no ``<repository>@<digest>`` name, and the kubelet would report
    its config digest instead of the manifest's."""
    return [
        name
        for name, digest in pushed.items()
        if name in held
        and (held[name] != digest or f"{name.rsplit(':', 1)[0]}@{digest}" not in held)
    ]


def _recorded(workdir: Path) -> Node | None:
    """The node recorded in ``workdir``, enough of it to stop it; None if none is."""
    try:
        data = json.loads((workdir / _RECORD).read_text())
    except (OSError, ValueError):
        return None
    node = Node.__new__(Node)
    node.workdir = workdir
    node.processes = [ManagedProcess.from_dict(p) for p in data.get("processes", [])]
    node.before = dict(data.get("before", {}))
    return node


def _kill_shims() -> None:
    """containerd-shim-runc-v2 processes of our containerd, should any outlive it."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError, ValueError):
            argv = cmdline.read_bytes().split(b"\0")
            if argv[0].endswith(b"containerd-shim-runc-v2") and str(SOCKET).encode() in b" ".join(
                argv
            ):
                os.kill(int(cmdline.parent.name), 9)


def _remove_iptables_chains() -> None:
    """Delete every KUBE-* chain and every rule that jumps to one (kube-proxy's and the
    kubelet's), in IPv4 and IPv6, leaving other rules untouched."""
    for save, restore in (
        ("iptables-save", "iptables-restore"),
        ("ip6tables-save", "ip6tables-restore"),
    ):
        r = _run(save, check=False)
        if r.returncode != 0 or "KUBE-" not in r.stdout:
            continue
        kept = [
            line for line in r.stdout.splitlines() if "KUBE-" not in line or line.startswith("#")
        ]
        subprocess.run([restore], input="\n".join(kept) + "\n", text=True, check=False,
                       capture_output=True)  # fmt: skip


def _remove_new_cgroups(before: Mapping[str, list[str]]) -> None:
    for hierarchy, tops in _cgroup_tops().items():
        for top in set(tops) - set(before.get(hierarchy, [])):
            # cgroup directories are removed with rmdir, deepest first; files in them
            # are kernel interfaces, not removable (and need not be).
            root = Path(hierarchy) / top
            dirs = sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts))
            for d in [*reversed(dirs), root]:
                with contextlib.suppress(OSError):
                    d.rmdir()


def _remove_tree(path: Path) -> None:
    """rmtree, but never into a mount point that is still mounted (it would delete
    whatever is mounted there, possibly host files)."""
    if not path.exists():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a dangling symlink
        return
    mounted = [p for p in _mountpoints() if p == str(path) or p.startswith(str(path) + "/")]
    if mounted:
        raise NodeError(f"refusing to delete {path}: still mounted: {mounted[:5]}")
    shutil.rmtree(path, ignore_errors=True)


# kubelet v1.35.4 can die while it starts for reasons that are not this node's set-up;
# each was seen once in a CI run of make test (test_node.py's node never came up, 5 errors):
# - GetCapacity (pkg/kubelet/cm/container_manager_linux.go:957) iterates a map the
#   container manager is still writing (a stack dump follows the line);
# - containerd 2.4.2 answers `ctr version` (what _start_containerd waits for) before its
#   CRI plugin is initialized, and the kubelet's check of the CRI at start fails with
#   this as its last line (the machine loaded: the bulk tests had just started).
KUBELET_RACE = "fatal error: concurrent map"
CRI_NOT_READY = "server is not initialized yet"
# How long a kubelet is started again while containerd's CRI is not up (each try ~1.5 s):
# past it, the node's start fails with containerd's log.
CRI_WAIT = 30.0


def _kubelet_transient(proc: ManagedProcess, since: int = 0) -> str | None:
    """Which of the above a dead kubelet wrote in its log from byte ``since`` on (where
    its start began: each start appends to the same log), if any."""
    if proc.name != "kubelet":
        return None
    if KUBELET_RACE in proc.log_tail(400, since):
        return KUBELET_RACE
    # Its last lines only: the error that ended it.
    return CRI_NOT_READY if CRI_NOT_READY in proc.log_tail(3, since) else None
