"""The recorder (probe outcomes in pod status → ImageVerdicts and Events) against an
in-memory API that behaves like the API server where it matters: resourceVersions, 409 on
a lost race (a create of an object that exists, a replace at a stale resourceVersion),
one Event per name, owners read by REST path, refused reads.

Pods are signed by the real signing code, as /mutate signs them
(tests/controller/test_signature_use.py), and carry the termination the kubelet wrote
(tests/probe/probe_pods.py)."""

from __future__ import annotations

import copy
import datetime as dt
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import kopf
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.webhook.controller import owners
from epguard.webhook.controller.owners import Unreadable
from epguard.webhook.controller.recorder import (
    COMPONENT,
    CONFLICT_BACKOFF,
    RECOUNT_SECONDS,
    RESOLVED_FOR,
    WRITE_ATTEMPTS,
    Conflict,
    KubeRecorderApi,
    Recorder,
    has_probe,
    record_probe_outcomes,
    remembered,
)
from epguard.webhook.engine.imageref import parse
from epguard.webhook.engine.outcome import MAX_RUNS
from epguard.webhook.engine.signing import (
    FRESH_SECONDS,
    SIGNATURE_ANNOTATION,
    Keyring,
    KeyringHolder,
    SignatureLedger,
)
from epguard.webhook.engine.text import stamp
from epguard.webhook.engine.verdicts import (
    TAUGHT_BY_LABEL,
    ImageVerdictObject,
    VerdictStore,
    verdict_from_object,
    verdict_name,
)
from tests.controller.test_certificate_manager import config
from tests.controller.test_signature_use import NOW, keys, signed_pod
from tests.probe.probe_pods import pod_with_probe_status

IMAGE = "registry.example/sglang:1"
DIGEST = "sha256:" + "cd" * 32
VERDICT = verdict_name(IMAGE, DIGEST)  # sha256-<digest>-<hash of the tag>
FINISHED = stamp(NOW + dt.timedelta(seconds=7))  # a signed pod's probe ended (probed_pod)
T1 = NOW + dt.timedelta(minutes=10)
T2 = NOW + dt.timedelta(minutes=20)
LATER = stamp(NOW + dt.timedelta(minutes=1))  # a second pod's probe ended
NODE = "gpu-1"

# What the probe writes (probe/message.py), as the kubelet hands it back.
USABLE_MSG = (
    "epguard: mooncake elastic EP is usable: mooncake.pg imports after torch\n"
    "versions: torch=2.13.0+cu130 sglang=0.5.18 mooncake-transfer-engine-cuda13=0.3.13.post1\n"
    "fix: nothing to fix"
)
# A preflight's files-only pass: no verdict, but its pull tells what a tag named.
CLEARED_MSG = "epguard: no image cause in this image's files: the GPU node decides"
UNUSABLE_MSG = (
    "epguard: mooncake elastic EP is unusable in this image: mooncake.pg was built for "
    "another torch\n"
    "versions: torch=2.13.0+cu130 sglang=0.5.18 mooncake-transfer-engine=0.3.6\n"
    "fix: install the mooncake build for this torch"
)
IN_POD_MSG = (
    "epguard: mooncake elastic EP is unusable in this pod: libcuda.so.1 not found\n"
    "versions: torch=2.13.0+cu130 sglang=0.5.18 mooncake-transfer-engine=0.3.6\n"
    "fix: schedule the pod on a node with the NVIDIA driver"
)
# "in this image", but its own scope line says environment: a self-contradicting message
# is no evidence about the image.
SAYS_ENVIRONMENT_MSG = (
    "epguard: mooncake elastic EP is unusable in this image: the smoke test timed out\n"
    "scope: environment\n"
    "fix: retry on another node"
)


def named(i: int) -> str:
    """The verdict object of IMAGE at digest ``i``."""
    return verdict_name(IMAGE, "sha256:" + f"{i:02x}" * 32)


# --- the in-memory API ---------------------------------------------------------------


class NotFound(Exception):
    """A replace of an object that is not there (the API server's 404)."""


@dataclass(frozen=True)
class Event:
    kind: str
    name: str
    namespace: str
    uid: str | None
    api_version: str
    reason: str
    message: str
    warning: bool


class InMemoryApi:
    """RecorderApi in memory. Every call is logged in ``calls``; ``before_next_write`` runs
    once inside the next verdict write, before it is checked (another replica's write
    landing between this one's read and write)."""

    def __init__(self) -> None:
        self.versions = itertools.count(1)
        self.verdicts: dict[str, dict[str, Any]] = {}
        self.objects: dict[str, dict[str, Any]] = {}  # REST path → object
        self.refused: set[str] = set()  # paths whose read is a 403
        self.events: dict[tuple[str, str, str, str], Event] = {}  # (ns, kind, name, key)
        self.calls: list[tuple[str, str]] = []
        self.verdict_writes = 0
        self.event_posts = 0
        self.events_down = False
        self.before_next_write: Callable[[], None] | None = None
        # node name → its kubernetes.io/arch label (None: the node has none)
        self.nodes: dict[str, str | None] = {NODE: "amd64"}

    # RecorderApi

    def count_taught(self, namespace: str, up_to: int) -> int:
        self.calls.append(("count_taught", namespace))
        return sum(
            1
            for v in self.verdicts.values()
            if v["metadata"].get("labels", {}).get(TAUGHT_BY_LABEL) == namespace
        )

    def read_verdict(self, name: str) -> dict[str, Any] | None:
        self.calls.append(("read_verdict", name))
        found = self.verdicts.get(name)
        return copy.deepcopy(found) if found is not None else None

    def create_verdict(self, body: ImageVerdictObject) -> None:
        obj: dict[str, Any] = copy.deepcopy(dict(body))
        name = obj["metadata"]["name"]
        self.calls.append(("create_verdict", name))
        self._interleave()
        if "resourceVersion" in obj["metadata"]:
            raise ValueError("resourceVersion should not be set on objects to be created")
        if name in self.verdicts:
            raise Conflict(f"imageverdicts {name!r} already exists")
        self._store(name, obj)

    def replace_verdict(self, name: str, body: ImageVerdictObject) -> None:
        obj: dict[str, Any] = copy.deepcopy(dict(body))
        self.calls.append(("replace_verdict", name))
        self._interleave()
        assert obj["metadata"]["name"] == name
        existing = self.verdicts.get(name)
        if existing is None:
            raise NotFound(name)
        version = obj["metadata"].get("resourceVersion")
        if version is None:  # a CRD takes no unconditional update
            raise ValueError("metadata.resourceVersion must be specified for an update")
        if version != existing["metadata"]["resourceVersion"]:
            raise Conflict("the object has been modified")
        self._store(name, obj)

    def read_object(self, path: str) -> dict[str, Any]:
        self.calls.append(("read_object", path))
        if path in self.refused:
            raise Unreadable("Forbidden")
        found = self.objects.get(path)
        if found is None:
            raise Unreadable("Not Found")
        return copy.deepcopy(found)

    def post_event(
        self,
        about: client.V1ObjectReference,
        reason: str,
        message: str,
        *,
        warning: bool,
        key: str,
    ) -> bool:
        self.calls.append(("post_event", f"{about.kind}/{about.name}"))
        self.event_posts += 1
        if self.events_down:
            return False
        name = (str(about.namespace), str(about.kind), str(about.name), key)
        # The same name again is a 409: one Event, and the caller counts it as posted.
        self.events.setdefault(
            name,
            Event(
                kind=str(about.kind),
                name=str(about.name),
                namespace=str(about.namespace),
                uid=about.uid,
                api_version=str(about.api_version),
                reason=reason,
                message=message,
                warning=warning,
            ),
        )
        return True

    def architecture_of(self, node: str) -> str | None:
        self.calls.append(("architecture_of", node))
        return self.nodes.get(node)

    def other_than(self, architecture: str | None) -> tuple[str, str] | None:
        self.calls.append(("other_than", str(architecture)))
        return next(
            ((n, a) for n, a in sorted(self.nodes.items()) if a is not None and a != architecture),
            None,
        )

    # helpers

    def _interleave(self) -> None:
        hook, self.before_next_write = self.before_next_write, None
        if hook is not None:
            hook()

    def _store(self, name: str, obj: dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self.versions))
        self.verdicts[name] = obj
        self.verdict_writes += 1

    def touch(self, name: str) -> None:
        """Someone else writes the verdict (its resourceVersion moves on)."""
        self.verdicts[name]["metadata"]["resourceVersion"] = str(next(self.versions))

    def spec(self, name: str = VERDICT) -> dict[str, Any]:
        spec: dict[str, Any] = self.verdicts[name]["spec"]
        return spec

    def events_on(self, kind: str, name: str) -> list[Event]:
        return [e for e in self.events.values() if (e.kind, e.name) == (kind, name)]

    def called(self, what: str) -> list[str]:
        return [arg for call, arg in self.calls if call == what]


