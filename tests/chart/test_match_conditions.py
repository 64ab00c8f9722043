"""The webhooks' matchConditions (CEL), evaluated with a CEL interpreter (cel-python)
against objects of every shape: the API server must send every object whose containers
mention the flag (a prefilter: it may send a few more, `--elasticsearch-url`, which the
webhook then lets through), keep ordinary objects away, and never hit an evaluation
error (which would apply failurePolicy to an object epguard has no business with).
tests/chart/test_prefilter.py holds the prefilter to the engine and to the previous,
exact, needle."""

from __future__ import annotations

import functools
from typing import Any

import celpy
import pytest

from tests import realmanifests
from tests.chart.chartlib import CEL_FUNCTIONS, render

Obj = dict[str, Any]
FLAG_ARGS = ["python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "mooncake"]
PLAIN_ARGS = ["python3", "-m", "sglang.launch_server", "--tp", "8"]


def c(args: list[str] | None = None, **extra: Any) -> Obj:
    out: Obj = {"name": "worker", "image": "lmsysorg/sglang:v0.5.21"}
    if args is not None:
        out["args"] = args
    out.update(extra)
    return out


def pod_spec(*containers: Obj, init: list[Obj] | None = None) -> Obj:
    spec: Obj = {"containers": list(containers)}
    if init is not None:
        spec["initContainers"] = init
    return spec


def template(spec: Obj) -> Obj:
    return {"metadata": {"labels": {"app": "x"}}, "spec": spec}


def rbg(*roles: Obj, version: str = "v1alpha1", **spec: Any) -> Obj:
    return {"apiVersion": f"workloads.x-k8s.io/{version}", "kind": "RoleBasedGroup",
            "metadata": {"name": "g"}, "spec": {"roles": list(roles), **spec}}  # fmt: skip


def pod(spec: Obj) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


def workload(kind: str, spec: Obj) -> Obj:
    group = "batch/v1" if kind == "Job" else "apps/v1"
    return {
        "apiVersion": group,
        "kind": kind,
        "metadata": {"name": "w"},
        "spec": {"selector": {}, "template": template(spec)},
    }


def cronjob(spec: Obj) -> Obj:
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {"name": "cj"},
        "spec": {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": template(spec)}}},
    }


def lws(leader: Obj | None, worker: Obj | None) -> Obj:
    lwt: Obj = {"size": 2}
    if leader is not None:
        lwt["leaderTemplate"] = template(leader)
    if worker is not None:
        lwt["workerTemplate"] = template(worker)
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "l"},
        "spec": {"replicas": 1, "leaderWorkerTemplate": lwt},
    }


def dgd_v1alpha1(services: dict[str, Obj]) -> Obj:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "d"},
        "spec": {"services": services},
    }


def dgd_v1beta1(components: list[Obj]) -> Obj:
    return {
        "apiVersion": "nvidia.com/v1beta1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "d"},
        "spec": {"components": components},
    }


