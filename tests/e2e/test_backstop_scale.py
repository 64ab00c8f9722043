"""The outage backstop at scale, through a real kube-apiserver with no webhook at all.

* 1,000 and 10,000 verdicts: as many real Unusable ImageVerdicts (distinct images and
  digests) are created through the API; the controller's own sync (``sync_once``: list
  a page at a time, compile, install, write) turns them into parameters; every digest
  and every tag is in the shards the API server stores. At 1,000 every one of them is
  refused by the API server, naming its verdict; at 10,000 the first and the last
  entries of every shard and a random 1,000 (20,000 dry-run creates took 52 s of the
  suite's two workers; every key goes through the same map lookup, so the sample and
  the exact stored entries prove what all of them would).
* 10,000 and 100,000 verdicts: the compiler's shards are written directly. The shards
  read back hold every entry; the first and the last entry of every shard, the last
  entry of the last shard and a random sample are refused; an unknown digest is
  admitted. 100,000 real ImageVerdicts end to end (6-7 minutes of POSTs on two cores,
  then every one of the 200,000 keys refused) is bench/backstop_scale.py, which runs
  these same steps and prints the figures.

A policy that errors (over its CEL cost budget, say) under ``failurePolicy: Ignore``
admits silently. So each case also checks the API server's own counter of policy checks
(``apiserver_validating_admission_policy_check_total``): no decision turned into an
admission by an error (out of budget or any other), and exactly one deny per refusal.
(The policy's typeChecking status is written by kube-controller-manager, which this
control plane does not run.)
Timings and the controller's compile time and memory are printed; the figures are in
bench/backstop_compile.py too.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import re
import time
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client, config

from devcluster import ControlPlane
from epguard.webhook.controller.backstop import BackstopState, install, sync_once, write_params
from epguard.webhook.controller.compiler import (
    DIGEST_KEY,
    PARAMS_GROUP,
    PARAMS_PLURAL,
    PARAMS_VERSION,
    SHARD_BYTES,
    SHARD_LABEL,
    BackstopConfig,
    Params,
    compile_params,
    policy_name,
)
from epguard.webhook.engine.verdicts import VerdictStore, verdict_from_object
from tests.chart.chartlib import render
from tests.control_plane import running_control_plane

pytestmark = pytest.mark.e2e

RELEASE_NS = "epguard-system"
CONFIG = BackstopConfig(params_namespace=RELEASE_NS)
LAUNCH = ["python3", "-m", "sglang.launch_server", "--model-path", "m"]
MOONCAKE = ["--elastic-ep-backend", "mooncake"]
REASON = "libcudart.so.12 is missing"
# Up to this many verdicts every key is refused through the API server; above, a sample.
FULL_CHECK = 2_000


@dataclass
class Cluster:
    cp: ControlPlane
    api: client.ApiClient


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with backstop_cluster() as c:
        yield c


@contextmanager
def backstop_cluster() -> Iterator[Cluster]:
    """A real API server with the chart's two CRDs and no webhook at all."""
    with running_control_plane() as cp:
        api = config.new_client_from_config(str(cp.kubeconfig))
        core = client.CoreV1Api(api)
        for ns in (RELEASE_NS, "ml"):
            core.create_namespace({"metadata": {"name": ns}})
        ext = client.ApiextensionsV1Api(api)
        names = ["refusedimagelists.epguard.io", "imageverdicts.epguard.io"]
        for name in names:
            ext.create_custom_resource_definition(render().one("CustomResourceDefinition", name))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            conds = [ext.read_custom_resource_definition(n).status.conditions or [] for n in names]
            if all(any(c.type == "Established" and c.status == "True" for c in cs) for cs in conds):
                break
            time.sleep(0.2)
        yield Cluster(cp, api)


def digest_of(n: int, i: int) -> str:
    return "sha256:" + f"{n:08x}{i:08x}" * 4


def image_of(n: int, i: int) -> str:
    return f"registry.example.com/team-{i % 100}/sglang:n{n}-b{i}"


def verdict(n: int, i: int) -> dict[str, Any]:
    d = digest_of(n, i)
    return {
        "apiVersion": "epguard.io/v1alpha1",
        "kind": "ImageVerdict",
        "metadata": {"name": d.replace(":", "-")},
        "spec": {
            "image": image_of(n, i),
            "digest": d,
            "verdict": "Unusable",
            "reason": f"{REASON} (build {i % 7})",
            "pod": "ml/sglang-0",
            "lastSeen": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    }


def pod(image: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "w"},
        "spec": {"containers": [{"name": "worker", "image": image, "command": LAUNCH + MOONCAKE}]},
    }


