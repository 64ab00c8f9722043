"""The chart's `epguard-probe-status` policy: how epguard's containers ran is the node's to
say. The controller learns verdicts for every namespace from a signed pod's
`epguard-probe` status; anyone granted pods/status (a namespace owner's `pods/*`) could
otherwise write an image cause and a popular image's digest there (found by a review
helper). Evaluated here with cel-python; on the real API server in
tests/e2e/test_probe_parts_on_node.py."""

from __future__ import annotations

import copy
from typing import Any

from tests.chart.chartlib import Rendered, vap_refusal

Obj = dict[str, Any]
POLICY = "epguard-probe-status"
NODE = "system:node:gpu-1"
DIGEST = "docker.io/lmsysorg/sglang@sha256:" + "a" * 64


def _pod(node: str | None = "gpu-1") -> Obj:
    spec: Obj = {
        "initContainers": [
            {"name": "epguard-copy-probe", "image": "e:1"},
            {"name": "epguard-probe", "image": "w:1"},
        ],
        "containers": [{"name": "w", "image": "w:1"}],
    }
    if node is not None:
        spec["nodeName"] = node
    status = {
        "phase": "Pending",
        "initContainerStatuses": [
            {"name": "epguard-copy-probe", "state": {"terminated": {"exitCode": 0}}},
            {"name": "epguard-probe", "state": {"running": {}}, "imageID": ""},
        ],
    }
    return {"metadata": {"name": "p", "namespace": "t"}, "spec": spec, "status": status}


def _forged(pod: Obj) -> Obj:
    new = copy.deepcopy(pod)
    probe = new["status"]["initContainerStatuses"][1]
    probe["state"] = {"terminated": {"exitCode": 1, "message": "epguard: unusable in this image"}}
    probe["imageID"] = DIGEST
    return new


def _refusal(r: Rendered, user: str, new: Obj, old: Obj) -> str | None:
    spec = r.one("ValidatingAdmissionPolicy", POLICY)["spec"]
    request = {"operation": "UPDATE", "userInfo": {"username": user}, "namespace": "t",
               "name": "p", "subResource": "status"}  # fmt: skip
    return vap_refusal(spec, request, new, old)


def test_only_the_pods_node_reports_how_its_epguard_containers_ran(defaults: Rendered) -> None:
    old = _pod()
    refused = "only the node the pod runs on reports how they ran"
    for user in ("alice", "system:serviceaccount:t:owner", "system:node:gpu-2"):
        assert refused in str(_refusal(defaults, user, _forged(old), old)), user
    # A probe status added where there was none, or one taken away, is a change too.
    bare = copy.deepcopy(old)
    del bare["status"]["initContainerStatuses"]
    assert refused in str(_refusal(defaults, "alice", old, bare))
    assert refused in str(_refusal(defaults, "alice", bare, old))
    # An unscheduled pod has no node to say anything.
    unscheduled = _pod(node=None)
    assert refused in str(_refusal(defaults, "alice", _forged(unscheduled), unscheduled))


def test_the_rest_of_a_pods_status_stays_writable(defaults: Rendered) -> None:
    old = _pod()
    assert _refusal(defaults, NODE, _forged(old), old) is None  # the kubelet itself
    cond = copy.deepcopy(old)
    cond["status"]["conditions"] = [{"type": "epguard.io/Preflight", "status": "False"}]
    assert _refusal(defaults, "system:serviceaccount:epguard-system:c", cond, old) is None
    worker = copy.deepcopy(old)
    worker["status"]["containerStatuses"] = [{"name": "w", "ready": True}]
    assert _refusal(defaults, "alice", worker, old) is None
    # A pod without epguard containers is not evaluated at all.
    plain = copy.deepcopy(old)
    plain["spec"]["initContainers"] = []
    assert _refusal(defaults, "alice", _forged(old) | {"spec": plain["spec"]}, plain) is None


def test_a_listed_status_writer_reports_as_a_node_does() -> None:
    """Review helper: a virtual kubelet writes pod status under a ServiceAccount, and the
    policy refused its first write (the pod never Running). injection.statusWriters
    lists such agents; the NOTES warn that they can write a verdict."""
    from tests.chart.chartlib import notes, render

    writers = '{"users":["system:serviceaccount:liqo:vk"],"groups":["virtual-nodes"]}'
    r = render("--set-json", f"injection.statusWriters={writers}")
    old = _pod(node="liqo-remote")
    assert _refusal(r, "system:serviceaccount:liqo:vk", _forged(old), old) is None
    spec = r.one("ValidatingAdmissionPolicy", POLICY)["spec"]
    request = {"operation": "UPDATE", "namespace": "t", "name": "p", "subResource": "status",
               "userInfo": {"username": "agent", "groups": ["virtual-nodes"]}}  # fmt: skip
    from tests.chart.chartlib import vap_refusal

    assert vap_refusal(spec, request, _forged(old), old) is None
    assert "only the node" in str(_refusal(r, "alice", _forged(old), old))
    warned = notes("--set-json", f"injection.statusWriters={writers}").split("\n\n", 1)[0]
    assert "injection.statusWriters lists system:serviceaccount:liqo:vk, virtual-nodes" in warned
    assert "injection.statusWriters" not in notes()


def test_a_status_writers_list_set_to_null_renders_valid_cel() -> None:
    """Review helper: `--set injection.statusWriters.users=null` dropped the key, and
    `in null` is no valid CEL: under failurePolicy Fail every status write of a pod with
    epguard's containers would have failed."""
    from tests.chart.chartlib import notes, render

    r = render("--set", "injection.statusWriters.users=null",
               "--set", "injection.statusWriters.groups=null")  # fmt: skip
    old = _pod()
    assert "only the node" in str(_refusal(r, "alice", _forged(old), old))
    assert _refusal(r, NODE, _forged(old), old) is None
    assert "injection.statusWriters" not in notes(
        "--set", "injection.statusWriters.users=null"
    )