# (webhook, description, object, expected)
CASES: list[tuple[str, str, Obj, bool]] = [
    ("pods", "flag in args", pod(pod_spec(c(FLAG_ARGS))), True),
    ("pods", "flag in command", pod(pod_spec(c(None, command=FLAG_ARGS))), True),
    ("pods", "--flag=value form", pod(pod_spec(c(["--elastic-ep-backend=mooncake"]))), True),
    ("pods", "argparse prefix", pod(pod_spec(c(["--elastic-ep-b", "mooncake"]))), True),
    (
        "pods",
        "inside sh -c",
        pod(
            pod_spec(
                c(
                    None,
                    command=[
                        "sh",
                        "-c",
                        "exec python3 -m sglang.launch_server --elastic-ep-backend mooncake",
                    ],
                )
            )
        ),
        True,
    ),
    (
        "pods",
        "behind $(VAR) from env",
        pod(pod_spec(c(["$(EP)"], env=[{"name": "EP", "value": "--elastic-ep-backend mooncake"}]))),
        True,
    ),
    ("pods", "only an init container", pod(pod_spec(c(PLAIN_ARGS), init=[c(FLAG_ARGS)])), True),
    ("pods", "second container", pod(pod_spec(c(PLAIN_ARGS), c(FLAG_ARGS))), True),
    ("pods", "no flag", pod(pod_spec(c(PLAIN_ARGS))), False),
    ("pods", "no args, no command, no env", pod(pod_spec(c(None))), False),
    (
        "pods",
        "env from a secret (no value)",
        pod(
            pod_spec(
                c(
                    PLAIN_ARGS,
                    env=[{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                )
            )
        ),
        False,
    ),
    (
        "pods",
        "no spec at all",
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}},
        False,
    ),
    (
        "pods",
        "flag only in a label",
        {**pod(pod_spec(c(PLAIN_ARGS))), "metadata": {"name": "p", "labels": {"x": "--elastic"}}},
        False,
    ),
    *[
        ("workloads", f"{kind} with flag", workload(kind, pod_spec(c(FLAG_ARGS))), True)
        for kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")
    ],
    *[
        ("workloads", f"{kind} without flag", workload(kind, pod_spec(c(PLAIN_ARGS))), False)
        for kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")
    ],
    (
        "workloads",
        "Deployment, init container",
        workload("Deployment", pod_spec(c(PLAIN_ARGS), init=[c(FLAG_ARGS)])),
        True,
    ),
    (
        "workloads",
        "Deployment without template",
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "w"},
            "spec": {"replicas": 1},
        },
        False,
    ),
    ("cronjobs", "CronJob with flag", cronjob(pod_spec(c(FLAG_ARGS))), True),
    ("cronjobs", "CronJob without flag", cronjob(pod_spec(c(PLAIN_ARGS))), False),
    (
        "cronjobs",
        "CronJob without jobTemplate",
        {
            "apiVersion": "batch/v1",
            "kind": "CronJob",
            "metadata": {"name": "cj"},
            "spec": {"schedule": "@daily"},
        },
        False,
    ),
    (
        "leaderworkersets",
        "flag in worker template",
        lws(pod_spec(c(PLAIN_ARGS)), pod_spec(c(FLAG_ARGS))),
        True,
    ),
    (
        "leaderworkersets",
        "flag in leader template",
        lws(pod_spec(c(FLAG_ARGS)), pod_spec(c(PLAIN_ARGS))),
        True,
    ),
    ("leaderworkersets", "worker only, with flag", lws(None, pod_spec(c(FLAG_ARGS))), True),
    ("leaderworkersets", "worker only, no flag", lws(None, pod_spec(c(PLAIN_ARGS))), False),
    ("leaderworkersets", "no templates", lws(None, None), False),
    # RoleBasedGroup: where sgl-project/rbg puts a launch line besides roles[].template
    # (v1alpha1 leaderWorkerSet patches, templateRef + templatePatch, components;
    # v1alpha2 customComponentsPattern), each once missed by the engine and the CEL.
    (
        "rolebasedgroups",
        "v1alpha1 patchLeaderTemplate",
        rbg(
            {
                "name": "p",
                "template": template(pod_spec(c(PLAIN_ARGS))),
                "leaderWorkerSet": {
                    "size": 2,
                    "patchLeaderTemplate": {"spec": {"containers": [c(FLAG_ARGS)]}},
                },
            }
        ),
        True,
    ),
    (
        "rolebasedgroups",
        "v1alpha1 templateRef and templatePatch",
        rbg(
            {
                "name": "p",
                "templateRef": {"name": "base"},
                "templatePatch": {"spec": {"containers": [c(FLAG_ARGS)]}},
            },
            roleTemplates=[{"name": "base", "template": template(pod_spec(c(PLAIN_ARGS)))}],
        ),
        True,
    ),
    (
        "rolebasedgroups",
        "v1alpha1 components",
        rbg(
            {
                "name": "p",
                "components": [{"name": "e", "template": template(pod_spec(c(FLAG_ARGS)))}],
            }
        ),
        True,
    ),
    (
        "rolebasedgroups-v1alpha2",
        "v1alpha2 customComponentsPattern",
        rbg(
            {
                "name": "p",
                "customComponentsPattern": {
                    "components": [
                        {"name": "e", "size": 1, "template": template(pod_spec(c(FLAG_ARGS)))}
                    ]
                },
            },
            version="v1alpha2",
        ),
        True,
    ),
    (
        "rolebasedgroups",
        "every placement, no flag",
        rbg(
            {
                "name": "p",
                "template": template(pod_spec(c(PLAIN_ARGS))),
                "leaderWorkerSet": {
                    "patchLeaderTemplate": {"spec": {"containers": [c(PLAIN_ARGS)]}}
                },
                "customComponentsPattern": {
                    "components": [{"name": "e", "template": template(pod_spec(c(PLAIN_ARGS)))}]
                },
            }
        ),
        False,
    ),
    (
        "dynamographdeployments",
        "v1alpha1 mainContainer args",
        dgd_v1alpha1(
            {
                "Frontend": {"replicas": 1},
                "decode": {"extraPodSpec": {"mainContainer": c(FLAG_ARGS)}},
            }
        ),
        True,
    ),
    (
        "dynamographdeployments",
        "v1alpha1 mainContainer command",
        dgd_v1alpha1({"decode": {"extraPodSpec": {"mainContainer": c(None, command=FLAG_ARGS)}}}),
        True,
    ),
    (
        "dynamographdeployments",
        "v1alpha1 sidecar container",
        dgd_v1alpha1(
            {
                "decode": {
                    "extraPodSpec": {"mainContainer": c(PLAIN_ARGS), "containers": [c(FLAG_ARGS)]}
                }
            }
        ),
        True,
    ),
    (
        "dynamographdeployments",
        "v1alpha1 without flag",
        dgd_v1alpha1(
            {"decode": {"extraPodSpec": {"mainContainer": c(PLAIN_ARGS)}}, "Frontend": {}}
        ),
        False,
    ),
    ("dynamographdeployments", "v1alpha1 empty services", dgd_v1alpha1({}), False),
    (
        "dynamographdeployments",
        "v1beta1 component with flag",
        dgd_v1beta1(
            [{"name": "fe"}, {"name": "decode", "podTemplate": {"spec": pod_spec(c(FLAG_ARGS))}}]
        ),
        True,
    ),
    (
        "dynamographdeployments",
        "v1beta1 without flag",
        dgd_v1beta1([{"name": "decode", "podTemplate": {"spec": pod_spec(c(PLAIN_ARGS))}}]),
        False,
    ),
    ("dynamographdeployments", "v1beta1 no podTemplate", dgd_v1beta1([{"name": "decode"}]), False),
]

