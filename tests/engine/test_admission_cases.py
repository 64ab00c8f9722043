"""Table-driven AdmissionReviews: request in, allowed/message/warnings out.

Every case runs through the engine; a few, one of each kind of answer, also through
the real HTTPS server, so the wire format (uid echo, status code, warnings) is covered.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from epguard.webhook.engine.policy import PolicyState, decide
from epguard.webhook.engine.review import AdmissionRequest
from tests.factory import (
    BAD_IMAGE_NORMALIZED,
    DIGEST,
    GOOD_IMAGE,
    MOONCAKE_ARGS,
    container,
    pod,
    pod_spec,
    review,
    template,
    workload,
)
from tests.servers import RunningServer

RULE = "[epguard rule sglang-0516-cu129-test]"
EXACT_DENIAL = (
    f'container "worker" (image {BAD_IMAGE_NORMALIZED}) requests --elastic-ep-backend mooncake, '
    "which this image cannot serve: the image's mooncake build has no ep_2_11_0 extension. "
    f"Fix: use lmsysorg/sglang:v0.5.18-cu130. {RULE}"
)


@dataclass
class Case:
    id: str
    review: dict[str, Any]
    allowed: bool
    message: list[str] = field(default_factory=list)  # substrings of status.message
    warnings: list[str] = field(default_factory=list)  # substrings, each in some warning
    no_warnings: bool = False


def bash(
    script: str, image: str = "lmsysorg/sglang:v0.5.16-cu129", flag: str = "-c"
) -> dict[str, Any]:
    return container(image=image, command=["/bin/bash", flag], args=[script])


def dry_run(r: dict[str, Any]) -> dict[str, Any]:
    return {**r, "request": {**r["request"], "dryRun": True}}


def args_pod(args: list[str], **kw: Any) -> dict[str, Any]:
    return pod([container(args=args, **kw)])


def dgd_v1alpha1() -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "dsr1", "namespace": "ml"},
        "spec": {
            "backendFramework": "sglang",
            "services": {
                "Frontend": {
                    "componentType": "frontend",
                    "extraPodSpec": {
                        "mainContainer": {
                            "image": "nvcr.io/nvidia/ai-dynamo/sglang-runtime:1.5.1",
                            "command": ["python3", "-m", "dynamo.frontend"],
                        }
                    },
                },
                "DecodeWorker": {
                    "componentType": "worker",
                    "multinode": {"nodeCount": 2},
                    "extraPodSpec": {
                        "mainContainer": {
                            "image": "lmsysorg/sglang:v0.5.16-cu129",
                            "workingDir": "/workspace",
                            "command": ["python3", "-m", "dynamo.sglang"],
                            "args": [
                                "--model-path",
                                "deepseek-ai/DeepSeek-R1",
                                "--tp",
                                "16",
                                "--enable-dp-attention",
                                "--elastic-ep-backend",
                                "mooncake",
                            ],
                        }
                    },
                },
            },
        },
    }


def dgd_v1beta1() -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1beta1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "dsr1", "namespace": "ml"},
        "spec": {
            "components": [
                {
                    "name": "frontend",
                    "type": "frontend",
                    "podTemplate": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "main",
                                    "image": "nvcr.io/nvidia/ai-dynamo/sglang-runtime:1.5.1",
                                }
                            ]
                        }
                    },
                },
                {
                    "name": "decode",
                    "type": "worker",
                    "replicas": 2,
                    "podTemplate": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "main",
                                    "image": "lmsysorg/sglang:v0.5.16-cu129",
                                    "command": [
                                        "python3",
                                        "-m",
                                        "dynamo.sglang_elastic_ep_bootstrap",
                                    ],
                                    "args": [
                                        "--model-path",
                                        "model",
                                        "--tp",
                                        "2",
                                        "--dp",
                                        "2",
                                        "--nnodes",
                                        "2",
                                        "--enable-dp-attention",
                                        "--elastic-ep-backend",
                                        "mooncake",
                                        "--moe-a2a-backend",
                                        "nixl",
                                        "--max-ep-size",
                                        "3",
                                    ],
                                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                                }
                            ]
                        }
                    },
                },
            ]
        },
    }


PROBE_INIT = {
    "name": "epguard-probe",
    "image": GOOD_IMAGE,
    "command": [
        "python3",
        "-I",
        "/epguard/probe",
        "--termination-log",
        "/dev/termination-log",
        "--",
    ],
    "args": ["python3", "-m", "sglang.launch_server", *MOONCAKE_ARGS],
}

STS_SCRIPT = """python3 -m sglang.launch_server --model /llm-folder \\
  --dist-init-addr sglang-master-pod:5000 --tensor-parallel-size 16 --nnodes 2 \\
  --node-rank $POD_INDEX --trust-remote-code --host 0.0.0.0 --port 8000 \\
  --elastic-ep-backend mooncake --expert-parallel-size 16