# --- pods, replicas ------------------------------------------------------------------


def probed_pod(
    uid: str,
    message: str,
    exit_code: int,
    *,
    owners: Iterable[dict[str, Any]] = (),
    digest: str | None = DIGEST,
    section: str = "state",
    restart_count: int = 0,
    namespace: str = "ml",
    signed_at: dt.datetime = NOW,
    node: str | None = NODE,
    image: str = IMAGE,
    pull_policy: str = "Always",
    started: dt.datetime | None = None,
    finished: str = FINISHED,
) -> dict[str, Any]:
    """A pod /mutate injected and signed (created a second after signing), as the API
    returns it once the kubelet of ``node`` wrote the probe's termination. The worker's
    ``pull_policy`` is its probe's (the API server's default is not signed)."""
    pod = signed_pod(uid, signed_at, signed_at + dt.timedelta(seconds=1), namespace, image)
    for c in pod["spec"]["initContainers"]:
        if c["name"] == "epguard-probe":
            c["imagePullPolicy"] = pull_policy
    if node is not None:
        pod["spec"]["nodeName"] = node
    # The runtime reports the digest under the repository the pod asked for.
    image_id = f"{parse(image).name}@{digest}" if digest else ""
    pod["status"] = pod_with_probe_status(
        message,
        exit_code,
        image=image,
        image_id=image_id,
        section=section,
        restart_count=restart_count,
        started_at=stamp(started or signed_at + dt.timedelta(seconds=2)),
        finished_at=finished,
    )["status"]
    if owners:
        pod["metadata"]["ownerReferences"] = list(owners)
    return pod


def run_of(uid: str, finished: str = FINISHED) -> str:
    return f"{uid}/epguard-probe/{finished}"


def replica(
    api: InMemoryApi, at: dt.datetime = T1, *, with_keys: bool = True, **memo: Any
) -> kopf.Memo:
    """One controller process: its recorder (clock fixed at ``at``), keys and ledger."""
    # No real sleep between write attempts: the waits asked for are kept on the recorder.
    waits: list[float] = []
    recorder = Recorder(api, clock=lambda: at, sleep=waits.append)
    recorder.waits = waits  # type: ignore[attr-defined]
    state = kopf.Memo(recorder=recorder, signatures=SignatureLedger())
    if with_keys:
        state["probe_keys"] = keys()
    state.update(memo)
    return state


def record(pod: dict[str, Any], memo: kopf.Memo) -> None:
    record_probe_outcomes(pod, memo)


def record_worker(
    api: InMemoryApi, one: Recorder, uid: str, digest: str = DIGEST, namespace: str = "ml"
) -> None:
    """A gated worker's own probe (it pulled IfNotPresent), recorded by controller ``one``
    (a memo of its own: kopf's for this pod)."""
    pod = probed_pod(uid, USABLE_MSG, 0, digest=digest, namespace=namespace,
                     pull_policy="IfNotPresent")  # fmt: skip
    record(pod, replica(api, recorder=one))


def owner_ref(api_version: str, kind: str, name: str, *, controller: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": f"uid-{name}",
        "controller": controller,
    }


RS = owner_ref("apps/v1", "ReplicaSet", "w-7d9f")
DEPLOYMENT = owner_ref("apps/v1", "Deployment", "w")
RS_PATH = "/apis/apps/v1/namespaces/ml/replicasets/w-7d9f"
DEPLOYMENT_PATH = "/apis/apps/v1/namespaces/ml/deployments/w"


def deployment_chain(api: InMemoryApi) -> list[dict[str, Any]]:
    """Pod → ReplicaSet → Deployment in the API; the pod's ownerReferences."""
    api.objects[RS_PATH] = {"metadata": {"name": "w-7d9f", "ownerReferences": [DEPLOYMENT]}}
    api.objects[DEPLOYMENT_PATH] = {"metadata": {"name": "w"}}
    return [RS]


@pytest.fixture
def api() -> InMemoryApi:
    return InMemoryApi()


# --- what is written -----------------------------------------------------------------


