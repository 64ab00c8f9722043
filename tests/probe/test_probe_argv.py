"""Whether a worker argv requests mooncake elastic EP, as SGLang's argparse would read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from probe import request

LAUNCH = ["python3", "-m", "sglang.launch_server", "--model-path", "m"]


# --- spellings argparse accepts -----------------------------------------------------------

@pytest.mark.parametrize("flag", [
    ["--elastic-ep-backend", "mooncake"],
    ["--elastic-ep-backend=mooncake"],
    ["--elastic-ep-b", "mooncake"],
    ["--elastic-ep-ba=mooncake"],
    ["--elastic-ep-backend", " MoonCake "],
])
def test_detects_mooncake_in_every_spelling_argparse_accepts(flag):
    req = request.detect([*LAUNCH, *flag])
    assert req.requested
    assert req.where == "argv"


@pytest.mark.parametrize("prefix", ["--elastic-ep-", "--elastic", "--el"])
def test_checks_a_prefix_ambiguous_only_among_the_elastic_ep_options(prefix):
    # SGLang 0.5.9/0.5.10 had only --elastic-ep-backend and accept these; later releases,
    # with --elastic-ep-rejoin, -join-mode, ..., refuse to start. Checking is the safe side.
    assert request.detect([*LAUNCH, prefix, "mooncake"]).requested


@pytest.mark.parametrize("prefix", ["--e", "--en"])
def test_ignores_a_prefix_that_also_names_other_options(prefix):
    # --e and --en also start --enable-dp-attention: argparse would reject them.
    assert not request.detect([*LAUNCH, prefix, "mooncake"]).requested


def test_last_occurrence_wins_like_argparse():
    assert not request.detect(
        [*LAUNCH, "--elastic-ep-backend", "mooncake", "--elastic-ep-backend", "none"]).requested
    assert request.detect(
        [*LAUNCH, "--elastic-ep-backend", "nixl", "--elastic-ep-backend=mooncake"]).requested


@pytest.mark.parametrize("value", ["none", "nixl", "mooncake-cpu", ""])
def test_other_backends_are_not_a_request(value):
    req = request.detect([*LAUNCH, "--elastic-ep-backend", value])
    assert not req.requested
    assert req.backend == value


def test_a_flag_without_a_value_is_not_a_request():
    assert not request.detect([*LAUNCH, "--elastic-ep-backend"]).requested


# --- shells -------------------------------------------------------------------------------

def test_reads_the_flag_inside_a_bash_c_script():
    script = ("cd /workspace && exec python3 -m sglang.launch_server --tp 16 \\\n"
              "  --nnodes 2 --node-rank $POD_INDEX --elastic-ep-backend mooncake\n")
    req = request.detect(["/bin/bash", "-c", script])
    assert req.requested
    assert req.where == "sh -c script"


def test_reads_combined_shell_options_and_nested_shells():
    inner = "python3 -m dynamo.sglang --elastic-ep-backend=mooncake --enable-dp-attention"
    req = request.detect(["sh", "-ec", f"echo start; exec bash -lc '{inner}'"])
    assert req.requested
    assert req.dp_attention


def test_reads_the_script_after_shell_options_that_take_a_value():
    req = request.detect(["bash", "-o", "pipefail", "-c",
                          "python3 -m sglang.launch_server --elastic-ep-backend mooncake | tee l"])
    assert req.requested


def test_a_commented_out_flag_in_a_script_is_not_a_request():
    script = "python3 -m sglang.launch_server --tp 2  # --elastic-ep-backend mooncake"
    assert not request.detect(["bash", "-c", script]).requested


def test_a_quoted_value_in_a_script_is_unquoted():
    req = request.detect(["sh", "-c", "python3 -m x --elastic-ep-backend 'mooncake'"])
    assert req.requested


# --- DP attention -------------------------------------------------------------------------

def test_notes_enable_dp_attention():
    req = request.detect([*LAUNCH, "--enable-dp-attention", "--elastic-ep-backend", "mooncake"])
    assert req.dp_attention
    assert "DP attention on" in req.describe()


@pytest.mark.parametrize(("size", "on"), [("1", False), ("2", True), ("8", True)])
def test_notes_attn_dp_size_above_one(size, on):
    req = request.detect([*LAUNCH, "--attn-dp-size", size, "--elastic-ep-backend", "mooncake"])
    assert req.dp_attention is on


# --- --config YAML ------------------------------------------------------------------------

def test_reads_the_backend_from_a_config_yaml(tmp_path: Path):
    cfg = tmp_path / "sglang.yaml"
    cfg.write_text(
        "model-path: m\nelastic_ep_backend: \"mooncake\"  # EP\nenable-dp-attention: true\n")
    req = request.detect([*LAUNCH, "--config", str(cfg)])
    assert req.requested
    assert req.where == f"config {cfg}"
    assert req.dp_attention


def test_the_command_line_overrides_the_config_file(tmp_path: Path):
    cfg = tmp_path / "sglang.yml"
    cfg.write_text("elastic-ep-backend: mooncake\n")
    assert not request.detect(
        [*LAUNCH, "--config", str(cfg), "--elastic-ep-backend", "none"]).requested


def test_a_missing_config_file_is_noted_not_fatal(tmp_path: Path):
    req = request.detect([*LAUNCH, "--config", str(tmp_path / "absent.yaml")])
    assert not req.requested
    assert req.notes


def test_a_config_that_is_not_yaml_is_ignored_like_sglang_does(tmp_path: Path):
    cfg = tmp_path / "sglang.json"
    cfg.write_text("elastic-ep-backend: mooncake\n")
    assert not request.detect([*LAUNCH, "--config", str(cfg)]).requested


def test_nested_yaml_keys_are_not_top_level_flags():
    cfg = request.parse_simple_yaml("server:\n  elastic-ep-backend: mooncake\nport: 1\n")
    assert "elastic-ep-backend" not in cfg
    assert cfg["port"] == "1"