"""

CASES: list[Case] = [
    Case(
        "denies_mooncake_on_known_bad_tag_with_exact_message", review(pod()), False, [EXACT_DENIAL]
    ),
    Case("denies_equals_form", review(args_pod(["--elastic-ep-backend=mooncake"])), False, [RULE]),
    Case("denies_argparse_prefix", review(args_pod(["--elastic-ep-b", "mooncake"])), False, [RULE]),
    # No command: the args are the image entrypoint's (found by a review helper: the
    # first word was taken for a program, and the flag went unread).
    Case(
        "denies_args_without_a_command",
        review(
            pod(
                [
                    {
                        k: v
                        for k, v in container(
                            args=["--elastic-ep-backend", "mooncake", "--tp", "8"]
                        ).items()
                        if k != "command"
                    }
                ]
            )
        ),
        False,
        [RULE],
    ),
    # Text no command read places: read on the safe side.
    Case(
        "denies_eval_of_a_launch_line",
        review(
            pod(
                [
                    bash(
                        'CMD="python3 -m sglang.launch_server --elastic-ep-backend mooncake"; '
                        'eval "$CMD"'
                    )
                ]
            )
        ),
        False,
        [RULE],
    ),
    Case(
        "denies_set_then_exec_with_its_arguments",
        review(
            pod(
                [
                    bash(
                        "set -- --elastic-ep-backend mooncake; "
                        'exec python3 -m sglang.launch_server "$@"'
                    )
                ]
            )
        ),
        False,
        [RULE],
    ),
    Case(
        "warns_that_text_no_command_places_is_judged_by_rules_and_verdicts_only",
        review(
            pod(
                [
                    bash(
                        "cat > /shared/run.sh <<'EOF'\npython3 -m sglang.launch_server "
                        "--elastic-ep-backend mooncake\nEOF",
                        image="busybox:1.36",
                    )
                ]
            )
        ),
        True,
        warnings=["where epguard cannot tell what runs it", "by rules and learned verdicts only"],
    ),
    # A --config line beside an env value naming the flag: the config warning stays (the
    # probe reads the file), and no "no probe checks it" beside it (review helper).
    Case(
        "warns_of_the_config_file_beside_a_safe_side_reading",
        review(
            pod(
                [
                    container(
                        image="registry.example/sglang:1",
                        args=["--config", "/etc/sglang/c.yaml"],
                        env=[
                            {"name": "SGLANG_EXTRA_ARGS", "value": "--elastic-ep-backend mooncake"}
                        ],
                    )
                ]
            )
        ),
        True,
        warnings=["reads --config /etc/sglang/c.yaml"],
    ),
    Case(
        "denies_a_script_on_a_shells_stdin",
        review(
            pod(
                [
                    bash(
                        "bash <<'EOF'\npython3 -m sglang.launch_server "
                        "--elastic-ep-backend mooncake\nEOF"
                    )
                ]
            )
        ),
        False,
        [RULE],
    ),
    Case(
        "denies_value_in_any_case_with_spaces",
        review(args_pod(["--elastic-ep-backend", " MoonCake "])),
        False,
        [RULE],
    ),
    Case(
        "allows_backend_none",
        review(args_pod(["--elastic-ep-backend", "none"])),
        True,
        no_warnings=True,
    ),
    Case(
        "allows_backend_nixl",
        review(args_pod(["--elastic-ep-backend", "nixl"])),
        True,
        no_warnings=True,
    ),
    Case("allows_pod_without_the_flag", review(args_pod(["--tp", "8"])), True, no_warnings=True),
    Case(
        "last_occurrence_wins_like_argparse",
        review(args_pod(["--elastic-ep-backend", "mooncake", "--elastic-ep-backend", "none"])),
        True,
        no_warnings=True,
    ),
    Case(
        "denies_flag_inside_bash_c_script_with_continuations",
        review(pod([bash(STS_SCRIPT)])),
        False,
        [RULE],
    ),
    Case(
        "denies_flag_inside_sh_ec_script",
        review(
            pod(
                [
                    container(
                        command=["sh", "-ec"],
                        args=[
                            "cd /w && exec python3 -m sglang.launch_server "
                            "--elastic-ep-backend mooncake --tp 8"
                        ],
                    )
                ]
            )
        ),
        False,
        [RULE],
    ),
    Case(
        "denies_flag_inside_nested_shells",
        review(
            pod(
                [
                    container(
                        command=[
                            "sh",
                            "-c",
                            "exec bash -lc 'python3 -m sglang.launch_server "
                            "--elastic-ep-backend mooncake'",
                        ],
                        args=[],
                    )
                ]
            )
        ),
        False,
        [RULE],
    ),
    Case(
        "denies_value_expanded_from_literal_env",
        review(
            pod(
                [
                    container(
                        args=["--elastic-ep-backend", "$(EP_BACKEND)"],
                        env=[{"name": "EP_BACKEND", "value": "mooncake"}],
                    )
                ]
            )
        ),
        False,
        [RULE],
    ),
    Case(
        "denies_value_expanded_through_chained_env",
        review(
            pod(
                [
                    container(
                        args=["--elastic-ep-backend", "$(B)"],
                        env=[{"name": "A", "value": "moon"}, {"name": "B", "value": "$(A)cake"}],
                    )
                ]
            )
        ),
        False,
        [RULE],
    ),
    Case(
        "warns_when_value_comes_from_a_configmap",
        review(
            pod(
                [
                    container(
                        args=["--elastic-ep-backend", "$(EP_BACKEND)"],
                        env=[
                            {
                                "name": "EP_BACKEND",
                                "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}},
                            }
                        ],
                    )
                ]
            )
        ),
        True,
        warnings=["$(EP_BACKEND), whose value cannot be resolved at admission"],
    ),
    Case(
        "treats_dollar_dollar_as_an_escape",
        review(
            pod(
                [
                    container(
                        args=["--elastic-ep-backend", "$$(EP)"],
                        env=[{"name": "EP", "value": "mooncake"}],
                    )
                ]
            )
        ),
        True,
        warnings=["cannot be resolved"],
    ),
    Case(
        "denies_flags_a_script_takes_from_a_literal_env_value",
        review(
            pod(
                [
                    container(
                        command=["/bin/sh", "-c"],
                        args=["exec python3 -m sglang.launch_server $SGLANG_ARGS"],
                        env=[
                            {"name": "SGLANG_ARGS", "value": "--tp 8 --elastic-ep-backend mooncake"}
                        ],
                    )
                ]
            )
        ),
        False,
        [RULE],
    ),
    Case(
        "denies_a_braced_shell_variable_holding_the_value",
        review(
            pod(
                [
                    container(
                        command=["bash", "-c"],
                        args=["run --elastic-ep-backend ${EP:-x} --elastic-ep-backend ${EP}"],
                        env=[{"name": "EP", "value": "mooncake"}],
                    )
                ]
            )
        ),
        False,
        [RULE],
    ),
    Case(
        "warns_when_a_shell_variable_comes_from_a_secret",
        review(
            pod(
                [
                    container(
                        image="lmsysorg/sglang:v0.5.16-cu129",
                        command=["bash", "-c"],
                        args=["run --elastic-ep-backend $EP"],
                        env=[
                            {"name": "EP", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
                        ],
                    )
                ]
            )
        ),
        True,
        warnings=["passes --elastic-ep-backend $EP, whose value cannot be resolved"],
    ),
    Case(
        "denies_init_container",
        review(
            pod(
                [container(name="server", image=GOOD_IMAGE, args=["--tp", "1"])],
                init=[container(name="warmup")],
            )
        ),
        False,
        ['init container "warmup"', RULE],
    ),
    Case(
        "names_every_offending_container_in_one_message",
        review(pod([container(name="a"), container(name="b")])),
        False,
        ['container "a"', 'container "b"'],
    ),
    Case(
        "warns_unknown_image_without_probe",
        review(pod([container(image=GOOD_IMAGE)])),
        True,
        warnings=["add the epguard probe or enable injection"],
    ),
    Case(
        "stays_quiet_for_unknown_image_with_probe",
        review(pod([container(image=GOOD_IMAGE)], init=[PROBE_INIT])),
        True,
        no_warnings=True,
    ),
    Case(
        "stays_quiet_for_unknown_image_with_injected_per_worker_probe",
        review(
            pod(
                [container(image=GOOD_IMAGE)], init=[{**PROBE_INIT, "name": "epguard-probe-worker"}]
            )
        ),
        True,
        no_warnings=True,
    ),
    Case(
        "denies_digest_pinned_image",
        review(pod([container(image=f"registry.example.com/ml/sglang@{DIGEST}")])),
        False,
        ["[epguard rule pinned-digest-test]", f"registry.example.com/ml/sglang@{DIGEST}"],
    ),
    Case(
        "denies_tag_and_digest_by_tag_rule_and_digest_rule",
        review(pod([container(image=f"lmsysorg/sglang:v0.5.16-cu129@{DIGEST}")])),
        False,
        [RULE, "[epguard rule pinned-digest-test]"],
    ),
    Case(
        "warns_on_warn_rule",
        review(pod([container(image="nvcr.io/nvidia/ai-dynamo/sglang-runtime:1.6.1")])),
        True,
        warnings=["[epguard rule dynamo-16-warn-test, warn]", "which this image may not serve"],
    ),
    Case(
        "warns_that_a_config_file_cannot_be_seen",
        review(pod([container(image=GOOD_IMAGE, args=["--config", "/etc/sglang/ep.yaml"])])),
        True,
        warnings=["reads --config /etc/sglang/ep.yaml", "cannot be seen at admission"],
    ),
    Case(
        "warns_on_malformed_image_instead_of_crashing",
        review(pod([container(image="LMSYSORG/SGLang::bad")])),
        True,
        warnings=["image reference is not valid"],
    ),
    Case(
        "normalizes_fully_qualified_image",
        review(pod([container(image="docker.io/lmsysorg/sglang:v0.5.16-cu129")])),
        False,
        [RULE],
    ),
    Case(
        "normalizes_legacy_index_host",
        review(pod([container(image="index.docker.io/lmsysorg/sglang:v0.5.16-cu129")])),
        False,
        [RULE],
    ),
    Case(
        "ignores_the_probe_container_that_carries_the_worker_argv",
        review(
            pod(
                [container(image=GOOD_IMAGE, args=["--tp", "1"])],
                init=[{**PROBE_INIT, "image": "lmsysorg/sglang:v0.5.16-cu129"}],
            )
        ),
        True,
        no_warnings=True,
    ),
    Case(
        "denies_a_worker_merely_named_like_the_probe",
        review(pod([container(name="epguard-probe")])),
        False,
        [RULE],
    ),
    Case(
        "denies_an_init_container_named_like_the_probe_that_runs_the_worker_itself",
        review(
            pod(
                [container(image=GOOD_IMAGE, args=["--tp", "1"])],
                init=[container(name="epguard-probe")],
            )
        ),
        False,
        [RULE],
    ),
    Case(
        # Shaped like the probe call (a word ending in "probe" before "--"), but its own
        # command launches the worker: judged like any container (review helper; before,
        # only a signature check stood in its way, and none runs on a template or before
        # the controller writes the key).
        "denies_an_init_container_shaped_like_the_probe_call_that_launches_the_worker",
        review(
            pod(
                [container(image=GOOD_IMAGE, args=["--tp", "1"])],
                init=[
                    {
                        "name": "epguard-probe",
                        "image": "lmsysorg/sglang:v0.5.16-cu129",
                        "restartPolicy": "Always",
                        "command": [
                            "sh",
                            "-c",
                            "exec python3 -m sglang.launch_server "
                            "--model-path /m --elastic-ep-backend mooncake",
                            "probe",
                            "--",
                        ],
                    }
                ],
            )
        ),
        False,
        [RULE],
    ),
    *[
        Case(
            f"denies_{kind.lower()}_template",
            review(workload(kind)),
            False,
            [f'container "worker" in {where} (image {BAD_IMAGE_NORMALIZED})', RULE],
        )
        for kind, where in [
            ("Deployment", "spec.template"),
            ("StatefulSet", "spec.template"),
            ("DaemonSet", "spec.template"),
            ("ReplicaSet", "spec.template"),
            ("Job", "spec.template"),
            ("ReplicationController", "spec.template"),
            ("CronJob", "spec.jobTemplate.spec.template"),
            ("LeaderWorkerSet", "spec.leaderWorkerTemplate.leaderTemplate"),
        ]
    ],
    Case(
        "denies_leaderworkerset_worker_template_alone",
        review(
            workload("LeaderWorkerSet", name="x")
            | {"spec": {"leaderWorkerTemplate": {"workerTemplate": template()}}}
        ),
        False,
        ["spec.leaderWorkerTemplate.workerTemplate", RULE],
    ),
    Case(
        "denies_dynamo_v1alpha1_main_container",
        review(dgd_v1alpha1()),
        False,
        ['container "main" in spec.services.DecodeWorker.extraPodSpec', RULE],
    ),
    Case(
        "denies_dynamo_v1beta1_component_pod_template",
        review(dgd_v1beta1()),
        False,
        ['container "main" in spec.components[decode].podTemplate', RULE],
    ),
    Case("allows_delete", review(pod(), operation="DELETE"), True, no_warnings=True),
    Case("allows_connect", review(pod(), operation="CONNECT"), True, no_warnings=True),
    Case(
        "allows_unknown_kinds",
        review(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "data": {"x": "--elastic-ep-backend mooncake"},
            }
        ),
        True,
        no_warnings=True,
    ),
    Case(
        "allows_status_subresource",
        review(pod(), operation="UPDATE", old=pod(), sub_resource="status"),
        True,
        no_warnings=True,
    ),
    Case(
        "judges_ephemeral_container_subresource",
        review(
            pod()
            | {
                "spec": pod_spec([container(image=GOOD_IMAGE, args=[])])
                | {"ephemeralContainers": [container(name="debug")]}
            },
            operation="UPDATE",
            old=pod([container(image=GOOD_IMAGE, args=[])]),
            sub_resource="ephemeralcontainers",
        ),
        False,
        ['ephemeral container "debug"', RULE],
    ),
    Case(
        "denies_an_update_that_introduces_a_bad_image",
        review(
            workload("Deployment"),
            operation="UPDATE",
            old=workload("Deployment", template(pod_spec([container(image=GOOD_IMAGE)]))),
        ),
        False,
        [RULE],
    ),
    Case(
        "does_not_block_an_update_of_an_already_bad_object",
        review(workload("Deployment"), operation="UPDATE", old=workload("Deployment")),
        True,
        warnings=["already present before this update; not blocking it"],
    ),
    Case("denies_dry_run_too", dry_run(review(pod())), False, [RULE]),
    Case(
        "tolerates_wrong_types_everywhere",
        review(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"annotations": ["x"]},
                "spec": {
                    "containers": [
                        "x",
                        5,
                        None,
                        {
                            "name": 7,
                            "image": 9,
                            "command": "sh",
                            "args": [1, None, "--elastic-ep-backend"],
                            "env": "nope",
                        },
                    ],
                    "initContainers": {"a": 1},
                },
            }
        ),
        True,
    ),
    Case("tolerates_a_null_object", review(None, kind=("", "v1", "Pod")), True, no_warnings=True),
    Case(
        "tolerates_dynamo_with_wrong_shapes",
        review(
            {
                "apiVersion": "nvidia.com/v1alpha1",
                "kind": "DynamoGraphDeployment",
                "spec": {
                    "services": {
                        "a": None,
                        "b": {"extraPodSpec": "x"},
                        "c": {"extraPodSpec": {"mainContainer": ["x"]}},
                    },
                    "components": [None, {"podTemplate": 3}],
                },
            }
        ),
        True,
        no_warnings=True,
    ),
]


def _check(case: Case, allowed: bool, message: str | None, warnings: list[str]) -> None:
    assert allowed is case.allowed, (message, warnings)
    for part in case.message:
        assert message is not None and part in message, message
    for part in case.warnings:
        assert any(part in w for w in warnings), warnings
    if case.no_warnings:
        assert warnings == []


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_engine_decides(case: Case, state: PolicyState) -> None:
    req = AdmissionRequest.model_validate(copy.deepcopy(case.review)["request"])
    d = decide(req, state)
    _check(case, d.allowed, d.message, list(d.warnings))


# The decision is tested once, at the lowest layer (the engine, above). Over HTTPS only
# what the wire adds: each kind of answer once (refused with the exact message, admitted
# quietly, admitted with warnings, a skipped operation, an UPDATE, a dry run, a null
# object), so the encoding of every field the API server reads is covered.
WIRE = (
    "denies_mooncake_on_known_bad_tag_with_exact_message",
    "allows_pod_without_the_flag",
    "warns_on_warn_rule",
    "names_every_offending_container_in_one_message",
    "allows_delete",
    "does_not_block_an_update_of_an_already_bad_object",
    "denies_dry_run_too",
    "tolerates_a_null_object",
)
WIRE_CASES = [c for c in CASES if c.id in WIRE]


def test_every_wire_case_exists() -> None:
    assert sorted(c.id for c in WIRE_CASES) == sorted(WIRE)


@pytest.mark.parametrize("case", WIRE_CASES, ids=[c.id for c in WIRE_CASES])
def test_server_answers(case: Case, server: RunningServer) -> None:
    with server.client() as client:
        r = client.post("/validate", json=case.review)
    assert r.status_code == 200
    body = r.json()
    resp = body["response"]
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    assert resp["uid"] == case.review["request"]["uid"]
    status = resp.get("status")
    if not case.allowed:
        assert status["code"] == 403 and status["reason"] == "Forbidden"
    _check(case, resp["allowed"], status["message"] if status else None, resp.get("warnings") or [])
