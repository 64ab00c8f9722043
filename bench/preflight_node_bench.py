"""The preflight gate's budgets on the real node (issue 20), printed, not asserted: a
one-node cluster as ``make up`` starts it (containerd 2, the node's registry with the
1 GiB model image, the chart as pods, ``preflight.mode: gate``).

* first-seen bad image: a Deployment of 4 replicas with the model as an image volume;
  ``kubectl apply`` -> every replica held with the probe's cause, -> the ImageVerdict;
  the preflight's own image pull (a real one from the node's registry: the worker image
  is removed from containerd first unless ``--warm``) and probe run (from its Events and
  container times);
  bytes of the model the registry served; GPU-seconds held by the replicas;
* first-seen good image (its only fault here: no GPU): apply -> scheduled, and the
  model bytes served once the gate came off;
* an image already judged (a Usable ImageVerdict, written as the controller would after
  a GPU node's probe passed -- a test double: no probe can pass without a GPU): pod
  creates p50/p99 in a gated namespace vs one with the gate off, alternated;
* scale: P gated pods over N namespaces and I image references (tags of one worker
  image, so each is a first-seen reference): preflights started (at most N x I), the
  gap from each preflight's end to its last gate decided, the controller pods' memory.

    flock /tmp/epguard-node.lock .venv/bin/python bench/preflight_node_bench.py \
        [--pods 200 --namespaces 20 --images 5] [--creates 150] [--warm] [--keep-logs D]
        [--probe-volume copy|image]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from devcluster import ControlPlane
from devcluster.images import BAD_WORKER, ENV_ONLY_WORKER
from devcluster.stack import CHART_DIR, NAMESPACE, Stack, deploy_chart, start_cluster
from epguard.webhook.engine.preflight import CONDITION, GATE, PREFLIGHT_LABEL
from epguard.webhook.engine.verdicts import verdict_name
from tests.e2e.e2e_kube import apply, eventually, output
from tests.e2e.node_e2e import node_of, opted_in_namespace, worker_spec
from tests.e2e.test_preflight_on_node import condition, deployment, pods

POLL = 0.2


@contextlib.contextmanager
def running_cluster(run_dir: Path, probe_volume: str) -> Iterator[ControlPlane]:
    """A one-node cluster as ``make up`` starts it, the chart installed (with
    ``preflight.probeVolume``); stopped after."""
    stack = Stack(run_dir=run_dir, detached=False)
    try:
        start_cluster(stack)
        assert stack.control_plane is not None
        values = [f"--set=preflight.probeVolume={probe_volume}"]
        deploy_chart(stack, stack.control_plane, CHART_DIR, values)
        yield stack.control_plane
    finally:
        stack.stop()


def _time(stamp: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None


def _events(cp: ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    r = cp.kubectl("get", "events", "-n", namespace, "-o", "json",
                   f"--field-selector=involvedObject.name={name}")  # fmt: skip
    items: list[dict[str, Any]] = json.loads(r.stdout)["items"]
    return items


def preflight_figures(cp: ControlPlane, namespace: str) -> str:
    """What the one preflight in ``namespace`` spent: its pulls (kubelet Events) and its
    probe's run (container start to end; the API's times have 1 s resolution)."""
    found = pods(cp, namespace, f"{PREFLIGHT_LABEL}=true")
    if len(found) != 1:
        return f"{len(found)} preflights"
    pod = found[0]
    name = pod["metadata"]["name"]
    pulls = [e["message"] for e in _events(cp, namespace, name) if e.get("reason") == "Pulled"]
    runs = []
    for status in pod["status"].get("initContainerStatuses", []):
        term = status.get("state", {}).get("terminated") or {}
        start, end = _time(term.get("startedAt")), _time(term.get("finishedAt"))
        if start and end:
            runs.append(f"{status['name']} {(end - start).total_seconds():.0f}s")
    created = _time(pod["metadata"]["creationTimestamp"])
    last = max(
        (t for s in pod["status"].get("initContainerStatuses", [])
         if (t := _time((s.get("state", {}).get("terminated") or {}).get("finishedAt")))),
        default=None,
    )  # fmt: skip
    total = f"{(last - created).total_seconds():.0f}s" if created and last else "?"
    return f"created->probe end {total} ({', '.join(runs)}); pulls: {' | '.join(pulls)}"


def _first_init_started(pod: dict[str, Any]) -> bool:
    statuses = pod["status"].get("initContainerStatuses") or [{}]
    state = statuses[0].get("state", {})
    return bool(state.get("running") or state.get("terminated"))


class Timeline:
    """When each stage was first seen, from a watch on the namespace's pods (local clock,
    not the API's 1 s timestamps): the workers created, the preflight created, its probe
    ended, the first and the last worker decided."""

    def __init__(self, cp: ControlPlane, namespace: str, replicas: int, bad: bool) -> None:
        self.api = _core(cp)
        self.namespace, self.replicas, self.bad = namespace, replicas, bad
        self.started = time.monotonic()
        self.seen: dict[str, float] = {}
        self.decided: set[str] = set()
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _mark(self, stage: str) -> None:
        self.seen.setdefault(stage, time.monotonic() - self.started)

    def _watch(self) -> None:
        w = watch.Watch()
        for event in w.stream(self.api.list_namespaced_pod, self.namespace, timeout_seconds=900):
            pod = event["object"]
            labels = pod.metadata.labels or {}
            if labels.get(PREFLIGHT_LABEL) == "true":
                self._mark("preflight created")
                for status in pod.status.init_container_statuses or []:
                    if status.name == "epguard-probe" and status.state.terminated:
                        self._mark("preflight probe ended")
            else:
                self._mark("first worker created")
                gates = [g.name for g in (pod.spec.scheduling_gates or [])]
                conds = {c.type: c for c in pod.status.conditions or []}
                held = CONDITION in conds and conds[CONDITION].reason == "ImageUnusable"
                if (self.bad and held) or (not self.bad and GATE not in gates):
                    self.decided.add(pod.metadata.name)
                    self._mark("first worker decided")
                    if len(self.decided) == self.replicas:
                        self._mark("last worker decided")
            if self.stop.is_set():
                w.stop()

    def report(self) -> str:
        self.stop.set()
        order = sorted(self.seen.items(), key=lambda kv: kv[1])
        return ", ".join(f"{stage} {at:.1f}s" for stage, at in order)


def first_seen(cp: ControlPlane, image: str, replicas: int, bad: bool, cold: bool) -> None:
    node = node_of(cp)
    model = node.registry.model_ref
    with opted_in_namespace(cp, preflight="gate") as ns, tempfile.TemporaryDirectory() as tmp:
        node.forget_image(model)
        if cold:  # the node has never pulled the worker: the preflight's pull is real
            node.forget_image(image)
        since = node.registry.log_offset()
        workload = deployment("w", ns, image, Path(tmp), replicas, claim=False, model_image=model)
        timeline = Timeline(cp, ns, replicas, bad)
        started = time.monotonic()
        r = apply(cp, workload)
        assert r.returncode == 0, output(r)

        def decided() -> bool:
            found = pods(cp, ns, "app=w")
            if len(found) != replicas:
                return False
            if bad:
                return all((c := condition(p)) and c["reason"] == "ImageUnusable" for p in found)
            return all(p["spec"].get("nodeName") for p in found)

        eventually(decided, within=900, what="every replica decided", every=POLL)
        took = time.monotonic() - started
        what = "held with the probe's cause" if bad else "scheduled (gate off)"
        print(f"  apply -> every replica {what}: {took:.1f}s")
        print(f"  timeline from apply: {timeline.report()}")
        if bad:
            eventually(lambda: bool(json.loads(cp.kubectl(
                "get", "imageverdicts", "-o", "json").stdout)["items"]), within=120,
                what="the ImageVerdict", every=POLL)  # fmt: skip
            print(f"  apply -> ImageVerdict: {time.monotonic() - started:.1f}s")
            held = sum(1 for p in pods(cp, ns, "app=w") if p["spec"].get("nodeName"))
            print(f"  replicas ever scheduled: {held} (GPU-seconds held: 0 when 0)")
        print(f"  preflight: {preflight_figures(cp, ns)}")
        if not bad:
            # The kubelet pulls the model before it starts the first init container.
            eventually(lambda: any(_first_init_started(p) for p in pods(cp, ns, "app=w")),
                       within=300, what="the first init container", every=POLL)  # fmt: skip
        print("  the controllers' decisions (each replica's log):")
        for line in _controller_lines(cp, "preflight "):
            print(f"    {line}")
        served = node.registry.blob_gets(since)
        layers = node.registry.model_layer_sizes()
        got = sum(served[d].bytes for d in layers if d in served)
        print(f"  model bytes served by the registry: {got:,} of {sum(layers.values()):,}")
        worker = sum(b.bytes for d, b in served.items() if d not in layers)
        print(f"  worker image bytes served by the registry: {worker:,}")


def _controller_lines(cp: ControlPlane, containing: str) -> list[str]:
    """The lines of each controller replica's log that contain ``containing``, each
    prefixed with its pod's name, in time order (the log's own timestamps)."""
    r = cp.kubectl("get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=controller",
                   "-o", "jsonpath={.items[*].metadata.name}")  # fmt: skip
    lines = []
    for name in r.stdout.split():
        log = cp.kubectl("logs", "-n", NAMESPACE, name, "--since=15m").stdout
        lines += [f"{line[11:23]} {name[-5:]} {line[24:]}" for line in log.splitlines()
                  if containing in line]  # fmt: skip
    return sorted(lines)


def _usable_verdict(cp: ControlPlane, image: str) -> None:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    obj = {
        "apiVersion": "epguard.io/v1alpha1", "kind": "ImageVerdict",
        "metadata": {"name": verdict_name(image, None)},
        "spec": {"image": image, "digest": "", "verdict": "Usable",
                 "reason": "epguard: mooncake elastic EP is usable in this image",
                 "versions": {"sglang": "0.5.20", "torch": "2.13.0", "mooncake": "0.3.13"},
                 "firstSeen": now, "lastSeen": now, "pod": "bench/gpu-node-probe", "count": 1},
    }  # fmt: skip
    r = apply(cp, obj)
    assert r.returncode == 0, output(r)


class Sightings:
    """When the API server first showed each preflight's probe ended and each waiting
    pod's gate decided (a watch on every pod; this machine's clock, as the kubelet's)."""

    def __init__(self, cp: ControlPlane) -> None:
        self.api = _core(cp)
        self.ended: dict[tuple[str, str], float] = {}  # (namespace, image) -> epoch s
        self.decided: dict[tuple[str, str], float] = {}  # (namespace, pod) -> epoch s
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        # Read the raw objects (no model to fail on a field it does not know) and start
        # again after any error, which the report names: a watch that died quietly once
        # left the split out of a whole run.
        while not self.stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(self.api.list_pod_for_all_namespaces,
                                      timeout_seconds=1800):  # fmt: skip
                    self._saw(event["raw_object"], time.time())
                    if self.stop.is_set():
                        w.stop()
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                time.sleep(0.5)

    def _saw(self, pod: dict[str, Any], now: float) -> None:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ns = meta.get("namespace", "")
        if (meta.get("labels") or {}).get(PREFLIGHT_LABEL) == "true":
            for s in status.get("initContainerStatuses") or []:
                if s.get("name") == "epguard-probe" and (s.get("state") or {}).get("terminated"):
                    image = pod["spec"]["initContainers"][-1]["image"]
                    self.ended.setdefault((ns, image), now)
        elif any(c.get("type") == CONDITION and c.get("reason") == "ImageUnusable"
                 for c in status.get("conditions") or []):  # fmt: skip
            self.decided.setdefault((ns, meta.get("name", "")), now)