ENV = celpy.Environment()


def expressions() -> dict[str, str]:
    vwc = next(o for o in render().objects if o["kind"] == "ValidatingWebhookConfiguration")
    return {
        w["name"].split(".")[0]: w["matchConditions"][0]["expression"]
        for w in vwc["webhooks"]
        if w["name"] != "rules.epguard.io"  # the check of epguard's own rules ConfigMap
    }


@functools.cache
def _program(expression: str) -> Any:
    return ENV.program(ENV.compile(expression), functions=CEL_FUNCTIONS)


def evaluate(expression: str, obj: Obj) -> bool:
    program = _program(expression)
    result = program.evaluate({"object": celpy.json_to_cel(obj)})  # type: ignore[attr-defined]
    assert isinstance(result, celpy.celtypes.BoolType), f"not a bool (an error?): {result!r}"
    return bool(result)


def test_there_is_one_expression_per_shape() -> None:
    assert set(expressions()) == {
        "pods",
        "workloads",
        "cronjobs",
        "leaderworkersets",
        "dynamographdeployments",
        "rolebasedgroups",
        "rolebasedgroups-v1alpha2",
        "disaggregatedsets",
        "servingruntimes",
        "clusterservingruntimes",
    }


@pytest.mark.parametrize(
    ("hook", "what", "obj", "expected"), CASES, ids=[f"{h}: {w}" for h, w, _, _ in CASES]
)
def test_the_api_server_sends_the_objects_that_mention_the_flag_and_not_plain_ones(
    hook: str, what: str, obj: Obj, expected: bool
) -> None:
    assert evaluate(expressions()[hook], obj) is expected


@pytest.mark.parametrize("hook", sorted(expressions()))
def test_no_expression_errors_on_any_shape(hook: str) -> None:
    # Each expression meets objects of other shapes only if rules and CEL disagree, but
    # it must still answer false (or true), never fail.
    for _, _, obj, _ in CASES:
        evaluate(expressions()[hook], obj)


