"""The outage backstop through a real kube-apiserver, with no webhook at all.

The policies the controller installs (webhook/controller/compiler.py, controller/backstop.py) are
created here with the controller's own functions in a control plane of this module's
own, where no epguard webhook is registered: every refusal seen here is the API
server's CEL, which is exactly what a webhook outage leaves.

The corpus check is the promise the backstop makes: for every object the webhook tests
use (the admission cases, the real public manifests, the real command lines, the
hostile pods), if the policy refuses it, the webhook refuses it too, naming the same
rule or verdict.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client, config, dynamic
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from devcluster import ControlPlane
from epguard.webhook.controller.backstop import install, uninstall, write_params
from epguard.webhook.controller.compiler import BackstopConfig, compile_params
from epguard.webhook.engine.imageref import ImageRefError, parse
from epguard.webhook.engine.policy import PolicyConfig, PolicyState, decide
from epguard.webhook.engine.review import AdmissionRequest
from epguard.webhook.engine.rules import Rule, RuleSet, RulesHolder
from epguard.webhook.engine.verdicts import VerdictStore, verdict_from_object, verdict_name
from epguard.webhook.engine.workloads import BUILTIN, PATH_KINDS
from tests import hostile_pods, realmanifests
from tests.chart.chartlib import render
from tests.control_plane import running_control_plane
from tests.e2e.e2e_kube import minimal_crd

pytestmark = pytest.mark.e2e

RELEASE_NS = "epguard-system"
BAD = "lmsysorg/sglang:v0.5.16-cu129"
GOOD = "lmsysorg/sglang:v0.5.18-cu130"
PINNED = "sha256:" + "cd" * 32
OTHER_PINNED = "sha256:" + "ce" * 32
MOONCAKE = ["--model-path", "m", "--elastic-ep-backend", "mooncake"]
LAUNCH = ["python3", "-m", "sglang.launch_server"]
RULE = Rule(
    id="bad-0516",
    image="docker.io/lmsysorg/sglang:v0.5.16-cu129",
    reason="no ep_2_11_0 extension",
    remedy="use v0.5.18-cu130",
)


@dataclass
class Cluster:
    cp: ControlPlane
    api: client.ApiClient
    dyn: dynamic.DynamicClient


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with running_control_plane() as cp:
        api = config.new_client_from_config(str(cp.kubeconfig))
        core = client.CoreV1Api(api)
        for ns in (RELEASE_NS, "ml", "ml-warn", "ml-audit"):
            labels = {"epguard.io/mode": ns.split("-")[1]} if "-" in ns else {}
            core.create_namespace({"metadata": {"name": ns, "labels": labels}})
        # Every workload kind the corpus holds is served, so each reaches admission (the
        # policy leaves Dynamo and RoleBasedGroup to the webhook; they count as admitted).
        crds = [
            minimal_crd("leaderworkerset.x-k8s.io", "LeaderWorkerSet", "leaderworkersets", ["v1"]),
            minimal_crd(
                "nvidia.com",
                "DynamoGraphDeployment",
                "dynamographdeployments",
                ["v1alpha1", "v1beta1"],
            ),
            minimal_crd(
                "workloads.x-k8s.io", "RoleBasedGroup", "rolebasedgroups", ["v1alpha1", "v1alpha2"]
            ),
        ]
        crds += [_path_kind_crd(k.group, k.kind, k.resource, list(k.versions)) for k in PATH_KINDS]
        # The parameters' kind, exactly as the chart defines it.
        crds.append(render().one("CustomResourceDefinition", "refusedimagelists.epguard.io"))
        ext = client.ApiextensionsV1Api(api)
        for crd in crds:
            ext.create_custom_resource_definition(crd)
        _wait_established(ext, [c["metadata"]["name"] for c in crds])
        install(api, BackstopConfig(params_namespace=RELEASE_NS, kinds=PATH_KINDS), owner=None)
        yield Cluster(cp, api, dynamic.DynamicClient(api))


def _path_kind_crd(group: str, kind: str, plural: str, versions: list[str]) -> dict[str, Any]:
    crd = minimal_crd(group, kind, plural, versions)
    if kind.startswith("Cluster"):
        crd["spec"]["scope"] = "Cluster"
    return crd


def _wait_established(ext: client.ApiextensionsV1Api, names: list[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        conds = [ext.read_custom_resource_definition(n).status.conditions or [] for n in names]
        if all(any(c.type == "Established" and c.status == "True" for c in cs) for cs in conds):
            return
        time.sleep(0.2)
    raise AssertionError("CRDs not established")


def _store(*objects: dict[str, Any]) -> VerdictStore:
    store = VerdictStore(tag_ttl=dt.timedelta(hours=24))
    store.replace(v for v in map(verdict_from_object, objects) if v is not None)
    return store


def _verdict(name: str, image: str, digest: str | None, seen: dt.datetime) -> dict[str, Any]:
    spec = {
        "image": image,
        "verdict": "Unusable",
        "reason": "libcudart.so.12 is missing",
        "lastSeen": seen.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "pod": "ml/sglang-0",
    }
    if digest:
        spec["digest"] = digest
    return {"metadata": {"name": name}, "spec": spec}


def _params(cluster: Cluster, rules: RuleSet, store: VerdictStore) -> None:
    """Install the policy with ``rules`` and write the parameters, then wait until the API
    server's policy reads both (its param informer is eventually consistent)."""
    cfg = BackstopConfig(params_namespace=RELEASE_NS, kinds=PATH_KINDS)
    install(cluster.api, cfg, owner=None, rules=rules)
    params = compile_params(store, dt.datetime.now(dt.UTC))
    write_params(cluster.api, cfg, params)
    probe = _pod([_c("probe", BAD, LAUNCH + MOONCAKE)])
    want_refused = any(r.id == RULE.id for r in rules.rules)
    pinned = _pod([_c("probe", f"registry.example.com/x@{PINNED}", LAUNCH + MOONCAKE)])
    want_pinned = any(k == PINNED for kind, k, v in store.winners() if kind == "digest")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (_create(cluster, probe, "ml") is not None) == want_refused and (
            _create(cluster, pinned, "ml") is not None
        ) == want_pinned:
            return
        time.sleep(0.2)
    raise AssertionError("the policy did not pick up its rules and parameters")