def _core(cp: ControlPlane) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(cp.kubeconfig)))


def judged_creates(cp: ControlPlane, creates: int) -> None:
    image = "registry.example.com/bench/sglang:judged-usable"
    api = _core(cp)
    with opted_in_namespace(cp, "gate") as gate_ns, opted_in_namespace(cp, "off") as off_ns:
        _usable_verdict(cp, image)
        time.sleep(3)  # the webhook's verdict watch
        spec = worker_spec(Path("/tmp/bench-models"), image)
        spec["containers"][0]["resources"] = {}
        # Bound to a node that does not exist: the create is the whole of it (no pod
        # runs on the 2-core node between creates to add noise to either side).
        spec["nodeName"] = "bench-nowhere"
        times: dict[str, list[float]] = {gate_ns: [], off_ns: []}
        gated = 0
        for i in range(creates):
            for ns in (gate_ns, off_ns) if i % 2 else (off_ns, gate_ns):
                body = {"metadata": {"name": f"p-{i}", "namespace": ns}, "spec": spec}
                started = time.perf_counter()
                made = api.create_namespaced_pod(ns, body)  # type: ignore[arg-type]
                times[ns].append((time.perf_counter() - started) * 1000)
                gated += ns == gate_ns and any(
                    g.name == GATE for g in (made.spec and made.spec.scheduling_gates) or []
                )
        for label, ns in (("gate", gate_ns), ("off", off_ns)):
            t = sorted(times[ns])
            p99 = t[min(len(t) - 1, int(len(t) * 0.99))]
            print(f"  preflight {label:>4}: p50 {statistics.median(t):.1f} ms, p99 {p99:.1f} ms "
                  f"({len(t)} creates)")  # fmt: skip
        print(f"  pods gated on the judged image: {gated}")
        cp.kubectl("delete", "imageverdicts", "--all")