# --- the needle: every spelling SGLang accepts, and a few words it does not --------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--elastic-ep-backend", "mooncake"], True),
        (["--elastic-ep-backend=mooncake"], True),
        (["--el", "mooncake"], True),
        (["--elastic-ep-b=mooncake"], True),
        (["sh", "-c", "exec python3 -m sglang.launch_server --elastic-ep-backend mooncake"], True),
        (["bash", "-c", 'run \\\n  --elastic-ep-backend="mooncake"'], True),
        (["bash", "-c", "x;--elastic-ep-backend mooncake"], True),
        (["sh", "-c", "run ${EP:+--elastic-ep-backend mooncake}"], True),
        (["sh", "-c", "run \\--elastic-ep-backend mooncake"], True),
        (["sh", "-c", "run --elastic-ep-backend>/dev/null mooncake"], True),
        # Not the flag, but they hold --el: sent, and the webhook lets them through. The
        # price of an expression an admin can read (the exact needle was up to 32 KB of CEL).
        (["filebeat", "--elasticsearch-url", "http://es:9200"], True),
        (["--elasticsearch.hosts=es:9200"], True),
        (["--elastic-ep-backendx", "mooncake"], True),
        # No --el: never sent.
        (["--e", "mooncake"], False),
        (["--enable-elastic-ep"], False),
        (["-elastic-ep-backend", "mooncake"], False),
        (["python3", "-m", "sglang.launch_server", "--tp", "8"], False),
    ],
)
def test_the_needle_matches_flag_spellings_and_keeps_words_without_it_away(
    args: list[str], expected: bool
) -> None:
    assert evaluate(expressions()["pods"], pod(pod_spec(c(args)))) is expected


QUOTED = [
    "exec python3 -m sglang.launch_server -''-elastic-ep-backend mooncake",
    'exec python3 -m sglang.launch_server --el"astic"-ep-backend mooncake',
    "exec python3 -m sglang.launch_server -\\-elastic-ep-backend=mooncake",
    "exec python3 -m sglang.launch_server --elastic''-ep-b mooncake",
    'exec python3 -m sglang.launch_server $"--elastic-ep-backend" mooncake',
]


@pytest.mark.parametrize("script", QUOTED)
def test_a_flag_the_shell_joins_from_quoted_pieces_is_sent(script: str) -> None:
    # The shell removes the quotes and passes --elastic-ep-backend (probe/shell.py).
    assert evaluate(expressions()["pods"], pod(pod_spec(c(["sh", "-c", script]))))
    # The script from an env value the kubelet puts in place ($(VAR)): the shell reads it.
    env = [{"name": "RUN", "value": script}]
    assert evaluate(expressions()["pods"], pod(pod_spec(c(["sh", "-c", "$(RUN)"], env=env))))
    for hook, obj in (("workloads", workload("Deployment", pod_spec(c(["sh", "-c", script])))),
                      ("cronjobs", cronjob(pod_spec(c(["sh", "-c", script]))))):  # fmt: skip
        assert evaluate(expressions()[hook], obj), hook


@pytest.mark.parametrize(
    "script",
    ["run -''-enable-elastic-ep", "echo 'it''s' --tp 8", "run -'e'lastic-ep-backend mooncake",
     "run --e''x --tp 8"],
)  # fmt: skip
def test_quoted_text_without_the_flag_is_not_sent(script: str) -> None:
    assert not evaluate(expressions()["pods"], pod(pod_spec(c(["sh", "-c", script]))))


def test_env_values_that_carry_the_flag_are_sent() -> None:
    env = [{"name": "EXTRA", "value": "--elastic-ep-backend mooncake"}]
    assert evaluate(expressions()["pods"], pod(pod_spec(c(["$(EXTRA)"], env=env))))
    plain = [{"name": "TP", "value": "--tp 8 --enable-dp-attention"}]
    assert not evaluate(expressions()["pods"], pod(pod_spec(c(["$(TP)"], env=plain))))