def _c(name: str, image: str, command: list[str], args: list[str] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": image, "command": command}
    if args is not None:
        c["args"] = args
    return c


def _pod(containers: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "w", **meta},
        "spec": {"containers": containers},
    }


def _create(cluster: Cluster, obj: dict[str, Any], namespace: str) -> str | None:
    """Dry-run create; the refusal message, or None when admitted. Raises LookupError
    for a kind the API does not serve and ValueError for an object it finds invalid."""
    api_version, kind = obj.get("apiVersion", "v1"), obj.get("kind", "")
    try:
        res = cluster.dyn.resources.get(api_version=api_version, kind=kind)
    except ResourceNotFoundError as exc:
        raise LookupError(kind) from exc
    body = copy.deepcopy(obj)
    body.setdefault("metadata", {}).pop("namespace", None)
    kw = {"namespace": namespace} if res.namespaced else {}
    try:
        res.create(body=body, query_params=[("dryRun", "All")], **kw)
    except dynamic.exceptions.DynamicApiError as exc:
        status = json.loads(exc.body) if exc.body else {}
        if exc.status == 403 and "ValidatingAdmissionPolicy" in status.get("message", ""):
            return str(status["message"])
        raise ValueError(f"{exc.status}: {status.get('message', exc)}") from None
    return None


# --- the outage: no webhook, and the known-bad images are still refused -------------


def test_refuses_a_rule_denied_pod_and_deployment_naming_the_rule_with_no_webhook(
    cluster: Cluster,
) -> None:
    _params(cluster, RuleSet((RULE,)), _store())
    refused = _create(cluster, _pod([_c("worker", BAD, LAUNCH + MOONCAKE)]), "ml")
    assert refused is not None
    assert 'container "worker" (image lmsysorg/sglang:v0.5.16-cu129)' in refused
    assert "no ep_2_11_0 extension" in refused and "use v0.5.18-cu130" in refused
    assert "[epguard rule bad-0516]" in refused
    script = "python3 -m sglang.launch_server --model-path m \\\n  --elastic-ep-backend mooncake"
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [_c("sglang", f"docker.io/{BAD}", ["sh", "-c", script])]},
            },
        },
    }
    refused = _create(cluster, deployment, "ml")
    assert refused is not None and "[epguard rule bad-0516]" in refused