def scale(cp: ControlPlane, total: int, namespaces: int, images: int) -> None:
    node = node_of(cp)
    source = BAD_WORKER.ref
    # More tags of the worker in the node's registry: each a first-seen reference, pulled
    # by its preflight (a manifest only: the layers are unpacked on the node already).
    refs = [f"{source.rsplit(':', 1)[0]}:bench-alias-{i}" for i in range(images)]
    for ref in refs:
        node.registry.tag(source, ref)
    try:
        _scale(cp, refs, total, namespaces, images)
    finally:
        # containerd's store outlives the cluster: leave no other name on the worker.
        node.ctr("images", "rm", *refs, check=False)


def _scale(cp: ControlPlane, refs: list[str], total: int, namespaces: int, images: int) -> None:
    api = _core(cp)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        spaces = [stack.enter_context(opted_in_namespace(cp, "gate")) for _ in range(namespaces)]
        seen = Sightings(cp)
        started = time.monotonic()
        refused = 0
        for i in range(total):
            ns, ref = spaces[i % namespaces], refs[(i // namespaces) % images]
            spec = worker_spec(Path(tmp), ref)
            spec["containers"][0]["resources"] = {}
            body = {"metadata": {"name": f"w-{i}", "namespace": ns}, "spec": spec}
            try:
                api.create_namespaced_pod(ns, body)  # type: ignore[arg-type]
            except ApiException as exc:
                # Once a preflight's verdict is recorded, the reference it ran on is
                # refused at admission in every namespace: learned, not gated.
                assert exc.status == 403, exc
                refused += 1
        print(
            f"  {total} pod creates in {time.monotonic() - started:.1f}s, "
            f"{refused} refused at admission by a verdict learned meanwhile"
        )

        def every_gate_decided() -> bool:
            for ns in spaces:
                for p in pods(cp, ns, f"!{PREFLIGHT_LABEL}"):
                    c = condition(p)
                    if c is None or c["reason"] not in ("ImageUnusable",):
                        return False
            return True

        eventually(every_gate_decided, within=1800, what="every gate decided", every=2.0)
        print(f"  every gate decided {time.monotonic() - started:.1f}s after the first create")
        seen.stop.set()
        preflights, lags, reported, decided = 0, [], [], []
        worst, late, raw = "", 0, []
        for ns in spaces:
            ends: dict[str, dt.datetime] = {}
            for p in pods(cp, ns, f"{PREFLIGHT_LABEL}=true"):
                preflights += 1
                statuses = p["status"].get("initContainerStatuses", [])
                end = max((t for s in statuses if (t := _time(
                    (s.get("state", {}).get("terminated") or {}).get("finishedAt")))),
                    default=None)  # fmt: skip
                if end:
                    ends[p["spec"]["initContainers"][-1]["image"]] = end
            for p in pods(cp, ns, f"!{PREFLIGHT_LABEL}"):
                c = condition(p)
                image = p["spec"]["containers"][0]["image"]
                end = ends.get(image)
                # A pod created after its preflight ended (before the verdict reached the
                # webhook, which then refuses new pods) waits from its creation, not from
                # the end: counting from the end charged it the time before it existed.
                created = _time(p["metadata"]["creationTimestamp"])
                since = max(end, created) if end and created else end
                if c and end and since and (at := _time(c.get("lastTransitionTime"))):
                    lags.append((at - since).total_seconds())
                    raw.append((at - end).total_seconds())
                    late += since > end
                    if lags[-1] >= max(lags):
                        name = f"{ns}/{p['metadata']['name']} ({image})"
                        worst = f"{name}: end {end:%H:%M:%S}, created {created:%H:%M:%S}, "
                        worst += f"decided {at:%H:%M:%S}"
                shown = seen.ended.get((ns, image))
                held = seen.decided.get((ns, p["metadata"]["name"]))
                if end and since and shown and held:
                    # finishedAt has 1 s resolution: it is rounded down, so +0.5 s.
                    reported.append(shown - end.timestamp() - 0.5)
                    decided.append(held - max(shown, since.timestamp()))
        print(f"  preflights started: {preflights} (bound {namespaces * images})")
        if lags:
            print(f"  preflight end (or the pod's creation, if later: {late} pods) -> gate "
                  f"decided: median {statistics.median(lags):.0f}s, max {max(lags):.0f}s "
                  f"(1 s resolution; from the end alone: max {max(raw):.0f}s); the slowest: "
                  f"{worst}")  # fmt: skip
        if reported:
            # Split in two: the kubelet's report of the end, then epguard's decision.
            print(f"    end -> the API server shows it (the kubelet's report): median "
                  f"{statistics.median(reported):.1f}s, max {max(reported):.1f}s; shown -> "
                  f"gate decided: median {statistics.median(decided):.1f}s, "
                  f"max {max(decided):.1f}s ({len(decided)} pods)")  # fmt: skip
        if seen.errors:
            print(f"    the watch started again {len(seen.errors)} times; last: {seen.errors[-1]}")
        for run, said in (("a pass of ", "passes"), ("an answer run of ", "answer runs")):
            took = [float(line.split(run)[1].split(" s")[0])
                    for line in _controller_lines(cp, run)]  # fmt: skip
            if took:
                print(f"  {said} that changed something: {len(took)}, each took median "
                      f"{statistics.median(took):.2f}s, max {max(took):.2f}s")  # fmt: skip
        r = cp.kubectl("get", "--raw",
                       "/api/v1/namespaces/epguard-system/pods")  # fmt: skip
        for p in json.loads(r.stdout)["items"]:
            if "controller" in p["metadata"]["name"]:
                pid_rss = node_rss(p["metadata"]["uid"])
                print(f"  {p['metadata']['name']}: {pid_rss}")


def node_rss(uid: str) -> str:
    """The resident memory of a pod's processes, from their cgroup (cgroup v1 here)."""
    for base in Path("/sys/fs/cgroup/memory").rglob(f"*{uid.replace('-', '_')}*"):
        usage = base / "memory.usage_in_bytes"
        if usage.is_file():
            return f"{int(usage.read_text()) / 2**20:.0f} MiB (cgroup memory.usage)"
    for base in Path("/sys/fs/cgroup/memory").rglob(f"*{uid}*"):
        usage = base / "memory.usage_in_bytes"
        if usage.is_file():
            return f"{int(usage.read_text()) / 2**20:.0f} MiB (cgroup memory.usage)"
    return "memory not found"


def keep_logs(node: Path, to: Path) -> None:
    for part in ("logs", "pod-logs"):
        shutil.copytree(node / part, to / part, dirs_exist_ok=True, symlinks=False)
    print(f"the node's logs: {to}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--namespaces", type=int, default=20)
    parser.add_argument("--images", type=int, default=5)
    parser.add_argument("--creates", type=int, default=150)
    parser.add_argument("--warm", action="store_true",
                        help="keep the worker images the node holds (default: forget each "
                             "before its first-seen run, so the preflight pulls it)")  # fmt: skip
    parser.add_argument("--probe-volume", choices=["copy", "image"], default="copy",
                        help="the chart's preflight.probeVolume (default: the chart's "
                             "default, copy)")  # fmt: skip
    parser.add_argument("--skip", action="append", default=[],
                        choices=["bad", "good", "judged", "scale"])  # fmt: skip
    parser.add_argument(
        "--keep-logs",
        type=Path,
        help="copy the node's logs (kubelet, containerd, the registry's access log) and its "
        "pods' logs (epguard's controllers) here before the node stops",
    )
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        run = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        cp = stack.enter_context(running_cluster(run, args.probe_volume))
        print(f"preflight.probeVolume: {args.probe_volume}")
        if args.keep_logs:
            stack.callback(keep_logs, node_of(cp).workdir, args.keep_logs)
        if "bad" not in args.skip:
            print(f"first-seen bad image ({BAD_WORKER.ref}), 4 replicas, model image volume:")
            first_seen(cp, BAD_WORKER.ref, 4, bad=True, cold=not args.warm)
        if "good" not in args.skip:
            print(f"first-seen good image ({ENV_ONLY_WORKER.ref}), 1 replica, model volume:")
            first_seen(cp, ENV_ONLY_WORKER.ref, 1, bad=False, cold=not args.warm)
        if "judged" not in args.skip:
            print(f"an image already judged Usable, {args.creates} creates per namespace:")
            judged_creates(cp, args.creates)
        if "scale" not in args.skip:
            print(f"scale: {args.pods} pods, {args.namespaces} namespaces, {args.images} refs:")
            scale(cp, args.pods, args.namespaces, args.images)


if __name__ == "__main__":
    main()