class TestVerdicts:
    def test_an_unusable_outcome_becomes_an_unusable_verdict(self, api: InMemoryApi) -> None:
        record(probed_pod("u1", UNUSABLE_MSG, 1), replica(api, T1))
        [(name, obj)] = api.verdicts.items()
        assert name == VERDICT
        assert obj["apiVersion"] == "epguard.io/v1alpha1" and obj["kind"] == "ImageVerdict"
        assert obj["metadata"]["labels"] == {
            "app.kubernetes.io/managed-by": COMPONENT,
            TAUGHT_BY_LABEL: "ml",
            "epguard.io/architecture": "amd64",
        }
        assert obj["spec"] == {
            "image": IMAGE,
            "digest": DIGEST,
            "verdict": "Unusable",
            "reason": "mooncake.pg was built for another torch",
            "report": UNUSABLE_MSG,
            "versions": {
                "sglang": "0.5.18",
                "torch": "2.13.0+cu130",
                "mooncake": "mooncake-transfer-engine 0.3.6",
            },
            "firstSeen": FINISHED,  # when the run ended, not when it was read (T1)
            "lastSeen": FINISHED,
            "pod": "ml/pod-u1",
            "source": "probe",
            "count": 1,
            "runs": [run_of("u1")],
            "architecture": "amd64",
        }

    def test_an_unusable_outcome_is_a_warning_on_the_pod(self, api: InMemoryApi) -> None:
        record(probed_pod("u1", UNUSABLE_MSG, 1), replica(api))
        [event] = api.events_on("Pod", "pod-u1")
        assert (event.reason, event.warning, event.uid) == ("MooncakeProbeFailed", True, "u1")
        assert event.message == (
            f"epguard probe in pod ml/pod-u1 (container epguard-probe, image {IMAGE}): "
            + UNUSABLE_MSG.splitlines()[0]
        )

    def test_a_usable_outcome_becomes_a_usable_verdict_and_a_normal_event(
        self, api: InMemoryApi
    ) -> None:
        record(probed_pod("u1", USABLE_MSG, 0), replica(api))
        spec = api.spec()
        assert spec["verdict"] == "Usable" and spec["digest"] == DIGEST
        assert spec["versions"]["mooncake"] == "mooncake-transfer-engine-cuda13 0.3.13.post1"
        assert spec["count"] == 1 and spec["runs"] == [run_of("u1")]
        [event] = api.events_on("Pod", "pod-u1")
        assert (event.reason, event.warning) == ("MooncakeProbePassed", False)

    def test_a_new_run_of_the_probe_counts_again_and_keeps_first_seen(
        self, api: InMemoryApi
    ) -> None:
        record(probed_pod("u1", UNUSABLE_MSG, 1), replica(api, T1))
        # The pod's probe ran again (Init:CrashLoopBackOff: the run is in lastState).
        later = stamp(NOW + dt.timedelta(seconds=67))
        again = probed_pod("u1", UNUSABLE_MSG, 1, section="lastState", restart_count=2,
                           finished=later)  # fmt: skip
        record(again, replica(api, T2))
        spec = api.spec()
        assert spec["count"] == 2
        assert spec["runs"] == [run_of("u1"), run_of("u1", later)]
        assert (spec["firstSeen"], spec["lastSeen"]) == (FINISHED, later)

    def test_a_run_read_again_after_a_restart_leaves_the_verdict_as_it_was(
        self, api: InMemoryApi
    ) -> None:
        """The verdict remembers its last MAX_RUNS runs: a restarted controller reading an
        older pod's run again counts it, as the run it is. The old code dated it when
        read: the old Unusable answer came back over the newer Usable one, renewed."""
        ended = [stamp(NOW + dt.timedelta(seconds=10 + i)) for i in range(MAX_RUNS + 1)]
        old = probed_pod("u0", UNUSABLE_MSG, 1, finished=ended[0])
        record(old, replica(api, T1))
        for i in range(1, MAX_RUNS + 1):
            record(probed_pod(f"u{i}", USABLE_MSG, 0, finished=ended[i]), replica(api, T1))
        before = api.spec()
        assert run_of("u0", ended[0]) not in before["runs"]
        record(old, replica(api, T2))  # a new controller process
        after = api.spec()
        assert (after["verdict"], after["lastSeen"], after["pod"]) == (
            "Usable",
            ended[-1],
            f"ml/pod-u{MAX_RUNS}",
        )
        assert after["count"] == before["count"] + 1

    def test_one_termination_shown_under_two_restart_counts_counts_once(
        self, api: InMemoryApi
    ) -> None:
        """Found by a review helper on 3c638ec: in a crash loop the kubelet shows one
        termination in ``state`` while it ends, then in ``lastState`` while the container
        waits (the count unchanged), then with the count raised once the next run starts.
        Keyed by the count, it was recorded again."""
        memo = replica(api, T1)
        record(probed_pod("u1", UNUSABLE_MSG, 1, restart_count=3), memo)
        waiting = probed_pod("u1", UNUSABLE_MSG, 1, section="lastState", restart_count=3)
        record(waiting, memo)
        running = probed_pod("u1", UNUSABLE_MSG, 1, section="running again", restart_count=4)
        record(running, replica(api, T2))  # another replica, after a failover
        assert api.spec()["count"] == 1 and api.verdict_writes == 1

    def test_a_failed_run_shown_beside_the_next_runs_digest_teaches_nothing(
        self, api: InMemoryApi
    ) -> None:
        """A tenant's tag moved to another image between two runs of a crash-looping
        probe: once the next run starts, imageID is the new bytes' while lastState is
        the old run's failure. A controller that had not seen the failure (restarted, or
        a failover) recorded it for the new digest."""
        other = "sha256:" + "ee" * 32
        again = probed_pod("u1", UNUSABLE_MSG, 1, section="running again", restart_count=1,
                           digest=other)  # fmt: skip
        record(again, replica(api, T2))
        assert api.verdicts == {} and api.verdict_writes == 0

    def test_a_newer_outcome_of_another_pod_replaces_the_verdict(self, api: InMemoryApi) -> None:
        record(probed_pod("u1", UNUSABLE_MSG, 1), replica(api, T1))
        record(probed_pod("u2", USABLE_MSG, 0), replica(api, T2))
        spec = api.spec()
        assert (spec["verdict"], spec["pod"], spec["count"]) == ("Usable", "ml/pod-u2", 2)
        assert spec["runs"] == [run_of("u1"), run_of("u2")]

    def test_a_verdict_is_written_when_no_event_can_be_posted(self, api: InMemoryApi) -> None:
        api.events_down = True
        record(probed_pod("u1", UNUSABLE_MSG, 1, owners=deployment_chain(api)), replica(api))
        assert api.spec()["count"] == 1
        assert api.event_posts == 2 and not api.events  # tried pod and owner, both failed


# --- one architecture ----------------------------------------------------------------


class TestArchitectures:
    """A verdict is per image digest, which for a multi-platform image is the same on
    every architecture while the files are not: learned only where every node shares
    the architecture the probe ran on (controller/architectures.py)."""

    def test_a_second_architecture_stops_learning_and_says_why_on_pod_and_owner(
        self, api: InMemoryApi
    ) -> None:
        api.nodes["gh200-1"] = "arm64"
        pod = probed_pod("u1", UNUSABLE_MSG, 1, owners=deployment_chain(api), node="gh200-1")
        record(pod, replica(api))
        assert api.verdicts == {} and api.called("create_verdict") == []
        for kind, name in (("Pod", "pod-u1"), ("Deployment", "w")):
            said = {e.reason: e.message for e in api.events_on(kind, name)}
            assert said.keys() == {"MooncakeProbeFailed", "EpguardVerdictNotLearned"}
            assert (
                "nodes of more than one architecture (gh200-1 is arm64, gpu-1 is amd64)"
                in (said["EpguardVerdictNotLearned"])
            )

    @pytest.mark.parametrize("node", [None, "gone", "unlabelled"])
    def test_a_probe_whose_node_has_no_architecture_teaches_nothing(
        self, api: InMemoryApi, node: str | None
    ) -> None:
        api.nodes["unlabelled"] = None
        record(probed_pod("u1", UNUSABLE_MSG, 1, node=node), replica(api))
        assert api.verdicts == {}
        [event] = [e for e in api.events_on("Pod", "pod-u1") if e.reason != "MooncakeProbeFailed"]
        assert event.reason == "EpguardVerdictNotLearned"

    def test_a_declared_architecture_teaches_on_its_nodes_only(self, api: InMemoryApi) -> None:
        """controller.architectures: [amd64]: a node of another architecture (an
        autoscaled pool a tenant brought up) neither stops learning nor teaches."""
        api.nodes["gh200-1"] = "arm64"
        memo = replica(api, config=config(architectures=("amd64",)))
        record(probed_pod("u1", UNUSABLE_MSG, 1), memo)
        assert api.spec()["architecture"] == "amd64"
        record(probed_pod("u2", USABLE_MSG, 0, node="gh200-1", image="registry.example/b:1"),
               memo)  # fmt: skip
        assert len(api.verdicts) == 1
        [event] = [e for e in api.events_on("Pod", "pod-u2") if e.reason != "MooncakeProbePassed"]
        assert "gh200-1 is arm64, not amd64" in event.message

    def test_an_unlabelled_node_elsewhere_does_not_stop_learning(self, api: InMemoryApi) -> None:
        api.nodes["virtual-1"] = None
        record(probed_pod("u1", USABLE_MSG, 0), replica(api))
        assert api.spec()["architecture"] == "amd64"

    def test_an_environment_cause_reads_no_node(self, api: InMemoryApi) -> None:
        record(probed_pod("u1", IN_POD_MSG, 1), replica(api))
        assert api.verdicts == {}
        assert api.called("architecture_of") == [] and api.called("other_than") == []


