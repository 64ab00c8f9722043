"""The watches against a real kube-apiserver (devcluster): live rules from the
ConfigMap, the namespace mode label, and learned ImageVerdicts -- all reaching the
admission decision without any API call in the admission path."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.factory import container, pod, review
from tests.servers import RunningServer, running_server

pytestmark = pytest.mark.e2e

IMAGE = "registry.example.com/ml/sglang:v0.5.18-custom"
CM_RULES = """rules:
  - id: from-configmap
    image: "registry.example.com/ml/sglang:*"
    reason: "live rule"
    remedy: "edit the ConfigMap"
"""
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "imageverdicts.epguard.io"},
    "spec": {
        "group": "epguard.io",
        "scope": "Cluster",
        "names": {"kind": "ImageVerdict", "plural": "imageverdicts", "singular": "imageverdict"},
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                        },
                    }
                },
            }
        ],
    },
}


@pytest.fixture(scope="module")
def control_plane() -> Iterator[Any]:
    from tests.control_plane import running_control_plane

    with running_control_plane() as cp:
        yield cp


@pytest.fixture(scope="module")
def watched(
    control_plane: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    kubectl = control_plane.kubectl
    kubectl("create", "namespace", "epguard-system", check=True)
    kubectl("create", "namespace", "ml", check=True)
    kubectl("apply", "-f", "-", input=json.dumps(CRD), check=True)
    kubectl("wait", "--for=condition=Established", "crd/imageverdicts.epguard.io", check=True)
    with running_server(
        tmp_path_factory.mktemp("watched"),
        "rules: []\n",
        watch="auto",
        kubeconfig=str(control_plane.kubeconfig),
    ) as s:
        yield s


def eventually(check: Callable[[], bool], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "the watch never delivered the change"
        time.sleep(0.1)


def answer(server: RunningServer) -> dict[str, Any]:
    with server.client() as c:
        r = c.post("/validate", json=review(pod([container(image=IMAGE)]), namespace="ml"))
    response: dict[str, Any] = r.json()["response"]
    return response


def apply_rules(control_plane: Any, text: str) -> None:
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "epguard-rules", "namespace": "epguard-system"},
        "data": {"rules.yaml": text},
    }
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(cm), check=True)


def test_configmap_edits_apply_live_and_a_bad_edit_keeps_the_last_good_rules(
    control_plane: Any, watched: RunningServer
) -> None:
    assert answer(watched)["allowed"] is True
    apply_rules(control_plane, CM_RULES)
    eventually(lambda: answer(watched)["allowed"] is False)
    assert "[epguard rule from-configmap]" in answer(watched)["status"]["message"]
    apply_rules(control_plane, CM_RULES.replace("remedy:", "remedyy:"))
    eventually(lambda: watched.runtime.rules_sync.last_error is not None)
    assert answer(watched)["allowed"] is False  # still the last good rules
    with watched.client() as c:
        assert "remedyy" in c.get("/readyz").json()["last_rules_error"]
    control_plane.kubectl(
        "delete", "configmap", "-n", "epguard-system", "epguard-rules", check=True
    )
    eventually(lambda: answer(watched)["allowed"] is True)


def test_namespace_mode_label_applies_live(control_plane: Any, watched: RunningServer) -> None:
    apply_rules(control_plane, CM_RULES)
    eventually(lambda: answer(watched)["allowed"] is False)
    control_plane.kubectl("label", "namespace", "ml", "epguard.io/mode=warn", check=True)
    eventually(lambda: answer(watched)["allowed"] is True)
    assert "epguard (warn mode) would deny" in answer(watched)["warnings"][0]
    control_plane.kubectl("label", "namespace", "ml", "epguard.io/mode-", check=True)
    eventually(lambda: answer(watched)["allowed"] is False)
    control_plane.kubectl(
        "delete", "configmap", "-n", "epguard-system", "epguard-rules", check=True
    )
    eventually(lambda: answer(watched)["allowed"] is True)


def test_learned_verdicts_refuse_and_deleting_them_clears_it(
    control_plane: Any, watched: RunningServer
) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    iv = {
        "apiVersion": "epguard.io/v1alpha1",
        "kind": "ImageVerdict",
        "metadata": {"name": "iv-e2e"},
        "spec": {
            "image": IMAGE,
            "digest": "",
            "verdict": "Unusable",
            "reason": "ImportError: libcudart.so.12: cannot open shared object file",
            "lastSeen": now,
            "pod": "ml/worker-0",
            "count": 1,
        },
    }
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(iv), check=True)
    eventually(lambda: answer(watched)["allowed"] is False)
    message = answer(watched)["status"]["message"]
    assert "libcudart.so.12" in message and "seen failing in pod ml/worker-0" in message
    control_plane.kubectl("delete", "imageverdict", "iv-e2e", check=True)
    eventually(lambda: answer(watched)["allowed"] is True)


def test_watch_state_is_reported_in_readyz_and_metrics(watched: RunningServer) -> None:
    with watched.client() as c:
        assert c.get("/readyz").json()["watching"] is True
        text = c.get("/metrics").text
    for resource in ("configmap", "namespace", "imageverdict"):
        assert f'epguard_watch_up{{resource="{resource}"}} 1.0' in text


def test_the_backstops_wake_up_follows_verdict_changes_without_listing_them(
    control_plane: Any, watched: RunningServer
) -> None:
    """controller/backstop.py's ChangeSync on cluster/watch.py's changes_source: the
    writer is woken by a created and by a deleted ImageVerdict within seconds, and its
    listing hands over no verdict (one object read, for the snapshot's version)."""
    import asyncio

    from kubernetes import client, config

    from epguard.webhook.cluster.watch import changes_source, run_watch
    from epguard.webhook.controller.backstop import ChangeSync
    from epguard.webhook.engine.verdicts import GROUP, PLURAL, VERSION
    from epguard.webhook.metrics import Metrics

    def verdict(name: str) -> dict[str, Any]:
        spec = {"image": IMAGE, "verdict": "Unusable"}
        return {"apiVersion": "epguard.io/v1alpha1", "kind": "ImageVerdict",
                "metadata": {"name": name}, "spec": spec}  # fmt: skip

    kubectl = control_plane.kubectl
    for i in range(3):  # there before the watch starts: never handed over
        kubectl("apply", "-f", "-", input=json.dumps(verdict(f"before-{i}")), check=True)
    api = config.new_client_from_config(str(control_plane.kubeconfig))
    custom = client.CustomObjectsApi(api)
    source = changes_source(custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
    objects, version = source.list()
    assert objects == [] and version.isdigit()

    async def scenario() -> list[float]:
        sync = ChangeSync()
        task = asyncio.create_task(run_watch(sync, source, Metrics()))
        took = []
        try:
            await asyncio.wait_for(sync.changed.wait(), 10)  # the listing's own wake-up
            await asyncio.sleep(1.0)
            for args in (("apply", "-f", "-"), ("delete", "imageverdict", "wake-me")):
                sync.changed.clear()
                body = json.dumps(verdict("wake-me")) if args[0] == "apply" else None
                started = time.monotonic()
                await asyncio.to_thread(kubectl, *args, input=body, check=True)
                await asyncio.wait_for(sync.changed.wait(), 10)
                took.append(time.monotonic() - started)
        finally:
            task.cancel()
        return took

    try:
        took = asyncio.run(scenario())
    finally:
        for i in range(3):
            kubectl("delete", "imageverdict", f"before-{i}", "--ignore-not-found")
        api.close()
    assert len(took) == 2 and max(took) < 10, took


def test_after_an_api_server_restart_the_watches_list_again_and_stay_live(
    control_plane: Any, watched: RunningServer
) -> None:
    """A restarted API server starts its watch cache at the current resourceVersion, so
    every watch resuming from an older one gets a 410 inside an HTTP 200 stream. The
    webhook once read that event through the client's watch.Watch(deserialize=False),
    which raised KeyError on it: it resumed from the same version for good and stayed
    stale (and ready). Now it lists again and applies what changed."""
    from kubernetes import client, config

    from epguard.webhook.cluster.kube import status_of
    from epguard.webhook.cluster.watch import list_watch_source

    api = config.new_client_from_config(str(control_plane.kubeconfig))
    source = list_watch_source(client.CoreV1Api(api).list_namespace)
    _, old = source.list()
    control_plane.kubectl("create", "namespace", "moved-on", check=True)
    control_plane.restart_apiserver()
    with pytest.raises(client.ApiException) as gone:
        next(iter(source.watch(old)))
    assert status_of(gone.value) == 410 and "too old resource version" in str(gone.value)
    api.close()

    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    iv = {
        "apiVersion": "epguard.io/v1alpha1",
        "kind": "ImageVerdict",
        "metadata": {"name": "iv-after-restart"},
        "spec": {"image": IMAGE, "digest": "", "verdict": "Unusable",
                 "reason": "ImportError: libcudart.so.12: after the restart",
                 "lastSeen": now, "pod": "ml/worker-9", "count": 1},
    }  # fmt: skip
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(iv), check=True)
    try:
        eventually(lambda: answer(watched)["allowed"] is False, within=90)
        assert "after the restart" in answer(watched)["status"]["message"]
    finally:
        control_plane.kubectl("delete", "imageverdict", "iv-after-restart", "--ignore-not-found")