def test_admits_ordinary_pods_and_good_images_with_no_webhook(cluster: Cluster) -> None:
    _params(cluster, RuleSet((RULE,)), _store())
    assert _create(cluster, _pod([_c("w", GOOD, LAUNCH + MOONCAKE)]), "ml") is None
    assert _create(cluster, _pod([_c("w", BAD, [*LAUNCH, "--model-path", "m"])]), "ml") is None
    assert _create(cluster, _pod([_c("w", "busybox", ["sleep", "1"])]), "ml") is None
    nixl = LAUNCH + MOONCAKE + ["--elastic-ep-backend", "nixl"]
    assert _create(cluster, _pod([_c("w", BAD, nixl)]), "ml") is None


def test_refuses_by_verdict_digest_and_by_a_fresh_tag_but_not_an_expired_one(
    cluster: Cluster,
) -> None:
    now = dt.datetime.now(dt.UTC)
    # A probe's own name for a verdict learned by tag: the digest and the tag's hash,
    # of which the parameters hold only the hash.
    by_tag = verdict_name("registry.example.com/ml/sglang:b", OTHER_PINNED)
    store = _store(
        _verdict("by-digest", "registry.example.com/ml/sglang:a", PINNED, now),
        _verdict(by_tag, "registry.example.com/ml/sglang:b", OTHER_PINNED, now),
        _verdict("fresh-tag", "registry.example.com/ml/sglang:fresh", None, now),
        _verdict("old-tag", "registry.example.com/ml/sglang:old", None, now - dt.timedelta(days=2)),
    )
    _params(cluster, RuleSet((RULE,)), store)
    pinned = _create(
        cluster, _pod([_c("w", f"registry.example.com/x@{PINNED}", LAUNCH + MOONCAKE)]), "ml"
    )
    assert pinned is not None and "[epguard verdict by-digest]" in pinned
    other = _create(
        cluster, _pod([_c("w", f"registry.example.com/y@{OTHER_PINNED}", LAUNCH + MOONCAKE)]),
        "ml",
    )
    assert other is not None and f"[epguard verdict {by_tag}]" in other, other
    assert "libcudart.so.12 is missing" in pinned
    fresh = _create(
        cluster, _pod([_c("w", "registry.example.com/ml/sglang:fresh", LAUNCH + MOONCAKE)]), "ml"
    )
    assert fresh is not None and "[epguard verdict fresh-tag]" in fresh
    assert (
        _create(
            cluster, _pod([_c("w", "registry.example.com/ml/sglang:old", LAUNCH + MOONCAKE)]), "ml"
        )
        is None
    )


def test_warn_and_audit_namespaces_and_the_skip_annotation_are_honoured(cluster: Cluster) -> None:
    _params(cluster, RuleSet((RULE,)), _store())
    bad = _pod([_c("w", BAD, LAUNCH + MOONCAKE)])
    assert _create(cluster, bad, "ml-warn") is None
    assert _create(cluster, bad, "ml-audit") is None
    skipped = _pod([_c("w", BAD, LAUNCH + MOONCAKE)], annotations={"epguard.io/skip": "INC-1"})
    assert _create(cluster, skipped, "ml") is None
    assert _create(cluster, bad, RELEASE_NS) is None  # epguard's own namespace is excluded


def test_a_warn_namespace_gets_the_refusal_as_a_warning(cluster: Cluster) -> None:
    _params(cluster, RuleSet((RULE,)), _store())
    core = client.CoreV1Api(cluster.api)
    warning = ""
    deadline = time.monotonic() + 30  # each binding's param informer syncs on its own
    while "[epguard rule bad-0516]" not in warning and time.monotonic() < deadline:
        _, status, headers = core.create_namespaced_pod_with_http_info(
            "ml-warn", _pod([_c("w", BAD, LAUNCH + MOONCAKE)]), dry_run="All"
        )
        assert status == 201
        warning = headers.get("Warning", "")
        time.sleep(0.2)
    assert "epguard-backstop-warn" in warning and "[epguard rule bad-0516]" in warning


# --- never stricter than the webhook -----------------------------------------------


