"""Finding `--elastic-ep-backend mooncake` in what a container will run, and fuzzing it."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from webhook.argv import analyse, container_argv, env_mapping, expand, flatten


def requested(*argv: str) -> bool:
    return analyse(tuple(argv)).requests_mooncake


@pytest.mark.parametrize(
    "argv",
    [
        ["python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "mooncake"],
        ["--elastic-ep-backend=mooncake"],
        ["--elastic-ep-backend=MOONCAKE"],
        ["--elastic-ep-backend", "\tmooncake\n"],
        ["--elastic-ep-b", "mooncake"],
        ["--elastic-ep-back=mooncake"],
        ["--elastic", "mooncake"],
        ["sglang", "serve", "m", "--elastic-ep-backend", "mooncake"],
        ["python3", "-m", "dynamo.sglang", "--elastic-ep-backend", "mooncake"],
        ["bash", "-c", "python3 -m sglang.launch_server --elastic-ep-backend mooncake"],
        ["/bin/sh", "-ec", "set -x; exec python3 -m x --elastic-ep-backend=mooncake"],
        ["bash", "--login", "-c", "run --elastic-ep-backend mooncake"],
        ["busybox", "sh", "-c", "run --elastic-ep-backend mooncake"],
        ["sh", "-c", "a \\\n --elastic-ep-backend \\\n mooncake"],
        ["sh", "-c", "sh -c 'bash -c \"x --elastic-ep-backend mooncake\"'"],
        ["sh", "-c", "echo hi; x --elastic-ep-backend mooncake && y"],
        ["sh", "-c", "x --elastic-ep-backend 'mooncake"],  # unbalanced quote: still seen
    ],
)
def test_detects_the_flag_in_every_form_argparse_accepts(argv: list[str]) -> None:
    assert requested(*argv)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["python3", "-m", "sglang.launch_server", "--tp", "8"],
        ["--elastic-ep-backend", "none"],
        ["--elastic-ep-backend", "nixl"],
        ["--elastic-ep-backend"],
        ["--elastic-ep-backend", "--tp", "mooncake"],
        ["--elastic-ep-backendx", "mooncake"],
        ["--elast", "mooncake"],
        ["--elastic-ep-rejoin", "mooncake"],
        ["--moe-a2a-backend", "mooncake"],
        ["-elastic-ep-backend", "mooncake"],
        ["--elastic-ep-backend", "mooncake", "--elastic-ep-backend", "none"],
        ["sh", "-c", "# --elastic-ep-backend mooncake"],
        ["sh", "-c", "run", "--elastic-ep-backend", "mooncake"],  # $0 $1 of the script
        ["echo", "--elastic-ep-backend mooncake"],
    ],
)
def test_does_not_detect_what_would_not_select_mooncake(argv: list[str]) -> None:
    assert not requested(*argv)


def test_huge_argv_and_scripts_are_still_judged() -> None:
    filler = "x" * 200_000
    many = ["--tp", "8"] * 50_000
    assert requested("python3", *many, "--elastic-ep-backend", "mooncake")
    assert requested("python3", filler, "--elastic-ep-backend", "mooncake")
    assert requested("sh", "-c", f"echo {filler}; exec run --elastic-ep-backend 'mooncake'")
    assert not requested("sh", "-c", f"echo {filler}; exec run --elastic-ep-backend none")


def test_any_launch_line_in_a_script_counts_on_its_own() -> None:
    script = "x --elastic-ep-backend mooncake; y --elastic-ep-backend none"
    assert requested("sh", "-c", script)


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


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(
        st.sampled_from(["--tp", "8", "--model-path", "/m", "--trust-remote-code"]), max_size=6
    ),
    after=st.lists(
        st.sampled_from(["--tp", "8", "--host", "0.0.0.0", "--enable-dp-attention"]), max_size=6
    ),
    spelling=st.sampled_from(["--elastic-ep-backend", "--elastic-ep-backe", "--elastic-ep-b"]),
    equals=st.booleans(),
    shell=st.sampled_from([None, "sh", "/bin/bash"]),
)
def test_detects_the_flag_wherever_it_sits(
    before: list[str], after: list[str], spelling: str, equals: bool, shell: str | None
) -> None:
    flag = [f"{spelling}=mooncake"] if equals else [spelling, "mooncake"]
    launch = ["python3", "-m", "sglang.launch_server", *before, *flag, *after]
    argv = launch if shell is None else [shell, "-c", shlex.join(launch)]
    assert requested(*argv)
    assert "mooncake" in " ".join(flatten(argv))


def test_a_script_variable_can_add_the_flag_but_is_not_needed_once_it_is_settled() -> None:
    from webhook.argv import analyse_container

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