def refusal(cluster: Cluster, image: str) -> str | None:
    """Dry-run create; the backstop's refusal message, or None when admitted."""
    try:
        client.CoreV1Api(cluster.api).create_namespaced_pod("ml", pod(image), dry_run="All")
    except client.ApiException as exc:
        message = str(json.loads(exc.body or "{}").get("message", ""))
        assert exc.status == 403 and "epguard (backstop policy)" in message, message
        return message
    return None


def refused_all(cluster: Cluster, images: list[str]) -> list[str | None]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda i: refusal(cluster, i), images))


def wait_refused(cluster: Cluster, image: str, within: float = 60.0) -> float:
    """Until the API server's param informer has the shard that refuses ``image``."""
    t0 = time.monotonic()
    while refusal(cluster, image) is None:
        assert time.monotonic() - t0 < within, f"{image} never refused"
        time.sleep(0.2)
    return time.monotonic() - t0


def policy_checks(cluster: Cluster) -> dict[str, float]:
    """The API server's counter of this policy's decisions, by enforcement action. An
    admission with no hit makes no decision (the matchCondition is false), so every
    ``allow`` counted is an error the failure policy turned into an admission (out of
    budget, or any other); a refusal counts as ``deny``."""
    text = cluster.cp.kubectl("get", "--raw", "/metrics", check=True).stdout
    out: dict[str, float] = {}
    pattern = re.compile(
        r"^apiserver_validating_admission_policy_check_total\{([^}]*)\} ([0-9.e+]+)$", re.M
    )
    for labels, value in pattern.findall(str(text)):
        if f'policy="{policy_name(CONFIG)}"' in labels:
            action = re.search(r'enforcement_action="([^"]*)"', labels)
            key = action.group(1) if action else "?"
            out[key] = out.get(key, 0.0) + float(value)
    return out


def stored_shards(cluster: Cluster) -> list[dict[str, Any]]:
    listed = client.CustomObjectsApi(cluster.api).list_cluster_custom_object(
        PARAMS_GROUP, PARAMS_VERSION, PARAMS_PLURAL, label_selector=f"{SHARD_LABEL}={CONFIG.name}"
    )
    return list(listed["items"])


def stored_keys(cluster: Cluster) -> tuple[set[str], set[tuple[str, str]]]:
    """Every digest key and (repository, tag) in the stored shards."""
    digests: set[str] = set()
    tags: set[tuple[str, str]] = set()
    for shard in stored_shards(cluster):
        data = shard["data"]
        digests |= set(data.get("d") or {})
        tags |= {(repo, tag) for repo, by_tag in (data.get("t") or {}).items() for tag in by_tag}
    return digests, tags


def create_verdicts(cluster: Cluster, n: int) -> None:
    custom = client.CustomObjectsApi(cluster.api)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda i: custom.create_cluster_custom_object(
            "epguard.io", "v1alpha1", "imageverdicts", verdict(n, i)), range(n)))  # fmt: skip
    print(f"\n{n} ImageVerdicts created in {time.monotonic() - t0:.1f}s")


def delete_verdicts(cluster: Cluster) -> None:
    client.CustomObjectsApi(cluster.api).delete_collection_cluster_custom_object(
        "epguard.io", "v1alpha1", "imageverdicts"
    )


@pytest.mark.parametrize("n", [1_000, 10_000])
def test_real_verdicts_each_refused_with_no_webhook(cluster: Cluster, n: int) -> None:
    delete_verdicts(cluster)
    create_verdicts(cluster, n)
    state = BackstopState(
        config=CONFIG,
        rules_configmap="epguard-rules",
        rules_key="rules.yaml",
        tag_ttl=dt.timedelta(hours=24),
    )
    tracemalloc.start()
    t0 = time.perf_counter()
    params = sync_once(cluster.api, state, dt.datetime.now(dt.UTC))
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"controller sync (list, compile, install, write): {took:.2f}s, peak {peak >> 20} MiB")
    assert params.dropped == 0 and params.kept == 2 * n
    # Nothing changed: the next poll neither recompiles nor rewrites.
    t0 = time.perf_counter()
    assert sync_once(cluster.api, state, dt.datetime.now(dt.UTC)) is params
    print(f"an unchanged poll: {time.perf_counter() - t0:.2f}s")
    # Every entry is in a shard the API server stores (and so reads).
    digests, tags = stored_keys(cluster)
    assert digests == {digest_of(n, i)[7 : 7 + DIGEST_KEY] for i in range(n)}
    assert tags == {tuple(image_of(n, i).rsplit(":", 1)) for i in range(n)}
    wait_refused(cluster, f"registry.example.com/team-0/sglang@{digest_of(n, 0)}")
    before = policy_checks(cluster)
    t0 = time.monotonic()
    checked = sorted(
        set(range(n)) if n <= FULL_CHECK else set(random.Random(n).sample(range(n), 1_000))
    )
    pinned = [f"registry.example.com/team-{i % 100}/sglang@{digest_of(n, i)}" for i in checked]
    said = refused_all(cluster, pinned)
    for i, message in zip(checked, said, strict=True):
        assert message is not None, digest_of(n, i)
        assert f"[epguard verdict {digest_of(n, i).replace(':', '-')}]" in message
    said = refused_all(cluster, [image_of(n, i) for i in checked])
    assert all(m is not None and REASON in m for m in said)
    # Each shard's first and last entries (where a shard's bounds would show).
    edges = [i for imgs in _entry_images(params, n).values() for i in imgs]
    assert None not in refused_all(cluster, edges)
    print(f"{2 * len(checked) + len(edges)} refusals checked in {time.monotonic() - t0:.1f}s")
    assert refusal(cluster, f"registry.example.com/team-0/sglang@{digest_of(n + 1, 0)}") is None
    after = policy_checks(cluster)
    assert set(after) == {"deny"}, after
    assert after["deny"] - before.get("deny", 0) == 2 * len(checked) + len(edges)