# --- one tag, one object --------------------------------------------------------------


class TestTags:
    @pytest.mark.parametrize(
        "other", [f"registry.example/sglang@{DIGEST}", "mirror.example/copy:any"]
    )
    def test_a_probe_of_the_same_bytes_under_another_reference_keeps_the_tags_verdict(
        self, api: InMemoryApi, other: str
    ) -> None:
        """A tag's Unusable verdict refuses pods on the tag for the TTL. Before, one
        object per digest held one ``spec.image``: another tenant's probe of the same
        bytes, pinned by digest or under a mirror's name, replaced it, and the tag's
        verdict stopped refusing every tenant's pods (found by a review helper)."""
        record(probed_pod("u1", UNUSABLE_MSG, 1), replica(api, T1))
        record(probed_pod("u2", USABLE_MSG, 0, image=other, namespace="team-b"),
               replica(api, T2))  # fmt: skip
        store = VerdictStore()
        store.replace(v for o in api.verdicts.values() if (v := verdict_from_object(o)))
        hit = store.lookup(parse(IMAGE), T2 + dt.timedelta(minutes=1))
        assert hit is not None and hit.trust == "deny" and hit.verdict.image == IMAGE
        assert len(api.verdicts) == 2 and api.spec()["count"] == 1

    def test_a_nodes_old_copy_of_a_tag_never_answers_for_the_tag(self, api: InMemoryApi) -> None:
        """A tag moved to a fixed build; one node still holds the old one, and a probe
        pulled IfNotPresent there ran it. Its Unusable answers for the old digest only:
        pods on the tag (whose new bytes a resolving pull judged usable) are not refused,
        and a pod pinned to the old digest is."""
        fixed = "sha256:" + "cd" * 32
        old = "sha256:" + "ef" * 32
        record(probed_pod("u1", USABLE_MSG, 0, digest=fixed), replica(api, T1))
        stale = probed_pod("u2", UNUSABLE_MSG, 1, digest=old, pull_policy="IfNotPresent",
                           namespace="team-b")  # fmt: skip
        record(stale, replica(api, T2))
        assert set(api.verdicts) == {VERDICT, "sha256-" + "ef" * 32}
        store = VerdictStore()
        store.replace(v for o in api.verdicts.values() if (v := verdict_from_object(o)))
        later = T2 + dt.timedelta(minutes=1)
        by_tag = store.lookup(parse(IMAGE), later)
        assert by_tag is not None and by_tag.trust == "usable"
        by_old = store.lookup(parse(f"registry.example/sglang@{old}"), later)
        assert by_old is not None and by_old.trust == "deny"
        [said] = api.events_on("Pod", "pod-u2")
        assert f"learned for {old} only" in said.message and "IfNotPresent" in said.message

    def test_a_gated_workers_run_answers_for_the_tag_its_preflight_resolved(
        self, api: InMemoryApi
    ) -> None:
        """The usual gated flow: the preflight pulls with Always, its files-only pass
        teaches no verdict but tells the tag's bytes; the worker (IfNotPresent) then runs
        those same bytes, and its Usable answers for the tag, so the next pods are not
        gated again. A worker on a node with other bytes under the tag, or one probed
        after RESOLVED_FOR, answers for its digest alone."""
        clock = [T1]
        one = Recorder(api, clock=lambda: clock[0])  # one controller; a pod per ledger
        old = "sha256:" + "ef" * 32
        record(probed_pod("p1", CLEARED_MSG, 0), replica(api, recorder=one))
        assert api.verdicts == {} and api.verdict_writes == 0
        record_worker(api, one, "w1")
        assert set(api.verdicts) == {VERDICT} and api.spec()["image"] == IMAGE
        record_worker(api, one, "w2", old)
        assert set(api.verdicts) == {VERDICT, "sha256-" + "ef" * 32}
        clock[0] = T1 + RESOLVED_FOR + dt.timedelta(seconds=1)
        api.verdicts.clear()
        record_worker(api, one, "w3")
        assert set(api.verdicts) == {DIGEST.replace(":", "-")}

    def test_only_the_newest_recent_pull_in_the_workers_namespace_resolves_its_tag(
        self, api: InMemoryApi
    ) -> None:
        """Found by a review helper on 0fcb7b2: resolutions were dated when the controller
        saw them (a pod kept from before the tag moved resolved again at each restart),
        any digest a tag ever had within the hour counted, and one tenant's pulls
        counted for every namespace. Now: dated by the kubelet's startedAt, the newest
        per tag, in the worker's namespace only."""
        one = Recorder(api, clock=lambda: T1)
        old = "sha256:" + "ef" * 32
        digest_only = DIGEST.replace(":", "-")

        def worker(uid: str, digest: str = DIGEST, namespace: str = "ml") -> set[str]:
            api.verdicts.clear()
            record_worker(api, one, uid, digest, namespace)
            return set(api.verdicts)

        # A pod whose resolving container started two hours ago, seen now.
        kept = probed_pod("k1", CLEARED_MSG, 0, started=T1 - 2 * RESOLVED_FOR)
        record(kept, replica(api, recorder=one))
        assert worker("w1") == {digest_only}
        # The tag named the old bytes, then the new ones: only the newest counts.
        record(
            probed_pod("p1", CLEARED_MSG, 0, digest=old, started=NOW), replica(api, recorder=one)
        )
        record(probed_pod("p2", CLEARED_MSG, 0, started=NOW + dt.timedelta(minutes=5)),
               replica(api, recorder=one))  # fmt: skip
        assert worker("w2", old) == {"sha256-" + "ef" * 32}
        assert worker("w3") == {VERDICT}
        # Another namespace's pull says nothing about this namespace's workers.
        assert worker("w4", namespace="team-b") == {digest_only}
        # ... but a newer one that found other bytes cancels: the tag moved (found by a
        # review helper on fe48f13).
        newer = probed_pod("p3", CLEARED_MSG, 0, digest=old, namespace="team-b",
                           started=NOW + dt.timedelta(minutes=6))  # fmt: skip
        record(newer, replica(api, recorder=one))
        assert worker("w5") == {digest_only}

    def test_one_namespaces_flood_of_tags_never_evicts_anothers_resolution(
        self, api: InMemoryApi
    ) -> None:
        """The cluster-wide table of the newest pull per tag (10,000 entries) was evicted
        oldest first: a namespace that resolved 10,000 tags pushed out another's, whose
        workers then learned by digest only and were gated again (found by a review
        helper). Past the cap, the namespace holding the most gives one up."""
        from epguard.webhook.controller.recorder import MAX_RESOLVED_TAGS
        from epguard.webhook.engine.outcome import Resolution

        one = Recorder(api, clock=lambda: T1)
        mine = parse(IMAGE).name_tag
        one.note_resolved("ml", Resolution(mine, DIGEST, NOW))
        # Pulling the same public tag later does not make the entry the flood's to evict.
        one.note_resolved("flood", Resolution(mine, DIGEST, NOW + dt.timedelta(seconds=1)))
        for i in range(MAX_RESOLVED_TAGS + 50):
            tag = f"r.example/flood:{i}"
            one.note_resolved("flood", Resolution(tag, "sha256:" + "0" * 64, NOW))
        assert one.newest[mine] == (DIGEST, NOW + dt.timedelta(seconds=1))
        assert len(one.newest) == MAX_RESOLVED_TAGS
        api.verdicts.clear()
        record_worker(api, one, "w1")
        assert set(api.verdicts) == {VERDICT}  # learned for the tag, not the digest alone

    def test_a_pull_dated_ahead_of_the_controllers_clock_counts_as_now(
        self, api: InMemoryApi
    ) -> None:
        """A node whose clock runs fast cannot make its pull outlast RESOLVED_FOR."""
        clock = [T1]
        one = Recorder(api, clock=lambda: clock[0])
        ahead = probed_pod("p1", CLEARED_MSG, 0, started=T1 + dt.timedelta(hours=3))
        record(ahead, replica(api, recorder=one))
        clock[0] = T1 + RESOLVED_FOR + dt.timedelta(seconds=1)
        record_worker(api, one, "w1")
        assert set(api.verdicts) == {DIGEST.replace(":", "-")}

    def test_a_pod_whose_signature_fails_resolves_no_tag(self, api: InMemoryApi) -> None:
        one = Recorder(api, clock=lambda: T1)
        forged = probed_pod("p1", CLEARED_MSG, 0)
        forged["metadata"]["annotations"][SIGNATURE_ANNOTATION] = "v1:bogus"
        record(forged, replica(api, recorder=one))
        assert one.resolved == {}
        record_worker(api, one, "w1")
        assert set(api.verdicts) == {DIGEST.replace(":", "-")}

    def test_a_pod_that_is_no_evidence_is_checked_once_for_what_it_resolved(
        self, api: InMemoryApi
    ) -> None:
        """A signature naming a key not held makes the controller read the Secret again
        (another replica may have rotated). A tenant's pod with such a signature and a
        pull with Always would otherwise cost a read at each of its events."""

        class CountingKeys:
            def __init__(self) -> None:
                self.holder = KeyringHolder(keys().holder.ring)
                self.reads = 0

            def refresh(self) -> Keyring | None:
                self.reads += 1
                return self.holder.ring

        counting = CountingKeys()
        pod = probed_pod("p1", CLEARED_MSG, 0)
        fmt, _key, at, mac = pod["metadata"]["annotations"][SIGNATURE_ANNOTATION].split(":")
        pod["metadata"]["annotations"][SIGNATURE_ANNOTATION] = f"{fmt}:not-held:{at}:{mac}"
        one = Recorder(api, clock=lambda: T1)
        memo = replica(api, recorder=one, probe_keys=counting)  # kopf's memo of this pod
        for _ in range(5):  # a label changed, the status written again ...
            record(pod, memo)
        assert counting.reads == 1 and one.resolved == {}