def _container_images(obj: Any) -> Iterator[str]:
    if isinstance(obj, dict):
        if isinstance(obj.get("image"), str):
            yield obj["image"]
        for v in obj.values():
            yield from _container_images(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _container_images(v)


def _valid_for_api(obj: dict[str, Any]) -> dict[str, Any]:
    """Fill what the API server's validation insists on and the test builders leave out
    (a selector, a Job's restartPolicy), so the object reaches admission."""
    o = copy.deepcopy(obj)
    spec = o.get("spec") if isinstance(o.get("spec"), dict) else None
    kind = o.get("kind")
    if spec is not None and kind in ("Deployment", "ReplicaSet", "StatefulSet", "DaemonSet"):
        labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {"app": "w"}
        spec.setdefault("selector", {"matchLabels": labels})
        spec.setdefault("template", {}).setdefault("metadata", {})["labels"] = labels
    if spec is not None and kind == "ReplicationController":
        labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {"app": "w"}
        spec.setdefault("selector", labels)
    if spec is not None and kind in ("Job", "CronJob"):
        job = spec if kind == "Job" else spec.get("jobTemplate", {}).get("spec", {})
        t = job.get("template") or {}
        if isinstance(t.get("spec"), dict):
            t["spec"].setdefault("restartPolicy", "Never")
    return o


def _corpus() -> Iterator[tuple[str, dict[str, Any]]]:
    from tests.engine.test_admission_cases import CASES

    for case in CASES:
        req = case.review["request"]
        if req.get("operation") == "CREATE" and not req.get("subResource") and req.get("object"):
            yield f"case:{case.id}", req["object"]
    for m in realmanifests.manifests():
        for i, doc in enumerate(m.documents):
            if isinstance(doc, dict) and BUILTIN.knows(*_group_kind(doc)):
                yield f"manifest:{m.file}#{i}", doc
    for line in realmanifests.command_lines():
        yield f"argv:{line.line}:sh", _pod([_c("w", BAD, ["sh", "-c", line.text])])
        try:
            words = shlex.split(line.text)
        except ValueError:
            continue
        if words:
            yield f"argv:{line.line}:exec", _pod([_c("w", BAD, words)])
    yield "hostile:doubling-env", hostile_pods.doubling_env_pod()
    yield "hostile:many-words", hostile_pods.many_words_pod()
    yield "hostile:nested-script", hostile_pods.nested_script_pod(size=4096)
    for image in (f"registry.example.com/x@{PINNED}", "registry.example.com/ml/sglang:fresh"):
        for form in (LAUNCH + MOONCAKE, ["sh", "-c", " ".join(LAUNCH + MOONCAKE)]):
            yield f"verdict:{image}:{form[0]}", _pod([_c("w", image, form)])


def _group_kind(obj: dict[str, Any]) -> tuple[str, str]:
    group = str(obj.get("apiVersion", "")).rpartition("/")[0]
    return group, str(obj.get("kind", ""))


def test_the_backstop_is_never_stricter_than_the_webhook_on_the_whole_corpus(
    cluster: Cluster,
) -> None:
    corpus = list(_corpus())
    # Deny every image the corpus uses, exactly: which objects the policy then refuses
    # shows exactly which command lines it reads as asking for mooncake.
    rules: list[Rule] = [RULE]
    for _, obj in corpus:
        for image in _container_images(obj):
            try:
                ref = parse(image)
            except ImageRefError:
                continue
            if "[" not in ref.name_tag and not any(r.image == ref.name_tag for r in rules):
                rules.append(
                    Rule(
                        id=f"corpus-{len(rules)}",
                        image=ref.name_tag,
                        reason="corpus",
                        remedy="none",
                    )
                )
    now = dt.datetime.now(dt.UTC)
    store = _store(
        _verdict("by-digest", "registry.example.com/ml/sglang:a", PINNED, now),
        _verdict("fresh-tag", "registry.example.com/ml/sglang:fresh", None, now),
    )
    ruleset = RuleSet(tuple(rules))
    _params(cluster, ruleset, store)
    state = PolicyState(rules=RulesHolder(ruleset), config=PolicyConfig(kinds=BUILTIN))
    state.verdicts = store

    both = policy_only = webhook_only = unserved = invalid = 0
    stricter: list[str] = []
    for label, raw in corpus:
        obj = _valid_for_api(raw)
        try:
            refused = _create(cluster, obj, "ml")
        except LookupError as exc:
            unserved += 1
            print(f"not served: {label} ({exc})")
            continue
        except ValueError:
            invalid += 1
            continue
        group, kind = _group_kind(obj)
        request = AdmissionRequest.model_validate(
            {
                "uid": "u",
                "kind": {"group": group, "version": "v1", "kind": kind},
                "resource": {"group": group, "version": "v1", "resource": kind.lower() + "s"},
                "operation": "CREATE",
                "namespace": "ml",
                "object": obj,
                "userInfo": {"username": "alice"},
            }
        )
        decision = decide(request, state)
        if refused is not None and decision.allowed:
            stricter.append(f"{label}: policy refused, webhook admitted: {refused[:300]}")
            policy_only += 1
        elif refused is not None:
            tag = refused[refused.rfind("[epguard ") :]
            if tag not in (decision.message or ""):
                stricter.append(f"{label}: webhook refused for another reason than {tag}")
            both += 1
        elif not decision.allowed:
            webhook_only += 1
    print(
        f"corpus {len(corpus)}: refused by both {both}, by the webhook only {webhook_only}, "
        f"by the policy only {policy_only}; not served {unserved}, invalid for the API {invalid}"
    )
    assert stricter == []
    # The check must have teeth: a good share of the corpus is refused by the policy
    # (the admission cases alone give 25; the real manifests, where present, more).
    assert both >= (30 if realmanifests.available() else 20), both


def test_turned_off_after_it_was_on_it_is_removed(cluster: Cluster) -> None:
    # `helm upgrade --set backstop.enabled=false`: the controller's start removes the
    # policies, bindings and parameters an earlier release installed under its name.
    cfg = BackstopConfig(params_namespace=RELEASE_NS, name="epguard-turned-off", kinds=())
    install(cluster.api, cfg, owner=None)
    write_params(cluster.api, cfg, compile_params(_store(), dt.datetime.now(dt.UTC)))
    adm = client.AdmissionregistrationV1Api(cluster.api)
    assert "epguard-turned-off" in {
        p.metadata.name for p in adm.list_validating_admission_policy().items
    }
    assert {b.metadata.name for b in adm.list_validating_admission_policy_binding().items} >= {
        f"epguard-turned-off-{m}" for m in ("enforce", "warn", "audit")
    }
    assert uninstall(cluster.api, cfg) is True
    left = [p.metadata.name for p in adm.list_validating_admission_policy().items]
    left += [b.metadata.name for b in adm.list_validating_admission_policy_binding().items]
    assert not [n for n in left if n.startswith("epguard-turned-off")]
    custom = client.CustomObjectsApi(cluster.api)
    listed = custom.list_cluster_custom_object("epguard.io", "v1alpha1", "refusedimagelists")
    assert not [
        o for o in listed["items"] if o["metadata"]["name"].startswith("epguard-turned-off")
    ]
    assert uninstall(cluster.api, cfg) is False  # nothing left: a no-op


def test_an_earlier_releases_per_mode_policies_and_single_list_are_replaced(
    cluster: Cluster,
) -> None:
    # The release before the shards kept three policies named <name>-<mode> and one
    # RefusedImageList named <name>: an upgrade must not leave them refusing by stale
    # lines beside the new policy.
    cfg = BackstopConfig(params_namespace=RELEASE_NS, name="epguard-upgraded", kinds=())
    adm = client.AdmissionregistrationV1Api(cluster.api)
    custom = client.CustomObjectsApi(cluster.api)
    for mode in ("enforce", "warn", "audit"):
        adm.create_validating_admission_policy(
            {
                "metadata": {"name": f"epguard-upgraded-{mode}"},
                "spec": {
                    "failurePolicy": "Ignore",
                    "matchConstraints": {
                        "resourceRules": [
                            {
                                "apiGroups": [""],
                                "apiVersions": ["v1"],
                                "resources": ["pods"],
                                "operations": ["CREATE"],
                            }
                        ]
                    },
                    "validations": [{"expression": "true"}],
                },
            }
        )
    custom.create_cluster_custom_object(
        "epguard.io", "v1alpha1", "refusedimagelists",
        {"apiVersion": "epguard.io/v1alpha1", "kind": "RefusedImageList",
         "metadata": {"name": "epguard-upgraded"}, "data": {}},
    )  # fmt: skip
    install(cluster.api, cfg, owner=None)
    write_params(cluster.api, cfg, compile_params(_store(), dt.datetime.now(dt.UTC)))
    policies = {p.metadata.name for p in adm.list_validating_admission_policy().items}
    assert "epguard-upgraded" in policies
    assert not {f"epguard-upgraded-{m}" for m in ("enforce", "warn", "audit")} & policies
    listed = custom.list_cluster_custom_object("epguard.io", "v1alpha1", "refusedimagelists")
    names = {o["metadata"]["name"] for o in listed["items"]}
    assert "epguard-upgraded" not in names and "epguard-upgraded-1-0" in names
    assert uninstall(cluster.api, cfg) is True