def _store(n: int) -> VerdictStore:
    store = VerdictStore(tag_ttl=dt.timedelta(hours=24), cap=2 * n)
    store.replace(v for v in (verdict_from_object(verdict(n, i)) for i in range(n)) if v)
    return store


def _entry_images(params: Params, n: int) -> dict[str, list[str]]:
    """For each shard: the images of its first and last digest and tag entries."""
    by_key = {digest_of(n, i)[7 : 7 + DIGEST_KEY]: i for i in range(n)}
    out: dict[str, list[str]] = {}
    for s, shard in enumerate(params.shards):
        images = []
        for key in (list(shard["d"])[:1] + list(shard["d"])[-1:]) if shard["d"] else []:
            i = by_key[key]
            images.append(f"registry.example.com/team-{i % 100}/sglang@{digest_of(n, i)}")
        repos = list(shard["t"])
        for repo in repos[:1] + repos[-1:]:
            tags = list(shard["t"][repo])
            images += [f"{repo}:{tag}" for tag in tags[:1] + tags[-1:]]
        out[f"shard {s}"] = images
    return out


@pytest.mark.parametrize("n", [10_000, 100_000])
def test_every_shard_is_read_and_its_last_entry_refused(cluster: Cluster, n: int) -> None:
    install(cluster.api, CONFIG, None)
    store = _store(n)
    tracemalloc.start()
    t0 = time.perf_counter()
    params = compile_params(store, dt.datetime.now(dt.UTC))
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"\n{n} verdicts: compiled in {took:.2f}s (peak {peak >> 20} MiB), "
          f"{len(params.shards)} shards, {params.kept} entries")  # fmt: skip
    assert params.dropped == 0 and params.kept == 2 * n
    t0 = time.perf_counter()
    write_params(cluster.api, CONFIG, params)
    print(f"shards written in {time.perf_counter() - t0:.2f}s")
    # Read back: every entry is stored, each shard within what etcd takes.
    stored = {o["metadata"]["name"]: o for o in stored_shards(cluster)}
    assert len(stored) == len(params.shards)
    assert sorted(json.dumps(o["data"], sort_keys=True) for o in stored.values()) == sorted(
        json.dumps({**d, **({"rules": True} if i == 0 else {})}, sort_keys=True)
        for i, d in enumerate(params.shards)
    )
    for o in stored.values():
        whole = len(json.dumps(o, separators=(",", ":")).encode())  # managedFields included
        assert whole <= SHARD_BYTES + 64 * 1024, (o["metadata"]["name"], whole)
    per_shard = _entry_images(params, n)
    last = per_shard[f"shard {len(params.shards) - 1}"][1]
    took = wait_refused(cluster, last)
    print(f"the last entry of the last shard refused after {took:.1f}s: {last}")
    before = policy_checks(cluster)
    images = [i for imgs in per_shard.values() for i in imgs]
    rng = random.Random(n)
    sample = rng.sample(range(n), 200)
    images += [f"registry.example.com/team-{i % 100}/sglang@{digest_of(n, i)}" for i in sample]
    images += [image_of(n, i) for i in sample]
    said = refused_all(cluster, images)
    assert [img for img, m in zip(images, said, strict=True) if m is None] == []
    assert refusal(cluster, f"registry.example.com/team-0/sglang@{digest_of(n + 1, 0)}") is None
    assert refusal(cluster, "registry.example.com/team-0/sglang:unknown") is None
    after = policy_checks(cluster)
    assert set(after) == {"deny"}, after
    assert after["deny"] - before.get("deny", 0) == len(images)
    print(f"{len(images)} refusals checked over {len(params.shards)} shards; checks: {after}")