# --- once per run --------------------------------------------------------------------


class TestOncePerRun:
    def test_a_pods_memory_keeps_every_run_it_still_shows(self) -> None:
        """Found by a review helper on fe48f13: 256 runs a pod, the oldest dropped past
        that, let a pod of 300 probe containers have its old runs come back as new at
        each event its owner causes (a relabel), each a write that renews an old
        verdict. Now nothing it still shows is forgotten, and what it no longer shows
        is."""
        memo = kopf.Memo()
        shown = {f"u1/epguard-probe-{i}/0/{FINISHED}" for i in range(300)}
        remembered(memo, shown).update(shown)
        for _ in range(3):
            assert remembered(memo, shown) == shown
        assert remembered(memo, set(list(shown)[:5])) == set(list(shown)[:5])

    def test_a_redelivered_pod_event_makes_no_api_call(self, api: InMemoryApi) -> None:
        memo = replica(api)
        pod = probed_pod("u1", UNUSABLE_MSG, 1, owners=deployment_chain(api))
        record(pod, memo)
        calls = list(api.calls)
        assert calls  # the first delivery did read and write
        record(pod, memo)
        record(copy.deepcopy(pod), memo)
        assert api.calls == calls

    def test_a_restarted_controller_does_not_count_a_recorded_run_again(
        self, api: InMemoryApi
    ) -> None:
        pod = probed_pod("u1", UNUSABLE_MSG, 1, owners=deployment_chain(api))
        record(pod, replica(api, T1))
        before = copy.deepcopy(api.verdicts)
        events = dict(api.events)
        # A new process: nothing in memory; the verdict's spec.runs remembers the run.
        record(pod, replica(api, T2))
        assert api.verdicts == before  # same count, same resourceVersion: not written
        assert api.verdict_writes == 1
        assert api.called("read_verdict") == [VERDICT, VERDICT]
        assert api.events == events  # posted again under the same names: still one each
        assert api.event_posts == 4


# --- two replicas --------------------------------------------------------------------


class TestRaces:
    def test_a_create_that_loses_the_race_is_re_read_and_counted(self, api: InMemoryApi) -> None:
        mine, other = replica(api, T2), replica(api, T1)
        api.before_next_write = lambda: record(probed_pod("u2", USABLE_MSG, 0), other)
        record(probed_pod("u1", UNUSABLE_MSG, 1, finished=LATER), mine)
        # The other replica's create landed between my read (nothing) and my create.
        assert api.called("create_verdict") == [VERDICT, VERDICT]  # mine, then the other's
        assert api.called("replace_verdict") == [VERDICT]  # mine, after the 409 and re-read
        spec = api.spec()
        assert spec["count"] == 2
        assert spec["runs"] == [run_of("u2"), run_of("u1", LATER)]
        assert (spec["firstSeen"], spec["lastSeen"]) == (FINISHED, LATER)
        assert (spec["verdict"], spec["pod"]) == ("Unusable", "ml/pod-u1")

    def test_a_replace_at_a_stale_resource_version_is_re_read_and_counted(
        self, api: InMemoryApi
    ) -> None:
        record(probed_pod("u0", USABLE_MSG, 0), replica(api, NOW))
        mine, other = replica(api, T2), replica(api, T1)
        api.before_next_write = lambda: record(probed_pod("u2", USABLE_MSG, 0), other)
        record(probed_pod("u1", UNUSABLE_MSG, 1), mine)
        assert api.called("replace_verdict") == [VERDICT, VERDICT, VERDICT]
        spec = api.spec()
        assert spec["count"] == 3
        assert spec["runs"] == [run_of("u0"), run_of("u2"), run_of("u1")]
        assert spec["firstSeen"] == stamp(NOW)

    def test_two_replicas_recording_the_same_run_count_it_once(self, api: InMemoryApi) -> None:
        pod = probed_pod("u1", UNUSABLE_MSG, 1, owners=deployment_chain(api))
        mine, other = replica(api, T2), replica(api, T1)
        api.before_next_write = lambda: record(pod, other)
        record(pod, mine)
        assert api.verdict_writes == 1
        spec = api.spec()
        assert (spec["count"], spec["runs"], spec["lastSeen"]) == (1, [run_of("u1")], FINISHED)
        assert len(api.events_on("Pod", "pod-u1")) == 1
        assert len(api.events_on("Deployment", "w")) == 1

    def test_conflicts_on_every_attempt_end_in_a_retry_that_loses_nothing(
        self, api: InMemoryApi
    ) -> None:
        record(probed_pod("u0", USABLE_MSG, 0), replica(api, T1))

        def busy() -> None:  # someone writes the verdict before each of mine
            api.touch(VERDICT)
            api.before_next_write = busy

        api.before_next_write = busy
        memo = replica(api, T2)
        pod = probed_pod("u1", UNUSABLE_MSG, 1)
        with pytest.raises(kopf.TemporaryError, match="too many write conflicts"):
            record(pod, memo)
        assert len(api.called("replace_verdict")) == WRITE_ATTEMPTS
        # Read again at random times, longer each time (not in step with the other writer).
        waits = memo["recorder"].waits
        assert len(waits) == WRITE_ATTEMPTS - 1
        assert all(0 <= w <= CONFLICT_BACKOFF * 2 ** (i + 1) for i, w in enumerate(waits))
        assert api.spec()["count"] == 1  # nothing counted
        assert not api.events_on("Pod", "pod-u1")  # nor told, until it is
        # kopf drops an on.event handler's error; the run was not marked done, so the
        # pod's next event counts it.
        api.before_next_write = None
        record(pod, memo)
        assert api.spec()["count"] == 2 and api.spec()["runs"] == [run_of("u0"), run_of("u1")]
        assert len(api.events_on("Pod", "pod-u1")) == 1


