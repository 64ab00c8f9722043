"""Finding `--elastic-ep-backend mooncake` in what a container will run, and fuzzing it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epguard.webhook.engine.argv import (
    MAX_EXPANSION,
    analyse,
    analyse_container,
    container_argv,
    env_mapping,
    expand,
)


def requested(*argv: str) -> bool:
    return analyse(tuple(argv)).requests_mooncake


# How the shell and SGLang read a line is tested once, on the reader itself
# (tests/probe/test_cmdline.py); here only what Kubernetes adds.


def test_the_webhook_answers_with_the_reader_the_probe_uses() -> None:
    line = "python3 -m sglang.launch_server --enable-dp-lm-head --elastic-ep-backend mooncake"
    assert requested("bash", "-o", "pipefail", "-c", line + " 2>&1 | tee /tmp/log")
    assert requested("busybox", "sh", "-c", line)
    assert not requested("filebeat", "--elasticsearch-url", "http://es:9200")


def test_a_flag_the_shell_joins_from_quoted_pieces_is_judged() -> None:
    # `-''-elastic-ep-backend` is --elastic-ep-backend once the shell removes the quotes.
    line = "exec python3 -m sglang.launch_server -''-elastic-ep-backend mooncake"
    assert requested("sh", "-c", line)
    assert requested("bash", "-lc", line.replace("-''-", "$'\\x2d'-"))
    env = [{"name": "RUN", "value": line}]
    assert analyse_container({"command": ["sh", "-c", "$(RUN)"], "env": env}).requests_mooncake
    # With no shell the quotes are part of the word, which SGLang does not know.
    assert not requested("python3", "-m", "sglang.launch_server", "-''-elastic-ep-backend")


def test_reports_config_file_and_unresolved_values() -> None:
    r = analyse(("python3", "-m", "sglang.launch_server", "--config=/c.yaml"))
    assert r.config_file == "/c.yaml" and r.looks_like_sglang and not r.requests_mooncake
    r = analyse(("sh", "-c", "x --elastic-ep-backend $BACKEND"))
    assert r.unresolved_value == "$BACKEND" and not r.requests_mooncake


def test_expands_like_the_kubelet() -> None:
    env = env_mapping(
        [
            {"name": "A", "value": "moon"},
            {"name": "B", "value": "$(A)cake"},
            {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": 5, "value": "x"},
            "junk",
        ]
    )
    assert env == {"A": "moon", "B": "mooncake"}
    assert expand("$(B)", env) == "mooncake"
    assert expand("$(S)", env) == "$(S)"  # unknown stays as written
    assert expand("$$(B)", env) == "$(B)"  # escaped
    assert expand("$B $(", env) == "$B $("


@pytest.mark.parametrize("name", [".EP", "-EP", "1EP", "EP:X", "EP BACKEND", "EP"])
def test_expands_every_name_the_kubelet_does(name: str) -> None:
    """The kubelet takes everything between "$(" and the next ")" as the name; env names
    may start with "." or "-", and relaxed validation (on by default since 1.32) allows
    any printable character but "=". A narrower pattern left the value unresolved: the
    pod was admitted with a warning, past rules and verdicts (found by a review helper)."""
    c = {
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": ["--elastic-ep-backend", f"$({name})"],
        "env": [{"name": name, "value": "mooncake"}],
    }
    report = analyse_container(c)
    assert report.requests_mooncake and report.unresolved_value is None


def test_builds_argv_from_command_and_args_leniently() -> None:
    c = {"command": ["sh", 5], "args": [None, "$(X)"], "env": [{"name": "X", "value": "1"}]}
    assert container_argv(c) == ("sh", "5", "1")
    assert container_argv({"command": "sh", "args": {"a": 1}}) == ()


words = st.sampled_from(
    [
        "python3",
        "-m",
        "sglang.launch_server",
        "--tp",
        "8",
        "sh",
        "bash",
        "-c",
        "-ec",
        ";",
        "&&",
        "--elastic-ep-backend",
        "--elastic-ep-b",
        "--elastic-ep-backend=mooncake",
        "mooncake",
        "none",
        "'",
        '"',
        "\\",
        "\n",
        "$(X)",
        "$$",
        "#",
        "--config",
        "--",
        "|",
        "(",
        ")",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(words | st.text(max_size=30), max_size=30),
    st.dictionaries(st.sampled_from(["X", "A_B", "EP"]), words | st.text(max_size=20), max_size=3),
)
def test_never_crashes_on_any_argv(argv: list[str], env: dict[str, str]) -> None:
    report = analyse(tuple(argv), tuple(sorted(env.items())))
    assert isinstance(report.requests_mooncake, bool)


def test_a_script_variable_can_add_the_flag_but_is_not_needed_once_it_is_settled() -> None:
    via_env = {
        "command": ["sh", "-c"],
        "args": ["run --elastic-ep-backend none $EXTRA"],
        "env": [{"name": "EXTRA", "value": "--elastic-ep-backend mooncake"}],
    }
    assert analyse_container(via_env).requests_mooncake
    # Settled on the command line: env is not consulted, which errs towards judging.
    settled = {
        "command": ["sh", "-c"],
        "args": ["run --elastic-ep-backend mooncake $EXTRA"],
        "env": [{"name": "EXTRA", "value": "--elastic-ep-backend none"}],
    }
    assert analyse_container(settled).requests_mooncake


def test_a_doubling_env_chain_stops_at_the_budget_and_is_judged_requested() -> None:
    # 1.5 KB of review that would expand to gigabytes: each variable doubles the last.
    env = [{"name": "V0", "value": "--elastic-ep-backend mooncake "}]
    env += [{"name": f"V{i}", "value": f"$(V{i - 1})$(V{i - 1})"} for i in range(1, 40)]
    container = {
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": ["$(V39)"],
        "env": env,
    }
    report = analyse_container(container)
    assert report.requests_mooncake and report.over_budget
    # Without the flag anywhere, the same chain is simply nothing to see.
    env[0]["value"] = "x"
    assert not analyse_container(container).requests_mooncake
    assert MAX_EXPANSION <= 1024 * 1024


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=12)
    | st.sampled_from(["--elastic-ep-backend", "mooncake", "sh", "-c", "$(A)", "$A", "name"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "name",
                    "value",
                    "valueFrom",
                    "command",
                    "args",
                    "env",
                    "image",
                    "spec",
                    "roles",
                    "template",
                    "containers",
                    "roleTemplates",
                    "templateRef",
                    "templatePatch",
                    "leaderWorkerSet",
                    "patchLeaderTemplate",
                    "components",
                    "customComponentsPattern",
                    "patch",
                    "standalonePattern",
                    "runner",
                    "engineConfig",
                ]
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_no_container_shape_crashes_the_reader(container: object) -> None:
    from epguard.webhook.engine.argv import analyse_container

    if isinstance(container, dict):
        assert isinstance(analyse_container(container).requests_mooncake, bool)


@settings(max_examples=300, deadline=None)
@given(
    json_values,
    st.sampled_from(
        [
            ("", "Pod"),
            ("apps", "Deployment"),
            ("workloads.x-k8s.io", "RoleBasedGroup"),
            ("disaggregatedset.x-k8s.io", "DisaggregatedSet"),
            ("ome.io", "ClusterServingRuntime"),
            ("nvidia.com", "DynamoGraphDeployment"),
            ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"),
        ]
    ),
)
def test_no_object_shape_crashes_the_template_walk(obj: object, kind: tuple[str, str]) -> None:
    from epguard.webhook.engine.workloads import BUILTIN

    views = BUILTIN.pod_templates(kind[0], kind[1], obj)
    assert views is not None
    for v in views:
        for c in v.containers:
            assert isinstance(c.name, str)


def test_wrong_typed_names_found_in_review_do_not_crash() -> None:
    from epguard.webhook.engine.workloads import BUILTIN

    c = {"args": ["sh", "-c", "x --elastic-ep-backend $A"], "env": [{"name": ["A"], "value": "m"}]}
    assert not analyse_container(c).requests_mooncake
    for spec in (
        {"roleTemplates": [{"name": ["a"]}], "roles": []},
        {"roles": [{"standalonePattern": {"templateRef": {"name": {"x": 1}}}}]},
    ):
        views = BUILTIN.pod_templates("workloads.x-k8s.io", "RoleBasedGroup", {"spec": spec})
        assert views is not None and all(not v.containers for v in views)


def test_a_safe_side_reading_of_the_argv_alone_still_reads_the_env() -> None:
    """The argv alone read as a request only on the safe side (a here-document names the
    flag); the env makes the launch line a real one: it is a worker, probed and gated."""
    c = {
        "name": "w",
        "image": "x",
        "command": ["bash", "-c"],
        "args": ["cat <<EOF >/x\n--elastic-ep-backend mooncake\nEOF\n"
                 "python3 -m sglang.launch_server $FLAGS"],
        "env": [{"name": "FLAGS", "value": "--elastic-ep-backend mooncake"}],
    }  # fmt: skip
    report = analyse_container(c)
    assert report.worker and not report.unplaced


def _rbg_workers(spec: dict[str, object]) -> list[tuple[str, str | None]]:
    """(where, image) of each container of a RoleBasedGroup that asks for mooncake."""
    from epguard.webhook.engine.workloads import BUILTIN

    views = BUILTIN.pod_templates("workloads.x-k8s.io", "RoleBasedGroup", {"spec": spec})
    assert views is not None
    return [
        (v.where, c.image)
        for v in views
        for c in v.containers
        if analyse_container(c.raw).requests_mooncake
    ]


def test_every_rolebasedgroup_placement_of_a_launch_line_is_read() -> None:
    # sgl-project/rbg: v1alpha1 leaderWorkerSet patches over a templateRef'd role template
    # with a templatePatch (three layers, strategic merge), components; v1alpha2
    # customComponentsPattern. Each was read by neither the engine nor the CEL.
    image = "lmsysorg/sglang:v0.5.21"
    launch = ["python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "$(EP)"]
    base = {
        "spec": {
            "containers": [
                {"name": "sglang", "image": image, "env": [{"name": "EP", "value": "mooncake"}]}
            ]
        }
    }
    patch = {
        "spec": {
            "containers": [
                {"name": "sglang", "command": launch, "env": [{"name": "OTHER", "value": "x"}]}
            ]
        }
    }
    v1 = {
        "roleTemplates": [{"name": "base", "template": base}],
        "roles": [
            {
                "name": "prefill",
                "templateRef": {"name": "base"},
                "leaderWorkerSet": {"size": 2, "patchLeaderTemplate": patch},
            }
        ],
    }
    # The template's env survives the patch's own env (merged by name): $(EP) is known.
    assert _rbg_workers(v1) == [("spec.roles[prefill].leaderWorkerSet.patchLeaderTemplate", image)]
    v1_patch = {
        "roleTemplates": [{"name": "base", "template": base}],
        "roles": [{"name": "decode", "templateRef": {"name": "base"}, "templatePatch": patch}],
    }
    assert _rbg_workers(v1_patch) == [("spec.roles[decode].templateRef", image)]
    whole = {
        "spec": {
            "containers": [
                {"name": "e", "image": image, "args": ["--elastic-ep-backend", "mooncake"]}
            ]
        }
    }
    components = {"roles": [{"name": "r", "components": [{"name": "e", "template": whole}]}]}
    assert _rbg_workers(components) == [("spec.roles[r].components[0]", image)]
    custom = {
        "roles": [
            {
                "name": "r",
                "customComponentsPattern": {
                    "components": [{"name": "e", "size": 1, "template": whole}]
                },
            }
        ]
    }
    assert _rbg_workers(custom) == [("spec.roles[r].customComponentsPattern.components[0]", image)]


def test_an_env_entry_without_a_value_is_the_empty_string() -> None:
    # The API server stores `value: ""` without the field (omitempty); the kubelet sets
    # the variable to "". Unknown here, the line was unresolved (a warning) while
    # `epguard check` of the manifest as written refused it.
    args = ["python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "moon$(E)cake"]
    stored = analyse_container({"name": "w", "image": "x", "args": args, "env": [{"name": "E"}]})
    assert stored.requests_mooncake and stored.unresolved_value is None
    script = ["sh", "-c", "exec python3 -m sglang.launch_server --elastic-ep-backend moon${E}cake"]
    empty = [{"name": "E"}]
    in_script = analyse_container({"name": "w", "image": "x", "args": script, "env": empty})
    assert in_script.requests_mooncake and in_script.unresolved_value is None
    secret = {"name": "E", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
    hidden = analyse_container({"name": "w", "image": "x", "args": args, "env": [secret]})
    assert not hidden.requests_mooncake and hidden.unresolved_value is not None