def test_kubectl_debug_with_the_flag_is_sent_through_pods_ephemeralcontainers() -> None:
    """`kubectl debug` adds an ephemeral container with an UPDATE of the subresource
    pods/ephemeralcontainers (the object is the whole Pod): the pods webhook asks for
    that subresource, and its condition reads ephemeral containers."""
    assert "pods/ephemeralcontainers" in HOOK_RULES["pods"][1]
    debug = {**pod(pod_spec(c(PLAIN_ARGS))), "status": {}}
    debug["spec"]["ephemeralContainers"] = [c(FLAG_ARGS, name="debug")]
    assert evaluate(expressions()["pods"], debug)
    debug["spec"]["ephemeralContainers"] = [c(PLAIN_ARGS, name="debug")]
    assert not evaluate(expressions()["pods"], debug)
    mwc = next(o for o in render().objects if o["kind"] == "MutatingWebhookConfiguration")
    assert all(
        "pods/ephemeralcontainers" not in r["resources"]
        for w in mwc["webhooks"]
        for r in w["rules"]
    )  # fmt: skip  (nothing to inject through it)


def _hook_for(doc: Obj) -> str | None:
    group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
    version = doc["apiVersion"].rpartition("/")[2]
    for name, (groups, resources, versions) in HOOK_RULES.items():
        known = version in versions or "*" in versions
        if group in groups and doc["kind"].lower() + "s" in resources and known:
            return name
    return None


def _rules() -> dict[str, tuple[set[str], set[str], set[str]]]:
    vwc = next(o for o in render().objects if o["kind"] == "ValidatingWebhookConfiguration")
    return {
        w["name"].split(".")[0]: (
            {g for r in w["rules"] for g in r["apiGroups"]},
            {res for r in w["rules"] for res in r["resources"]},
            {v for r in w["rules"] for v in r["apiVersions"]},
        )
        for w in vwc["webhooks"]
    }


HOOK_RULES = _rules()
REAL = [m for m in realmanifests.manifests() if m.requests_mooncake]


@pytest.mark.parametrize("manifest", REAL, ids=[m.file for m in REAL])
def test_every_real_manifest_that_asks_for_mooncake_is_sent(
    manifest: realmanifests.Manifest,
) -> None:
    sent = []
    for doc in manifest.documents:
        hook = _hook_for(doc)
        if hook is not None and evaluate(expressions()[hook], doc):
            sent.append(doc["kind"])
    assert sent, f"{manifest.file}: no document would reach epguard"


# --- pods that carry epguard's own parts ----------------------------------------------------


# What a tenant could put on a pod of its own to have the controller list it each pass:
# every such pod is sent to /validate, which refuses it unless epguard signed it.
def _carrying(labels: dict[str, str] | None, notes: dict[str, str] | None) -> Obj:
    obj = pod(pod_spec(c(PLAIN_ARGS)))
    if labels is not None:
        obj["metadata"]["labels"] = labels
    if notes is not None:
        obj["metadata"]["annotations"] = notes
    return obj


def test_a_pod_carrying_epguards_label_or_signature_is_sent_without_the_flag() -> None:
    from epguard.webhook.engine.outcome import PROBED_LABEL
    from epguard.webhook.engine.signing import SIGNATURE_ANNOTATION

    pods = expressions()["pods"]
    for labels, notes in (
        ({PROBED_LABEL: "true"}, None),
        ({PROBED_LABEL: ""}, None),
        ({"app": "x", PROBED_LABEL: "false"}, None),
        (None, {SIGNATURE_ANNOTATION: "v1:forged"}),
        ({"app": "x"}, {"note": "x", SIGNATURE_ANNOTATION: ""}),
    ):
        assert evaluate(pods, _carrying(labels, notes)), (labels, notes)
    # Neither a look-alike nor the mutating webhooks' condition (no parts test there).
    for labels, notes in (
        (None, None),
        ({"epguard.io/probed-not": "true", "app": "x"}, {"epguard.io/probe": "x"}),
        ({}, {}),
    ):
        assert not evaluate(pods, _carrying(labels, notes)), (labels, notes)
    for name, expression in expressions().items():
        if name != "pods":
            assert not evaluate(expression, _carrying({PROBED_LABEL: "true"}, None)), name