# --- what is not evidence ------------------------------------------------------------


def _unsigned(pod: dict[str, Any]) -> None:
    del pod["metadata"]["annotations"][SIGNATURE_ANNOTATION]


def _forged(pod: dict[str, Any]) -> None:
    probe = next(c for c in pod["spec"]["initContainers"] if c["name"] == "epguard-probe")
    probe["env"] = [{"name": "PYTHONPATH", "value": "/tmp/mine"}]


def _signed_for_another_pod(pod: dict[str, Any]) -> None:
    created = NOW + dt.timedelta(seconds=FRESH_SECONDS + 60)
    pod["metadata"]["creationTimestamp"] = stamp(created)


class TestUntrusted:
    @pytest.mark.parametrize(
        ("change", "why"),
        [
            (_unsigned, f"carry no {SIGNATURE_ANNOTATION} annotation"),
            (_forged, "differ from what epguard signed"),
            (_signed_for_another_pod, "was made for another pod"),
        ],
        ids=["unsigned", "forged", "stale-signature"],
    )
    def test_a_pod_whose_probe_epguard_did_not_sign_teaches_nothing(
        self, api: InMemoryApi, change: Callable[[dict[str, Any]], None], why: str
    ) -> None:
        pod = probed_pod("u1", UNUSABLE_MSG, 1, owners=deployment_chain(api))
        change(pod)
        memo = replica(api)
        record(pod, memo)
        assert not api.verdicts and not api.called("read_verdict")
        assert not api.called("read_object")  # no owner walk: told on the pod only
        [event] = api.events.values()
        assert (event.kind, event.name, event.uid) == ("Pod", "pod-u1", "u1")
        assert (event.reason, event.warning) == ("EpguardProbeNotTrusted", True)
        assert why in event.message and "learns nothing from this pod's probe" in event.message
        posts = api.event_posts
        record(pod, memo)  # re-delivered: told once
        assert api.event_posts == posts

    def test_a_controller_without_the_signing_key_learns_nothing(self, api: InMemoryApi) -> None:
        record(probed_pod("u1", USABLE_MSG, 0), replica(api, with_keys=False))
        assert not api.verdicts
        [event] = api.events.values()
        assert event.reason == "EpguardProbeNotTrusted"
        assert "holds no probe-signing key" in event.message

    def test_a_signature_replayed_into_another_pod_teaches_nothing(self, api: InMemoryApi) -> None:
        memo = replica(api)
        original = probed_pod("u1", UNUSABLE_MSG, 1)
        record(original, memo)
        replay = copy.deepcopy(original)
        replay["metadata"].update(uid="u2", name="replay")
        record(replay, memo)
        assert api.spec()["count"] == 1 and api.spec()["runs"] == [run_of("u1")]
        [event] = api.events_on("Pod", "replay")
        assert event.reason == "EpguardProbeNotTrusted"
        assert "used by pod uid u1 first" in event.message

    @pytest.mark.parametrize("probe_image", ["epguard:other", "epguard:1"])
    def test_a_pod_whose_probe_was_not_copied_from_the_probe_image_is_ignored(
        self, api: InMemoryApi, probe_image: str
    ) -> None:
        # The signed pod's copy container runs epguard:1.
        memo = replica(api, config=replace(config(), probe_image=probe_image))
        record(probed_pod("u1", UNUSABLE_MSG, 1), memo)
        if probe_image == "epguard:1":
            assert api.spec()["count"] == 1
        else:
            assert api.calls == []


class TestNoEvidence:
    @pytest.mark.parametrize(
        ("exit_code", "message"),
        [
            (2, UNUSABLE_MSG),  # a usage error
            (137, UNUSABLE_MSG),  # OOM-killed
            (143, USABLE_MSG),  # SIGTERM
            (0, UNUSABLE_MSG),  # exit code and message disagree
            (1, USABLE_MSG),
        ],
    )
    def test_an_exit_code_that_is_no_evidence_records_nothing(
        self, api: InMemoryApi, exit_code: int, message: str
    ) -> None:
        pod = probed_pod("u1", message, exit_code, owners=deployment_chain(api))
        record(pod, replica(api))
        assert api.calls == []

    @pytest.mark.parametrize(
        ("message", "digest", "reason"),
        [
            (IN_POD_MSG, DIGEST, "MooncakeProbeFailedInPod"),
            (SAYS_ENVIRONMENT_MSG, DIGEST, "MooncakeProbeFailedInPod"),
            (UNUSABLE_MSG, None, "MooncakeProbeFailed"),  # no digest to pin it to
        ],
        ids=["in-this-pod", "scope-environment", "no-digest"],
    )
    def test_a_failure_that_is_not_about_the_image_is_told_but_not_learned(
        self, api: InMemoryApi, message: str, digest: str | None, reason: str
    ) -> None:
        pod = probed_pod("u1", message, 1, owners=deployment_chain(api), digest=digest)
        record(pod, replica(api))
        assert not api.verdicts and not api.called("read_verdict")
        assert not api.called("create_verdict") and not api.called("replace_verdict")
        for kind, name in (("Pod", "pod-u1"), ("Deployment", "w")):
            [event] = api.events_on(kind, name)
            assert (event.reason, event.warning) == (reason, True)
            assert event.message.endswith(message.splitlines()[0])


# --- where people look ---------------------------------------------------------------


