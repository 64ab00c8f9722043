#!/usr/bin/env python3
"""The real one-node cluster's figures (issue 9's budgets), printed, not asserted:

* ``make up`` (warm: binaries and images built): the epguard image check, etcd +
  kube-apiserver, the node Ready (containerd, images imported, controllers, kubelet),
  the chart's pods Ready, and the total (budget: <= 60 s);
* ``kubectl apply`` of the bad worker (in a namespace with the preflight gate off) -> the
  probe's termination message in pod status, written by the kubelet after the real
  probe ran in the real worker image (budget: <= 10 s), over ``--runs`` pods (each in a
  fresh namespace, no verdict left behind);
* the kube-controller-manager's CPU seconds from the chart's install to its type check
  of the backstop policy (the policy's ``status.observedGeneration``): it runs at every
  generation of the policy, in the component every other controller of the cluster
  shares (compiler.py ``_walk``);
* the resident memory of every process of the stack and of epguard's pods;
* ``make down``.

    .venv/bin/python bench/node_timings.py [--runs 3]
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster.stack import CHART_DIR, Stack, deploy_chart, start_cluster  # noqa: E402
from tests.e2e.node_e2e import wait_probe, worker_pod  # noqa: E402


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _processes_by_name() -> dict[str, list[int]]:
    wanted = (
        "etcd",
        "kube-apiserver",
        "kube-controller",
        "kube-scheduler",
        "kube-proxy",
        "kubelet",
        "containerd",
        "containerd-shim",
        "epguard-webhook",
        "epguard-control",
        "pause",
    )
    found: dict[str, list[int]] = {}
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:
            continue
        if name in wanted:
            found.setdefault(name, []).append(int(comm.parent.name))
    return found


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _type_checked(cp: Any, name: str = "epguard-backstop") -> tuple[str, bool]:
    r = cp.kubectl("get", "validatingadmissionpolicy", name, "-o", "json")
    if r.returncode != 0:
        return "", False
    obj = json.loads(r.stdout)
    generation = obj["metadata"].get("generation")
    observed = obj.get("status", {}).get("observedGeneration")
    return f"generation {generation}", observed == generation


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    stages: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="epguard-bench-node-") as tmp:
        stack = Stack(run_dir=Path(tmp) / "run", detached=False)
        try:
            started = time.monotonic()
            start_cluster(stack, lambda msg: None)
            assert stack.control_plane is not None
            cp = stack.control_plane
            kcm = _processes_by_name().get("kube-controller", [])
            kcm_before = sum(_cpu_seconds(p) for p in kcm)
            chart_started = time.monotonic()
            deploy_chart(stack, cp, CHART_DIR, [])
            done = time.monotonic()
            stages.update(stack.stages)
            print("make up (warm):")
            for name in ("image", "control-plane", "node"):
                print(f"  {name:14} {stages.get(name, '')}")
            print(f"  {'chart':14} pods Ready and caBundle injected in {done - chart_started:.1f}s")
            print(f"  {'total':14} {done - started:.1f}s (budget 60 s)")
            deadline = time.monotonic() + 600
            generation, checked = _type_checked(cp)
            while not checked and time.monotonic() < deadline:
                time.sleep(0.5)
                generation, checked = _type_checked(cp)
            spent = sum(_cpu_seconds(p) for p in kcm) - kcm_before
            print(
                f"kube-controller-manager: {spent:.1f} CPU-s from the chart's install to the "
                f"backstop policy type-checked ({generation}"
                f"{'' if checked else ', not done after 600 s'})"
            )

            times = []
            for _ in range(args.runs):
                ns = f"bench-{uuid.uuid4().hex[:6]}"
                cp.kubectl("create", "namespace", ns, check=True)
                # The init container's own time: the preflight gate (which would hold a
                # bad image's pod for good) is off here (bench/preflight_node_bench.py).
                cp.kubectl("label", "namespace", ns, "epguard.io/inject=enabled",
                           "epguard.io/preflight=off", check=True)  # fmt: skip
                cp.kubectl("delete", "imageverdicts", "--all", check=True)
                while cp.kubectl("get", "sa", "default", "-n", ns).returncode != 0:
                    time.sleep(0.1)
                time.sleep(1)  # the webhook's namespace watch sees the label
                pod: dict[str, Any] = worker_pod("sglang-0", ns, Path(tmp) / ns)
                pod["spec"]["restartPolicy"] = "Never"
                t0 = time.monotonic()
                r = cp.kubectl("create", "-f", "-", input=json.dumps(pod))
                if r.returncode != 0:
                    print(f"  create failed: {r.stderr.strip()}")
                    continue
                wait_probe(cp, ns, ["--field-selector=metadata.name=sglang-0"])
                times.append(time.monotonic() - t0)
                cp.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s")
            if times:
                print(
                    f"apply -> termination message in status over {len(times)} runs: "
                    f"median {statistics.median(times):.1f}s, max {max(times):.1f}s "
                    f"({', '.join(f'{t:.1f}' for t in times)}; budget 10 s)"
                )

            print("resident memory (MiB):")
            total = 0.0
            for name, pids in sorted(_processes_by_name().items()):
                rss = sum(_rss_mib(p) for p in pids)
                total += rss
                print(
                    f"  {name:18} {rss:7.0f}  ({len(pids)} process{'es' if len(pids) > 1 else ''})"
                )
            print(f"  {'total':18} {total:7.0f}")
        finally:
            t0 = time.monotonic()
            stack.stop()
            print(f"make down: {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