class TestOwners:
    def test_the_outcome_is_told_on_the_pod_and_its_deployment(self, api: InMemoryApi) -> None:
        record(probed_pod("u1", UNUSABLE_MSG, 1, owners=deployment_chain(api)), replica(api))
        assert api.called("read_object") == [RS_PATH, DEPLOYMENT_PATH]
        assert {(e.kind, e.name) for e in api.events.values()} == {
            ("Pod", "pod-u1"),
            ("Deployment", "w"),
        }
        [event] = api.events_on("Deployment", "w")
        assert (event.api_version, event.namespace, event.uid) == ("apps/v1", "ml", "uid-w")
        assert (event.reason, event.warning) == ("MooncakeProbeFailed", True)
        assert event.message == api.events_on("Pod", "pod-u1")[0].message

    def test_only_the_controller_owner_is_followed(self, api: InMemoryApi) -> None:
        chain = deployment_chain(api)
        not_controller = owner_ref("v1", "ConfigMap", "cfg", controller=False)
        record(probed_pod("u1", USABLE_MSG, 0, owners=[not_controller, *chain]), replica(api))
        assert api.called("read_object") == [RS_PATH, DEPLOYMENT_PATH]
        assert not api.events_on("ConfigMap", "cfg")
        assert len(api.events_on("Deployment", "w")) == 1

    def test_an_owner_whose_kind_rbac_does_not_cover_is_still_named(self, api: InMemoryApi) -> None:
        # Pod → StatefulSet → LeaderWorkerSet, with the LeaderWorkerSet's read refused.
        lws = owner_ref("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "lws")
        sts_path = "/apis/apps/v1/namespaces/ml/statefulsets/lws-0"
        lws_path = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ml/leaderworkersets/lws"
        api.objects[sts_path] = {"metadata": {"name": "lws-0", "ownerReferences": [lws]}}
        api.refused.add(lws_path)
        sts = owner_ref("apps/v1", "StatefulSet", "lws-0")
        record(probed_pod("u1", UNUSABLE_MSG, 1, owners=[sts]), replica(api))
        assert api.called("read_object") == [sts_path, lws_path]
        [event] = api.events_on("LeaderWorkerSet", "lws")
        assert event.uid == "uid-lws" and event.api_version == "leaderworkerset.x-k8s.io/v1"
        assert not api.events_on("StatefulSet", "lws-0")

    def test_a_gone_owner_ends_the_walk_at_itself(self, api: InMemoryApi) -> None:
        record(probed_pod("u1", UNUSABLE_MSG, 1, owners=[RS]), replica(api))  # RS not in API
        assert api.called("read_object") == [RS_PATH]
        assert len(api.events_on("ReplicaSet", "w-7d9f")) == 1
        assert len(api.events) == 2

    def test_an_owner_cycle_ends(self, api: InMemoryApi) -> None:
        api.objects[RS_PATH] = {"metadata": {"name": "w-7d9f", "ownerReferences": [RS]}}
        record(probed_pod("u1", UNUSABLE_MSG, 1, owners=[RS]), replica(api))
        assert len(api.called("read_object")) == owners.MAX_OWNER_DEPTH
        assert len(api.events_on("ReplicaSet", "w-7d9f")) == 1

    @pytest.mark.parametrize(
        ("api_version", "kind", "name"),
        [
            ("v1", "X", "../../../pods"),  # GET /api/v1/pods: every pod in the cluster
            ("apps/v1", "ReplicaSet", "../pods?watch=true&limit=0"),
            ("apps/v1", "ReplicaSet", "w%2F..%2F..%2Fsecrets"),
            ("apps/v1/../../api/v1", "ReplicaSet", "w"),
            ("apps/v1", "Replica/Set", "w"),
            ("apps/v1", "ReplicaSet", "W" * 254),
        ],
    )
    def test_an_owner_reference_that_is_no_object_name_is_neither_read_nor_named(
        self, api: InMemoryApi, api_version: str, kind: str, name: str
    ) -> None:
        """An ownerReference is the tenant's to write, and the API server checks only that
        its fields are not empty: read as a path with the controller's rights, a name of
        ``../../../pods`` listed every pod in the cluster (one 1.5 MiB pod parses to ~12
        MB: enough of them crash-looped the controller for every tenant)."""
        record(probed_pod("u1", UNUSABLE_MSG, 1, owners=[owner_ref(api_version, kind, name)]),
               replica(api))  # fmt: skip
        assert not api.called("read_object")
        assert [(e.kind, e.name) for e in api.events.values()] == [("Pod", "pod-u1")]
        assert api.spec()["verdict"] == "Unusable"  # the verdict is still learned

    def test_an_owner_of_a_kind_it_may_not_get_is_named_but_not_read(
        self, api: InMemoryApi
    ) -> None:
        secret_owner = owner_ref("v1", "Secret", "db-password")
        record(probed_pod("u1", UNUSABLE_MSG, 1, owners=[secret_owner]), replica(api))
        assert not api.called("read_object")
        assert len(api.events_on("Secret", "db-password")) == 1

    def test_a_pod_without_an_owner_is_told_on_itself_alone(self, api: InMemoryApi) -> None:
        record(probed_pod("u1", UNUSABLE_MSG, 1), replica(api))
        assert not api.called("read_object")
        assert [(e.kind, e.name) for e in api.events.values()] == [("Pod", "pod-u1")]


# --- the production side of the seam -------------------------------------------------


class _Custom:
    """CustomObjectsApi's two writes, answering with a given status."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.calls: list[tuple[Any, ...]] = []

    def _answer(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((*args, kwargs))
        if self.status != 201:
            raise ApiException(status=self.status, reason=f"status {self.status}")

    create_cluster_custom_object = _answer
    replace_cluster_custom_object = _answer


@pytest.mark.parametrize("status", [409, 500, 201])
def test_the_kube_api_turns_a_409_and_only_a_409_into_a_conflict(status: int) -> None:
    kube = KubeRecorderApi(client.ApiClient())
    custom = _Custom(status)
    kube.custom = custom  # type: ignore[assignment]
    body: ImageVerdictObject = {
        "apiVersion": "epguard.io/v1alpha1",
        "kind": "ImageVerdict",
        "metadata": {"name": VERDICT, "resourceVersion": "7"},
        "spec": {},  # type: ignore[typeddict-item]
    }
    expected: type[Exception] | None = {409: Conflict, 500: ApiException}.get(status)
    for write in (kube.create_verdict, lambda b: kube.replace_verdict(VERDICT, b)):
        if expected is None:
            write(body)
        else:
            with pytest.raises(expected) as raised:
                write(body)
            assert type(raised.value) is expected
    create, replace_call = custom.calls
    assert create[:4] == ("epguard.io", "v1alpha1", "imageverdicts", dict(body))
    assert replace_call[:5] == ("epguard.io", "v1alpha1", "imageverdicts", VERDICT, dict(body))
    assert create[-1] == replace_call[-1] == {"_request_timeout": (5.0, 30.0)}


def test_the_kube_api_reports_a_refused_owner_read_as_unreadable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(api: client.ApiClient, path: str) -> dict[str, Any]:
        raise ApiException(status=403, reason="Forbidden")

    monkeypatch.setattr(owners, "get_object", refuse)
    with pytest.raises(Unreadable) as raised:
        KubeRecorderApi(client.ApiClient()).read_object(RS_PATH)
    assert raised.value.reason == "Forbidden"


def test_the_kube_api_posts_events_as_the_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[tuple[Any, ...]] = []

    def post(*args: Any, **kwargs: Any) -> bool:
        posted.append((*args, kwargs))
        return True

    monkeypatch.setattr(owners, "post_event", post)
    api = client.ApiClient()
    about = client.V1ObjectReference(kind="Pod", name="p", namespace="ml")
    assert KubeRecorderApi(api).post_event(about, "R", "m", warning=True, key="k")
    assert posted == [
        (api, about, "R", "m", {"warning": True, "component": "epguard-controller", "key": "k"})
    ]


def test_the_recorders_filter_sees_the_probe_through_kopfs_own_body() -> None:
    # kopf hands the filter a Body (a Mapping view, not a dict): a filter that read it
    # as a dict would see no probe and record nothing.
    pod = probed_pod("p-1", "epguard: mooncake elastic EP is unusable in this image: x", 1)
    assert has_probe(body=kopf.Body(pod))
    plain = copy.deepcopy(pod)
    plain["spec"]["initContainers"] = [{"name": "download", "image": "busybox"}]
    assert not has_probe(body=kopf.Body(plain))
    assert not has_probe(body=kopf.Body({}))
    assert not has_probe(body=None)


class TestNamespaceShare:
    """No namespace's probes fill the webhook's store of verdicts (MAX_VERDICTS) so that
    everyone else's go unheard: each teaches at most its share of new images."""

    @staticmethod
    def pod(i: int, message: str, code: int, namespace: str = "ml") -> dict[str, Any]:
        """A probe of its own (signed at its own second) on digest ``i``."""
        at = NOW + dt.timedelta(seconds=i + 10 * code + (50 if namespace != "ml" else 0))
        digest = "sha256:" + f"{i:02x}" * 32
        return probed_pod(f"{namespace}-{i}-{code}", message, code, digest=digest,
                          namespace=namespace, signed_at=at)  # fmt: skip

    def share(self, api: InMemoryApi, per_namespace: int, clock: list[float]) -> kopf.Memo:
        recorder = Recorder(
            api, clock=lambda: T1, per_namespace=per_namespace, monotonic=lambda: clock[0]
        )
        return replica(api, recorder=recorder)

    def test_past_its_share_a_namespace_teaches_no_new_image_and_is_told(
        self, api: InMemoryApi
    ) -> None:
        memo = self.share(api, 2, [0.0])
        for i in range(3):
            record(self.pod(i, UNUSABLE_MSG, 1), memo)
        assert sorted(api.verdicts) == [named(i) for i in range(2)]
        spent = [e for e in api.events.values() if e.reason == "EpguardVerdictBudgetSpent"]
        assert [(e.kind, e.name) for e in spent] == [("Pod", "pod-ml-2-1")]
        assert "its probes have taught 2 ImageVerdicts" in spent[0].message
        assert "controller.verdictsPerNamespace 2" in spent[0].message
        # The probe's own outcome is still told on the pod.
        told = [(e.reason, e.name) for e in api.events.values()]
        assert ("MooncakeProbeFailed", "pod-ml-2-1") in told

        # Another namespace still teaches that image; this one still updates what exists.
        record(self.pod(2, UNUSABLE_MSG, 1, "team-b"), memo)
        taught = api.verdicts[named(2)]["metadata"]["labels"][TAUGHT_BY_LABEL]
        assert taught == "team-b"
        record(self.pod(0, USABLE_MSG, 0), memo)
        assert api.verdicts[named(0)]["spec"]["count"] == 2
        # An update by another namespace keeps who taught it.
        record(self.pod(0, USABLE_MSG, 0, "team-b"), memo)
        labels = api.verdicts[named(0)]["metadata"]["labels"]
        assert labels[TAUGHT_BY_LABEL] == "ml"

    def test_the_share_is_counted_from_the_api_and_counted_again_later(
        self, api: InMemoryApi
    ) -> None:
        clock = [0.0]
        memo = self.share(api, 1, clock)
        record(self.pod(0, UNUSABLE_MSG, 1), memo)
        record(self.pod(1, UNUSABLE_MSG, 1), memo)
        assert list(api.verdicts) == [named(0)]
        # A new process (a failover) reads the count; an admin deletes the old verdict:
        # the share is free again once the count is read anew.
        fresh = self.share(api, 1, clock)
        record(self.pod(2, UNUSABLE_MSG, 1), fresh)
        assert len(api.verdicts) == 1
        del api.verdicts[named(0)]
        record(self.pod(3, UNUSABLE_MSG, 1), fresh)
        assert len(api.verdicts) == 0
        clock[0] = RECOUNT_SECONDS + 1
        record(self.pod(4, UNUSABLE_MSG, 1), fresh)
        assert list(api.verdicts) == [named(4)]


def record_at_once(pods: list[dict[str, Any]], memo: dict[str, Any]) -> None:
    """Record ``pods`` on a thread each, as kopf runs handlers side by side."""
    import threading

    threads = [threading.Thread(target=record, args=(p, memo)) for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class TestNamespaceShareUnderThreads:
    def test_probes_recorded_at_once_never_pass_the_share(self, api: InMemoryApi) -> None:
        # kopf runs handlers on several threads: each create takes its slot first.
        import time as time_mod

        create = api.create_verdict

        def slow_create(body: ImageVerdictObject) -> None:
            time_mod.sleep(0.02)  # the API server's round trip, where a race would be
            create(body)

        api.create_verdict = slow_create  # type: ignore[method-assign]
        memo = TestNamespaceShare().share(api, 5, [0.0])
        record_at_once([TestNamespaceShare.pod(i, UNUSABLE_MSG, 1) for i in range(20)], memo)
        assert len(api.verdicts) == 5
        assert memo["recorder"].taught["ml"][0] == 5


def test_one_namespaces_recount_does_not_hold_up_anothers_verdict(api: InMemoryApi) -> None:
    """Review helper: the count of a namespace's verdicts (a paged list, up to 1,000 of
    them) ran under the lock every namespace's first verdict takes; here that list waits
    until the other namespace's verdict is written, which it could not be before."""
    import threading

    counting, release = threading.Event(), threading.Event()
    count = api.count_taught

    def slow_count(namespace: str, up_to: int) -> int:
        if namespace == "ml":
            counting.set()
            release.wait(30)
        return count(namespace, up_to)

    api.count_taught = slow_count  # type: ignore[method-assign]
    memo = TestNamespaceShare().share(api, 5, [0.0])
    slow = threading.Thread(target=record, args=(TestNamespaceShare.pod(0, UNUSABLE_MSG, 1), memo))
    other = threading.Thread(
        target=record, args=(TestNamespaceShare.pod(1, UNUSABLE_MSG, 1, "team-b"), memo)
    )
    slow.start()
    try:
        assert counting.wait(10)
        other.start()
        other.join(10)
        assert not other.is_alive(), "team-b's verdict waited for ml's count"
        assert named(1) in api.verdicts and named(0) not in api.verdicts
    finally:
        release.set()
        slow.join()
        if other.is_alive() or other.ident is not None:
            other.join()
    assert named(0) in api.verdicts
    assert memo["recorder"].taught["ml"][0] == 1


def test_threads_that_count_at_once_never_pass_the_share(api: InMemoryApi) -> None:
    """Review helper: two threads that both found the count stale both counted, and the
    later count replaced a reservation the first had made meanwhile: one verdict over
    the share per thread. One count per namespace at a time; the others use it."""
    import time as time_mod

    count = api.count_taught

    def slow_count(namespace: str, up_to: int) -> int:
        time_mod.sleep(0.02)  # the API server's paged list
        return count(namespace, up_to)

    api.count_taught = slow_count  # type: ignore[method-assign]
    memo = TestNamespaceShare().share(api, 3, [0.0])
    record_at_once([TestNamespaceShare.pod(i, UNUSABLE_MSG, 1) for i in range(12)], memo)
    assert len(api.verdicts) == 3
    assert api.called("count_taught") == ["ml"]


def test_kopf_lists_only_probed_pods_and_in_small_pages() -> None:
    # kopf's default lists every watched object in one request: 100 workers of 1.5 MiB
    # would be parsed at once at each start.
    from epguard.webhook.controller.recorder import LIST_CHUNK, watch_probed_pods_only

    settings = kopf.OperatorSettings()  # kopf's own default is not ours to assert
    watch_probed_pods_only(settings)
    assert settings.watching.chunk_size == LIST_CHUNK <= 4
    assert settings.watching.label_selectors["v1", "pods"] == "epguard.io/probed=true"
