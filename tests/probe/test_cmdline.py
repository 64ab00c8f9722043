"""The one reader of a worker's command line (probe/cmdline.py + probe/shell.py).

Everything here reads real SGLang option tables (probe/sglang_options.json, extracted from
real releases by scripts/sglang_options.py); tests/probe/test_sglang_parser.py checks the
reader against SGLang's own parser.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from epguard.probe import cmdline, shell

UNPLACED = cmdline.UNPLACED
SERVER = "python3 -m sglang.launch_server"
LAUNCH = ["python3", "-m", "sglang.launch_server", "--model-path", "m"]
NEWEST = cmdline.tables()[-1].release
OLDEST = cmdline.tables()[0].release


def read(argv: list[str], **kw: object) -> cmdline.Reading:
    return cmdline.read(argv, **kw)  # type: ignore[arg-type]


# --- what SGLang's parser decides ------------------------------------------------------------


@pytest.mark.parametrize(
    "flag",
    [
        ["--elastic-ep-backend", "mooncake"],
        ["--elastic-ep-backend=mooncake"],
        ["--elastic-ep-b", "mooncake"],
        ["--elastic-ep-ba=mooncake"],
    ],
)
def test_reads_every_spelling_argparse_accepts(flag: list[str]) -> None:
    r = read([*LAUNCH, *flag], release=NEWEST)
    assert r.requested
    assert r.where == "argv"
    assert r.launcher == "sglang.launch_server"


def test_a_flag_without_a_value_does_not_swallow_the_backend() -> None:
    # The bug this reader replaces: --enable-dp-lm-head was taken to need a value.
    argv = [
        *LAUNCH,
        "--enable-dp-attention",
        "--dp",
        "4",
        "--enable-dp-lm-head",
        "--elastic-ep-backend",
        "mooncake",
        "--moe-dense-tp-size",
        "1",
    ]
    for table in cmdline.tables():
        assert read(argv, release=table.release).requested, table.release


def test_an_option_missing_its_value_makes_sglang_refuse_and_is_read_leniently() -> None:
    # argparse: "--chunked-prefill-size: expected one argument"; SGLang would not start.
    argv = [*LAUNCH, "--chunked-prefill-size", "--elastic-ep-backend", "mooncake"]
    r = read(argv, release=NEWEST)
    assert r.refusals and "expected one argument" in r.refusals[0][1]
    assert r.requested and r.releases == ("lenient",)


def test_last_occurrence_wins_like_argparse() -> None:
    assert not read(
        [*LAUNCH, "--elastic-ep-backend", "mooncake", "--elastic-ep-backend", "none"]
    ).requested
    assert read(
        [*LAUNCH, "--elastic-ep-backend", "nixl", "--elastic-ep-backend=mooncake"]
    ).requested


def test_double_dash_ends_the_options() -> None:
    assert not read([*LAUNCH, "--", "--elastic-ep-backend", "mooncake"]).requested


@pytest.mark.parametrize("value", ["none", "nixl", "mooncake-cpu", ""])
def test_other_backends_are_not_a_request(value: str) -> None:
    r = read([*LAUNCH, "--elastic-ep-backend", value])
    assert not r.requested
    assert r.values == [value]


def test_a_prefix_counts_where_one_release_accepts_it() -> None:
    # Only --elastic-ep-backend starts with "--el" in the oldest table, so that release
    # reads "--el mooncake" as the flag; newer releases refuse it as ambiguous.
    assert cmdline.min_prefix() == "--el"
    r = read([*LAUNCH, "--el", "mooncake"])
    assert r.requested and OLDEST in r.releases
    assert any(release == NEWEST for release, _ in r.refusals)
    # In the probe, the installed release decides: the newest refuses to start.
    exact = read([*LAUNCH, "--el", "mooncake"], release=NEWEST)
    assert exact.refusals and exact.refusals[0][0] == NEWEST


@pytest.mark.parametrize(
    "word", ["--e", "--en", "--elasticsearch-url", "-elastic-ep-backend", "--elastic-ep-backendx"]
)
def test_words_no_release_reads_as_the_flag(word: str) -> None:
    assert not read([*LAUNCH, word, "mooncake"]).requested


def test_where_every_release_refuses_the_line_it_is_read_leniently() -> None:
    # "--pp=1" is ambiguous in every table: SGLang would not start; the safe side.
    r = read([*LAUNCH, "--pp=1", "--elastic-ep-backend=mooncake"])
    assert r.requested and r.releases == ("lenient",)
    assert len(r.refusals) == len(cmdline.tables())


def test_a_release_without_a_table_uses_the_nearest_older_one_and_says_so() -> None:
    table, note = cmdline.table_for("9.9.9")
    assert table.release == NEWEST and note is not None and "newer" in note
    table, note = cmdline.table_for("0.5.19")
    assert table.release == "0.5.18" and note is not None
    assert cmdline.table_for(NEWEST) == (cmdline.tables()[-1], None)
    r = read([*LAUNCH, "--elastic-ep-backend", "mooncake"], release="9.9.9")
    assert r.requested and any("newer" in n for n in r.notes)


# --- launchers and wrappers -------------------------------------------------------------------

FLAG = "--elastic-ep-backend mooncake"


@pytest.mark.parametrize(
    "line",
    [
        f"python -m sglang.launch_server --tp 8 {FLAG}",
        f"/app/venv/bin/python3.11 -u -X dev -m sglang.launch_server {FLAG}",
        f"sglang serve --model-path m {FLAG}",
        f"/usr/local/bin/sglang serve {FLAG}",
        f"python3 -m dynamo.sglang {FLAG}",
        f"python3 -m dynamo.sglang.elastic_ep_bootstrap {FLAG}",
        f"exec python3 -m sglang.launch_server {FLAG}",
        f"env -u HOME A=1 B=2 python3 -m sglang.launch_server {FLAG}",
        f"CUDA_VISIBLE_DEVICES=0,1 nohup sglang serve {FLAG} > /tmp/log 2>&1 &",
        f"timeout -s KILL 3600 python3 -m sglang.launch_server {FLAG}",
        f"numactl --cpunodebind=0 -m 0 python3 -m sglang.launch_server {FLAG}",
        f"taskset -c 0-31 python3 -m sglang.launch_server {FLAG}",
        f"exec env X=1 nohup numactl -N 0 taskset 0xff python3 -m sglang.launch_server {FLAG}",
    ],
)
def test_reads_every_launcher_and_wrapper(line: str) -> None:
    assert read(shlex.split(line.split(" > ")[0])).requested
    assert read(["sh", "-c", line]).requested


@pytest.mark.parametrize(
    "shell_argv",
    [
        ["sh", "-c"],
        ["/bin/bash", "-c"],
        ["bash", "-lc"],
        ["bash", "-euxc"],
        ["dash", "-c"],
        ["bash", "-o", "pipefail", "-c"],
        ["busybox", "sh", "-c"],
        ["/bin/busybox", "ash", "-c"],
        ["bash", "--login", "-c"],
        ["sh", "-e", "-c"],
    ],
)
def test_reads_the_script_of_every_shell_form(shell_argv: list[str]) -> None:
    script = f"python3 -m sglang.launch_server {FLAG} 2>&1 | tee /tmp/log"
    r = read([*shell_argv, script])
    assert r.requested
    assert r.where == "sh -c script"


def test_any_launch_line_of_a_script_counts() -> None:
    script = (
        f"python3 -m sglang.launch_server --elastic-ep-backend none &\n"
        f"sleep 1 && python3 -m sglang.launch_server {FLAG}\n"
    )
    assert read(["bash", "-c", script]).requested


def test_nested_scripts_before_and_after_the_launch_line() -> None:
    inner = "python3 -m dynamo.sglang --elastic-ep-backend=mooncake --enable-dp-attention"
    r = read(["sh", "-ec", f"sh -c 'echo start'; exec bash -lc '{inner}'"])
    assert r.requested and r.dp_attention
    r = read(["sh", "-c", f"bash -c \"{inner}\"; sh -c 'echo done'"])
    assert r.requested


def test_script_words_are_made_as_the_shell_makes_them() -> None:
    script = (
        "cd /w && exec python3 -m sglang.launch_server --tp 16 \\\n"
        "  --node-rank $POD_INDEX --elastic-ep-\"backend\" 'moon'cake  # trailing\n"
    )
    assert read(["/bin/bash", "-c", script]).requested
    # A comment is not a command (the reader skips it); the safe side reads it, as it reads
    # here-document bodies: test_the_safe_side_reading.
    assert read(["bash", "-c", f"python3 -m sglang.launch_server --tp 2  # {FLAG}"]).where == (
        UNPLACED
    )
    # Words after the script are $0 $1 … of the script, not commands.
    assert not read(["sh", "-c", "run", "--elastic-ep-backend", "mooncake"]).requested
    # One word with a space is not the flag to argparse; but where no command decides the
    # flag, its text in one word is read on the safe side (a wrapper that splits
    # "--extra-args '…'"): test_the_flag_no_command_places_is_read_on_the_safe_side.
    assert read(["echo", FLAG]).where == UNPLACED


# A shell joins a quoted piece to the text beside it: each of these is --elastic-ep-backend
# to the shell (checked against a real one below), and so to SGLang.
QUOTE_JOINED = [
    "-''-elastic-ep-backend mooncake",
    '-""-elastic-ep-backend mooncake',
    "-\\-elastic-ep-backend mooncake",
    "--el'astic'-ep-backend mooncake",
    "--elastic-ep-backend'' mooncake",
    "$'--elastic-ep-backend' mooncake",
    "$'\\x2d\\055elastic-ep-backend' moon''cake",
    '$"--elastic-ep-backend" mooncake',
]


@pytest.mark.parametrize("flag", QUOTE_JOINED)
def test_a_flag_joined_from_quoted_pieces_is_read_as_the_shell_reads_it(flag: str) -> None:
    r = read(["sh", "-c", f"exec python3 -m sglang.launch_server --tp 8 {flag}"])
    assert r.requested and r.where == "sh -c script"
    # As one argv word, with no shell, the quotes stay: SGLang gets no such option.
    if flag.startswith("-''-"):
        assert not read([*LAUNCH, *flag.split()]).requested


@pytest.mark.parametrize("flag", QUOTE_JOINED)
def test_the_shell_joins_quoted_pieces_as_a_real_shell_does(flag: str) -> None:
    script = f"printf '%s\\n' {flag}"
    real = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    [cmd] = shell.commands(["bash", "-c", script])
    assert cmd.words[2:] == real.stdout.splitlines()
    assert cmdline.mentions_flag(script)


def test_script_variables_come_from_the_environment() -> None:
    script = "python3 -m sglang.launch_server --elastic-ep-backend ${BACKEND:-none} $EXTRA"
    assert not read(["sh", "-c", script]).requested
    assert read(["sh", "-c", script], env={"BACKEND": "mooncake"}).requested
    assert read(["sh", "-c", script], env={"EXTRA": FLAG}).requested
    r = read(["sh", "-c", "python3 -m sglang.launch_server --elastic-ep-backend $B"])
    assert r.unresolved == "$B" and not r.requested


def test_args_without_a_command_are_read_as_the_entrypoints_arguments() -> None:
    assert read(["--model-path", "m", "--elastic-ep-backend", "mooncake"]).requested


# --- --config YAML -------------------------------------------------------------------------


def _file_reader(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def test_reads_the_backend_from_a_config_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "sglang.yaml"
    cfg.write_text(
        'model-path: m\nelastic_ep_backend: "mooncake"  # EP\nenable-dp-attention: true\n'
    )
    r = read([*LAUNCH, "--config", str(cfg)], read_config=_file_reader)
    assert r.requested and r.where == f"config {cfg}" and r.dp_attention
    assert r.config_file == str(cfg)


def test_the_command_line_overrides_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "sglang.yml"
    cfg.write_text("elastic-ep-backend: mooncake\nenable-dp-attention: false\n")
    r = read(
        [*LAUNCH, "--config", str(cfg), "--elastic-ep-backend", "none"], read_config=_file_reader
    )
    assert not r.requested
    r = read([*LAUNCH, "--config", str(cfg)], read_config=_file_reader)
    assert r.requested and not r.dp_attention  # a false boolean is not passed on


def test_an_unreadable_or_non_yaml_config_is_noted_not_fatal(tmp_path: Path) -> None:
    r = read([*LAUNCH, "--config", str(tmp_path / "absent.yaml")], read_config=_file_reader)
    assert not r.requested and any("not readable" in n for n in r.notes)
    cfg = tmp_path / "sglang.json"
    cfg.write_text("elastic-ep-backend: mooncake\n")
    r = read([*LAUNCH, "--config", str(cfg)], read_config=_file_reader)
    assert not r.requested and any("not YAML" in n for n in r.notes)


def test_nested_yaml_keys_are_not_top_level_settings() -> None:
    cfg = cmdline.parse_simple_yaml("server:\n  elastic-ep-backend: mooncake\nport: 1\n")
    assert "elastic-ep-backend" not in cfg and cfg["port"] == "1"


# --- bounded work ------------------------------------------------------------------------


def test_a_script_over_the_budget_is_judged_requested_without_reading_it() -> None:
    script = "echo " + "x " * shell.BUDGET + f"; run {FLAG}"
    r = read(["sh", "-c", script])
    assert r.requested and r.over_budget
    assert "too large" in r.describe()


def test_nested_scripts_deeper_than_the_limit_are_over_budget() -> None:
    script = f"python3 -m sglang.launch_server {FLAG}"
    for _ in range(shell.MAX_DEPTH + 1):
        script = "sh -c " + shlex.quote(script)
    r = read(["sh", "-c", script])
    assert r.requested and r.over_budget


def test_a_line_that_never_mentions_the_flag_costs_nothing() -> None:
    huge = ["x" * 1_000_000] * 10
    assert not read(["sh", "-c", *huge]).requested


# --- forms found in review: each was read as "not requested" before -------------------------

P = "python3 -m sglang.launch_server --model m"


@pytest.mark.parametrize(
    "argv",
    [
        ["bash", "-c", 'exec python3 -m sglang.launch_server "$@"', "--", *FLAG.split()],
        ["sh", "-c", 'exec "$@"', "sh", *P.split(), *FLAG.split()],
        ["sh", "-c", "exec python3 -m sglang.launch_server --model m $1 $2", "sh", *FLAG.split()],
    ],
)
def test_arguments_passed_to_a_script_are_read_where_it_uses_them(argv: list[str]) -> None:
    assert read(argv).requested


@pytest.mark.parametrize(
    "prefix",
    [
        ["uv", "run", "--"],
        ["sudo", "-E", "-u", "x", "--"],
        ["gosu", "sglang"],
        ["su-exec", "1000"],
        ["chroot", "/"],
        ["mpirun", "-np", "2"],
        ["conda", "run", "-n", "e"],
        ["/usr/bin/time", "-v"],
    ],
)
def test_a_launch_behind_a_program_epguard_does_not_know_is_still_read(prefix: list[str]) -> None:
    assert read([*prefix, *P.split(), *FLAG.split()]).requested
    assert read([*prefix, "bash", "-c", f"{P} {FLAG}"]).requested


def test_su_c_runs_its_command() -> None:
    assert read(["su", "sglang", "-c", f"{P} {FLAG}"]).requested
    assert read(["runuser", "-u", "sglang", "--", "bash", "-c", f"{P} {FLAG}"]).requested


@pytest.mark.parametrize(
    "script",
    [
        f'FLAGS="{FLAG}"; {P} $FLAGS',
        f"B=mooncake; {P} --elastic-ep-backend $B",
        f'export B=mooncake\n{P} --elastic-ep-backend "$B"',
    ],
)
def test_variables_a_script_sets_itself_are_used(script: str) -> None:
    assert read(["sh", "-c", script]).requested


@pytest.mark.parametrize("body", ["it's", 'a "quote', "EOFX\n$(oops"])
@pytest.mark.parametrize("opener", ["<<'EOF'", "<<EOF", '<<-"EOF"'])
def test_here_document_bodies_are_not_shell_code(opener: str, body: str) -> None:
    script = f"cat {opener} > /etc/x\n{body}\nEOF\n{P} {FLAG}\n"
    assert read(["sh", "-c", script]).requested


def test_an_unknown_variables_default_is_assumed_and_flagged() -> None:
    r = read(["sh", "-c", f"{P} --elastic-ep-backend ${{EP:-mooncake}}"])
    assert r.requested
    r = read(["sh", "-c", f"{P} --elastic-ep-backend ${{EP:-none}}"])
    assert not r.requested and r.unresolved == "${EP:-none}"
    # A known value wins over the default, empty env or not.
    assert not read(
        ["sh", "-c", f"{P} --elastic-ep-backend ${{EP:-mooncake}}"], env={"EP": "none"}
    ).requested
    assert read(["sh", "-c", f"{P} ${{EP:+{FLAG}}}"]).requested


def test_config_alone_is_never_judged_requested_over_budget() -> None:
    script = "exec /otelcol --config=/etc/otel.yaml\n#" + "x" * (shell.BUDGET + 10)
    r = read(["sh", "-c", script])
    assert r.over_budget and not r.requested


def test_argparse_work_is_bounded_per_review() -> None:
    # 3,000 words with a mooncake value, under the text budget: past the words argparse
    # may read per review, the line is read leniently (linearly) instead.
    argv = [*P.split(), *(["--tp", "1"] * 1_500), *FLAG.split()]
    budget = shell.Budget()
    r = read(argv, budget=budget)
    assert r.requested and r.releases == ("lenient",)
    assert any("leniently" in n for n in r.notes)


@pytest.mark.parametrize(
    "text",
    [
        '"elastic-ep-backend": mooncake\n',
        "elastic-ep-backend: &backend mooncake\n",
        "elastic_ep_backend: !!str mooncake\n",
        "{elastic-ep-backend: mooncake, tp-size: 8}\n",
        "elastic-ep-backend:\n  mooncake\n",
    ],
)
def test_config_yaml_forms_are_read(text: str, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert read([*LAUNCH, "--config", str(cfg)], read_config=_file_reader).requested


def test_odd_environment_values_do_not_crash_the_reader() -> None:
    env = {"A": 1, "B": None}
    assert read(["sh", "-c", f"{P} --elastic-ep-backend $A $B"], env=env) is not None  # type: ignore[arg-type]


def test_a_huge_argv_is_over_budget_without_being_read_word_by_word() -> None:
    r = read([*P.split(), *(["--tp", "1"] * 20_000), *FLAG.split()])
    assert r.requested and r.over_budget


@pytest.mark.parametrize("prefix", [["A=1"], ["nohup"], ["env", "B=2"]])
def test_the_words_unwrap_skips_are_charged_to_the_budget(prefix: list[str]) -> None:
    # A copy of the line for each skipped word made a long run of them quadratic (0.9 s
    # for 40,000 words, minutes for a pod the API server still sends), and the words
    # skipped were charged nothing.
    r = read([*(prefix * 20_000), *P.split(), *FLAG.split()])
    assert r.requested and r.over_budget


def test_unwrap_skips_assignments_and_wrappers_in_any_mix() -> None:
    line = [
        "A=1",
        "nohup",
        "env",
        "-u",
        "X",
        "B=2",
        "timeout",
        "-s",
        "KILL",
        "5",
        "nice",
        "-n",
        "3",
        "taskset",
        "-c",
        "0-3",
        "exec",
        "-a",
        "x",
        *LAUNCH,
    ]
    assert shell.unwrap(line) == LAUNCH
    assert shell.unwrap(["A=1", "nohup"]) == []
    assert shell.unwrap(LAUNCH) is LAUNCH


@pytest.mark.parametrize(
    "argv",
    [
        # No command: the image entrypoint's arguments (found by a review helper).
        ["--elastic-ep-backend", "mooncake", "--tp", "8"],
        ["--elastic-ep-backend=mooncake"],
        # A bash array literal: its words are the entrypoint's arguments too.
        ["bash", "-c", 'ARGS=(--tp 8); if true; then ARGS+=(--elastic-ep-backend mooncake); '
                       'fi; exec python3 -m sglang.launch_server "${ARGS[@]}"'],
        # Text no command read places: eval, set --, a script on a shell's stdin, braces.
        ["sh", "-c", 'CMD="python3 -m sglang.launch_server --elastic-ep-backend mooncake"; '
                     'eval "$CMD"'],
        ["sh", "-c", "eval \"$CMD\""],
        ["sh", "-c", f"set -- {FLAG}; exec {SERVER} \"$@\""],
        ["sh", "-c", f"set -- \"#\" {FLAG}; exec {SERVER} \"$@\""],
        ["bash", "-c", f"bash <<'EOF'\n{SERVER} {FLAG}\nEOF"],
        ["sh", "-c", "echo 'python3 -m sglang.launch_server --elastic-ep-backend mooncake' | sh"],
        ["sh", "-c", "python3 -m sglang.launch_server {--elastic-ep-backend,mooncake}"],
    ],
    ids=["args-only", "args-only-equals", "bash-array", "eval", "eval-env", "set", "set-hash",
         "heredoc-stdin", "pipe-to-sh", "braces"],
)  # fmt: skip
def test_the_flag_no_command_places_is_read_on_the_safe_side(argv: list[str]) -> None:
    env = {"CMD": "python3 -m sglang.launch_server --elastic-ep-backend mooncake"}
    r = read(argv, env=env)
    assert r.requested and r.backend is not None and r.backend.strip() == "mooncake"


def test_the_safe_side_reading() -> None:
    """Found by a review helper on the first version: a decoy line saying none, a value in
    braces, a flag and its value in two variables, an escaped $' before a quoted #."""
    env = {"CMD": f"{SERVER} {FLAG}", "A": f"{SERVER} --elastic-ep-backend", "B": "mooncake"}
    for script in (
        f"{SERVER} --elastic-ep-backend {{mooncake,}}",
        f"bash <<'EOF'\necho \\$'a\\' b' #'; {SERVER} {FLAG}\nEOF",
        f"cat > /shared/run.sh <<'EOF'\n{SERVER} {FLAG}\nEOF",
    ):
        r = read(["bash", "-c", script], env=env)
        assert r.requested and r.where == UNPLACED, script
    # eval runs its words as a script: read as one, a launch line it runs is a worker's.
    for script in (
        ': --elastic-ep-backend none; eval "$CMD"',
        f'echo --elastic-ep-backend none; eval "{SERVER} {FLAG}"',
        'eval "$A $B"',
        f'eval "{SERVER} {FLAG}; echo --elastic-ep-backend none"',
        f"eval {SERVER} '\"$CMD_ARGS\"' {FLAG}",
    ):
        r = read(["bash", "-c", script], env=env)
        assert r.requested and r.where == "sh -c script" and r.launcher, script
    # Within one piece argparse's last value wins; words of an argv without a shell are
    # each a piece; a value from the environment at launch is no request.
    assert not read(["sh", "-c", f"{SERVER} {FLAG} --elastic-ep-backend none"]).requested
    assert not read([*LAUNCH, "--elastic-ep-backend", "mooncake", "--elastic-ep-backend",
                     "none"]).requested  # fmt: skip
    assert not read(["sh", "-c", f"eval {SERVER} --elastic-ep-backend $X"]).requested
    # An entrypoint's arguments in an env value nothing names.
    assert read([], env={"SGLANG_ARGS": FLAG}).where == UNPLACED
    # Bounded: env text and brace expansions are charged to the reading budget.
    big = {"A": FLAG + " " + "x" * (shell.BUDGET + 1)}
    r = read(["sh", "-c", "echo '$A'"], env=big)
    assert r.requested and r.over_budget
    braces = "echo a{" + "," * 8000 + "}" + "y" * 8000 + " --elastic-ep-backend"
    r = read(["sh", "-c", braces])
    assert r.requested and r.over_budget


@pytest.mark.parametrize(
    "script",
    [
        'ARGS="--model-path m --elastic-ep-backend mooncake"\n'
        'if [ -n "$HOSTIP" ]; then\n  ARGS="$ARGS --host $HOSTIP"\nfi\n'
        f"exec {SERVER} $ARGS",
        f'ARGS="--model-path m"\nARGS+=" {FLAG}"\nexec {SERVER} $ARGS',
        f'ARGS="--model-path m"\nARGS="${{ARGS}} {FLAG}"\nARGS="${{ARGS}} --tp 8"\n'
        f"exec {SERVER} $ARGS",
        f'export ARGS="{FLAG}"\nexport ARGS="$ARGS --tp 8"\n{SERVER} $ARGS',
        f'ARGS="--elastic-ep-backend"; ARGS=$ARGS" mooncake"; {SERVER} $ARGS',
    ],
    ids=["if-append", "plus-equals", "braced-twice", "export-chain", "mixed-quotes"],
)
def test_a_launch_line_built_step_by_step_is_read(script: str) -> None:
    """`ARGS="$ARGS …"` builds on the value before it (found by a review helper: kept as
    written, the flag of the first step was lost, and the worker went unprobed)."""
    r = read(["bash", "-c", script], env={"HOSTIP": "10.0.0.1"})
    assert r.requested and r.where == "sh -c script"


def test_a_line_that_doubles_itself_is_over_budget_not_built() -> None:
    script = "A=x\n" + 'A="$A$A"\n' * 40 + f"{SERVER} $A {FLAG}"
    r = read(["bash", "-c", script])
    assert r.requested and r.over_budget


def test_a_guessed_default_stays_unresolved_whatever_the_safe_side_reads() -> None:
    """A comment naming mooncake turned the unresolved ${EP:-none} (probed in the pod)
    into a safe-side request (never probed): found by a review helper."""
    script = f"# decode pods: EP=mooncake ({FLAG})\n{SERVER} --elastic-ep-backend ${{EP:-none}}"
    r = read(["bash", "-c", script])
    assert not r.requested and r.unresolved == "${EP:-none}"


@pytest.mark.parametrize(
    ("script", "requested"),
    [
        # A value is stored when assigned: a later assignment does not change it.
        (f'B=mooncake; CMD="{SERVER} --elastic-ep-backend $B"; B=none; eval "$CMD"', True),
        (f'B=none; CMD="{SERVER} --elastic-ep-backend $B"; B=mooncake; eval "$CMD"', False),
        (f'EP=mooncake; ARGS="--tp 8"; ARGS="$ARGS --elastic-ep-backend $EP"; {SERVER} $ARGS',
         True),
        (f'BACKEND="${{BACKEND:-mooncake}}"; {SERVER} --elastic-ep-backend $BACKEND', True),
        (f"B=mooncake; C='$B'; {SERVER} --elastic-ep-backend $C", False),  # single quotes
    ],
    ids=["eval-later-none", "eval-later-mooncake", "other-name-in-step", "default", "quoted"],
)  # fmt: skip
def test_an_assignment_stores_its_value_as_the_shell_does(script: str, requested: bool) -> None:
    """Found by a review helper: values were stored as written and expanded at their use,
    so a later assignment changed what an earlier one held."""
    r = read(["bash", "-c", script])
    assert r.requested is requested, (r.values, r.unresolved)
    # (C='$B' holds the text $B, read as a value not known here: no request.)
    assert r.unresolved is None or "C='$B'" in script


def test_the_words_before_eval_are_charged_to_the_budget() -> None:
    budget = shell.Budget()
    shell.commands(["env", "A=" + "x" * 30000, "eval", "true"], {}, budget)
    assert budget.left < shell.BUDGET - 30000


# --- fifth review (helper): lines a shell and SGLang run with mooncake, read as none -------


@pytest.mark.parametrize(
    ("argv", "where", "unresolved"),
    [
        # A value used, then set again: each use sees the assignment before it.
        (["sh", "-c", f"B=mooncake\n{SERVER} --elastic-ep-backend $B &\nB=none\n"
                      f"{SERVER} --port 31000 --elastic-ep-backend $B"], "sh -c script", None),
        (["sh", "-c", f"B=mooncake; exec {SERVER} --elastic-ep-backend $B; B=none"],
         "sh -c script", None),
        # Set where the in-order reading does not follow (a branch, a group, eval,
        # typeset, ${B:=}): of its values, the one asking for mooncake is read (the side
        # on which more is seen, as for an unknown variable's default).
        (["sh", "-c", f"B=none; {{ B=mooncake; }}; exec {SERVER} --elastic-ep-backend $B"],
         "sh -c script", None),
        (["sh", "-c", f"B=none; if true; then B=mooncake; fi; exec {SERVER} "
                      "--elastic-ep-backend $B"], "sh -c script", None),
        (["sh", "-c", "if [ \"$ROLE\" = decode ]; then\n  EP=mooncake\nelse\n  EP=none\nfi\n"
                      f"exec {SERVER} --elastic-ep-backend $EP"], "sh -c script", None),
        (["bash", "-c", f"B=none; eval B=mooncake; exec {SERVER} --elastic-ep-backend $B"],
         "sh -c script", None),
        (["bash", "-c", f"B=none; typeset -x B=mooncake; exec {SERVER} --elastic-ep-backend $B"],
         "sh -c script", None),
        (["sh", "-c", f"B=; : ${{B:=mooncake}}; exec {SERVER} --elastic-ep-backend $B"],
         "sh -c script", None),
        # Set by a command, whose value is not read here: unknown, so unresolved (warned,
        # and probed where the pod is).
        (["bash", "-c", f"B=none; printf -v B mooncake; exec {SERVER} --elastic-ep-backend $B"],
         "sh -c script", "$B"),
        (["bash", "-c", f"B=none; read B <<< mooncake; exec {SERVER} --elastic-ep-backend $B"],
         "sh -c script", "$B"),
        # An expansion after the flag's value may give the flag again (argparse takes the
        # last); a backquote is an expansion; a spelling completed by an expansion.
        ([*LAUNCH, "--elastic-ep-backend=none", "$(EXTRA)"], "argv", "none (then $(EXTRA))"),
        (["sh", "-c", f"{SERVER} --elastic-ep-backend none $EXTRA_ARGS"], "sh -c script",
         "none (then $EXTRA_ARGS)"),
        (["bash", "-c", f"{SERVER} --elastic-ep-backend `echo mooncake`"], "sh -c script",
         "`echo mooncake`"),
        ([*LAUNCH, "--elastic-ep-$(S)", "mooncake"], None, "--elastic-ep-$(S)"),
        # Every brace group is made; a quoted decoy after the flag is one word.
        (["bash", "-c", f"{SERVER} --elastic-ep-backend=mooncake{{,}}{{,}}"], UNPLACED, None),
        (["bash", "-c", f"bash <<'EOF'\nexec {SERVER} {FLAG} --served-model-name "
                        "'x --elastic-ep-backend none'\nEOF"], UNPLACED, None),
    ],
    ids=["reassigned-after-background", "reassigned-after-exec", "group", "if-one-line",
         "if-else", "eval-assignment", "typeset", "default-assign", "printf-v", "read",
         "kubelet-extra", "shell-extra", "backquote", "hidden-spelling", "brace-groups",
         "quoted-decoy"],
)  # fmt: skip
def test_a_line_read_as_none_that_runs_mooncake_is_a_request_or_unresolved(
    argv: list[str], where: str | None, unresolved: str | None
) -> None:
    r = read(argv)
    assert r.unresolved == unresolved, (r.values, r.where)
    assert r.requested is (unresolved is None), (r.values, r.unresolved)
    assert r.where == where


# --- a later review (helper): values set in another process, a function, a here-document
# or for one command only, read as lasting; a shift read as a here-document ------------


@pytest.mark.parametrize(
    "between",
    [
        "(B=none); ",  # a subshell's own
        "B=none true; ",  # for that one command
        'echo "$(B=none)"; ',
        "B=none | cat; ",  # a pipeline's process
        "B=none & ",  # a background job
        "f(){ local B=none; }; f; ",  # a function's own
        "cat >/tmp/e <<EOF\nB=none\nEOF\n",  # data
    ],
    ids=["subshell", "prefix", "cmdsub", "pipeline", "background", "local", "heredoc"],
)
def test_a_value_set_only_for_another_process_or_command_hides_no_request(between: str) -> None:
    """bash and sh print ``mooncake`` for $B after each of these (checked with a real
    shell by the review helper); each was read as B=none, and a worker asking for
    mooncake was admitted unjudged, with no probe and no gate."""
    script = f"B=mooncake; {between}exec {SERVER} --elastic-ep-backend $B"
    r = read(["bash", "-c", script])
    assert r.requested, (r.values, r.unresolved)


def test_a_shift_is_not_a_here_document_that_hides_the_rest() -> None:
    """``<<`` in arithmetic is a shift; read as a here-document with no end, the rest of
    the script went unread (review helper). An unclosed one is read as code."""
    script = f"B=mooncake\n(( x = 1 <<EOF ))\nexec {SERVER} --elastic-ep-backend $B"
    assert read(["bash", "-c", script]).requested
    literal = f"(( x = 1 <<EOF ))\nexec {SERVER} --elastic-ep-backend mooncake"
    assert read(["bash", "-c", literal]).requested
    # With a line that would close it, what it holds is not read as lasting either way:
    # contested, so the value asking for mooncake is read (review helper of the diff).
    closed = f"B=none\n(( x = 1 <<true ))\nB=mooncake\ntrue\nexec {SERVER} --elastic-ep-backend $B"
    assert read(["bash", "-c", closed]).requested
    # A `#` in quotes starts no comment: the assignment after it on the line is read.
    quoted = f'B=none; echo "worker #1"; B=mooncake; exec {SERVER} --elastic-ep-backend $B'
    assert read(["bash", "-c", quoted]).requested


def test_what_the_subshell_fix_must_keep_reading_in_order() -> None:
    """Forms a real shell keeps in its own process, which the first cut of that fix made
    contested (review helper of the diff): a line ending in `;` or `&` before the next
    step, several assignments of one `export`, a here-document named in a comment."""
    steps = (f'cd /w;\nARGS="--tp 8";\nARGS="$ARGS --elastic-ep-backend mooncake";\n'
             f"exec {SERVER} $ARGS")  # fmt: skip
    env, _ = shell.script_env(steps, {}, shell.Budget())
    assert env["ARGS"] == "--tp 8 --elastic-ep-backend mooncake"
    for end, tail in ((";", ";"), (" &", ""), ("", "")):
        script = (f'nvidia-smi{end}\nARGS="--tp 8 --elastic-ep-backend mooncake"{tail}\n'
                  f'ARGS="$ARGS --enable-dp-attention --dp 8"\nexec {SERVER} $ARGS')  # fmt: skip
        r = read(["sh", "-c", script])
        assert r.requested and r.dp_attention, (end, r.values)
    r = read(["sh", "-c", "export BACKEND=${BACKEND:-mooncake} PORT=30000\n"
                          f"exec {SERVER} --elastic-ep-backend $BACKEND"])  # fmt: skip
    assert r.requested and r.unresolved is None, r.values
    r = read(["sh", "-c", f"# cat <<EOF\nBK=mooncake\nEOF\nexec {SERVER} --elastic-ep-backend $BK"])
    assert r.requested and r.unresolved is None, r.values
    r = read(
        ["sh", "-c", f'echo "<<EOF"\nBK=mooncake\nEOF\nexec {SERVER} --elastic-ep-backend $BK']
    )
    assert r.requested and r.unresolved is None, r.values


def test_here_documents_that_never_close_are_read_in_linear_time() -> None:
    """Each unclosed one was searched for to the end of the script again from every later
    opener: 8,000 `<<a` lines (32 KB) took 24 s (review helper); 0.2 s now. The bound
    is generous: it tells linear from quadratic, not a speed target."""
    started = time.monotonic()
    r = read(["sh", "-c", f"{SERVER} --elastic-ep-backend mooncake\n" + "<<a\n" * 7900])
    shell.foreign("<<a\n" * 8000)
    assert r.requested
    assert time.monotonic() - started < 6.0


def test_what_the_fifth_review_left_alone_still_reads_as_before() -> None:
    """The forms around those fixes that a real shell runs as the reading says."""
    # A launch line built step by step, one step in a branch: the flag of the first
    # step stays (the side on which more of the line is seen).
    script = (f'ARGS="--elastic-ep-backend mooncake"; if [ -n "$IP" ]; then '
              f'ARGS="$ARGS --host $IP"; fi; exec {SERVER} $ARGS')  # fmt: skip
    assert read(["bash", "-c", script]).requested
    # Set twice in a straight line: the last before the use.
    assert read(["sh", "-c", f"EP=none; EP=mooncake; exec {SERVER} --elastic-ep-backend $EP"]
                ).requested  # fmt: skip
    # An expansion that is another option's value, or before the flag, changes nothing.
    for args in (["--elastic-ep-backend", "none", "--host", "$(POD_IP)"],
                 ["$(EXTRA)", "--elastic-ep-backend", "none"]):  # fmt: skip
        r = read([*LAUNCH, *args])
        assert not r.requested and r.unresolved is None, args
    # After a flag that takes no value, an expansion stands as a word of its own.
    r = read([*LAUNCH, "--elastic-ep-backend", "none", "--enable-eplb", "$(EXTRA)"])
    assert r.unresolved == "none (then $(EXTRA))"
    # Argparse's last value within one line, quotes or not.
    assert not read(["sh", "-c", f"{SERVER} {FLAG} --elastic-ep-backend none"]).requested


@pytest.mark.parametrize(
    ("script", "env", "requested"),
    [
        # A comment or an argument is no assignment.
        (f"B=mooncake\n# B=none\n{SERVER} --elastic-ep-backend $B", {}, True),
        (f"B=mooncake\necho waiting for leader B=none\n{SERVER} --elastic-ep-backend $B",
         {}, True),
        (f'ARGS="--model-path m {FLAG}"\n# ARGS="--model-path /m"\nexec {SERVER} $ARGS', {},
         True),
        # IFS as one command's prefix splits nothing else.
        (f'IFS=, read -ra H <<< "$P"\nB=mooncake\n{SERVER} --elastic-ep-backend $B', {},
         True),
        # The per-role pattern, and an unrelated `||`.
        (f'B=none\n[ "$ROLE" = decode ] && B=mooncake\n{SERVER} --elastic-ep-backend $B',
         {}, True),
        (f"B=none\nB=mooncake\nmkdir -p x || true\n{SERVER} --elastic-ep-backend $B", {},
         True),
        # ${EP:=word} assigns nothing where the environment holds EP.
        (f': "${{EP:=none}}"\nexec {SERVER} --elastic-ep-backend "$EP"', {"EP": "mooncake"},
         True),
        # (The next review:) `${#` is no comment; a chosen value is seen by the
        # assignments in order; `$EP_DECODE` is not `$EP`; a quoted IFS on its own.
        ('EP=none\nif [ ${#HOSTS[@]} -gt 1 ]; then EP=mooncake; fi\n'
         f'exec {SERVER} --elastic-ep-backend $EP', {}, True),
        (f'B=none\n[ "$ROLE" = decode ] && B=mooncake\nARGS="--elastic-ep-backend $B"\n'
         f'exec {SERVER} $ARGS', {}, True),
        (f'EP=none\nif [ "$ROLE" = decode ]; then EP=$EP_DECODE; fi\n'
         f'exec {SERVER} --elastic-ep-backend $EP', {"EP_DECODE": "mooncake"}, True),
        (f'IFS=", "\nB=mooncake\n{SERVER} --elastic-ep-backend $B', {}, False),
    ],
    ids=["comment", "echo", "comment-args", "ifs-prefix", "per-role", "unrelated-or",
         "default-held", "length-not-comment", "chosen-in-order", "name-prefix",
         "ifs-quoted"],
)  # fmt: skip
def test_what_the_review_of_the_fifth_found_reads_as_the_shell_runs_it(
    script: str, env: dict[str, str], requested: bool
) -> None:
    """Found by review helpers of the change above: each read as unknown (a warning
    only, a denied image admitted) where the earlier reader had it right, or read as
    `none` without a word. (IFS set on its own makes every assigned name unknown.)"""
    r = read(["bash", "-c", script], env=env)
    assert r.requested is requested, (r.values, r.unresolved)
    assert r.unresolved == (None if requested else "$B"), r.unresolved
    assert r.where == "sh -c script"


def test_a_contested_value_naming_the_flag_without_mooncake_is_unknown() -> None:
    """Review helper: `EXTRA="--elastic-ep-backend none"` in a branch was chosen (it
    named the flag), so a line asking for mooncake read as none; with a value from an
    envFrom beside it, silently."""
    script = ('EXTRA=""\nif [ -n "$X" ]; then EXTRA="--elastic-ep-backend none"; fi\n'
              f"exec {SERVER} --elastic-ep-backend mooncake $EXTRA")  # fmt: skip
    r = read(["bash", "-c", script])
    assert r.requested and r.where == "sh -c script", (r.where, r.values)
    script = ('case "$R" in d) A="--elastic-ep-backend $BACKEND";; *) '
              'A="--elastic-ep-backend none";; esac\n' + f"exec {SERVER} $A")  # fmt: skip
    r = read(["bash", "-c", script])
    assert not r.requested and r.unresolved is not None


@pytest.mark.parametrize(
    "argv",
    [
        [*LAUNCH, "--elastic-ep-backend", "none", "--host=$(POD_IP)"],
        ["sh", "-c", f"{SERVER} --elastic-ep-backend none --host=$POD_IP --port=$PORT"],
        ["sh", "-c", 'EXTRA=""\nif [ -n "$X" ]; then\n  EXTRA="--enable-eplb"\nfi\n'
                     f"exec {SERVER} --elastic-ep-backend none $EXTRA"],
        ["sh", "-c", f'exec {SERVER} --elastic-ep-backend none "$@"'],
        ["sh", "-c", 'if [ x ]; then E="--elastic-ep-initial-size 4"; else '
                     f'E="--elastic-ep-initial-size 8"; fi\nexec {SERVER} '
                     "--elastic-ep-backend none $E"],
    ],
    ids=["kubelet-option-value", "shell-option-values", "optional-extras", "no-arguments",
         "branch-of-another-option"],
)  # fmt: skip
def test_ordinary_lines_saying_none_get_no_warning(argv: list[str]) -> None:
    r = read(argv)
    assert not r.requested and r.unresolved is None, r.unresolved


def test_the_safe_sides_second_reading_does_not_spend_the_reviews_budget() -> None:
    """Review helper: eight 3.4 KB one-line scripts in one pod, read twice on the safe
    side, went over the shared budget (judged requested: a denied image refused)."""
    budget = shell.Budget()
    line = f"{SERVER} --elastic-ep-backend none --host $POD_IP " + "--x 'y' " * 420
    for i in range(8):
        r = cmdline.read(["sh", "-c", line + f"--port {i}"], budget=budget)
        assert not r.requested and not r.over_budget, i


def test_values_put_in_to_choose_a_contested_name_are_bounded() -> None:
    """Found reading the change over: a 1 MB environment value named in each of a
    contested name's values was put in every time (50 values of `$A$A$A$A` made 200 MB;
    2,000 made 8 GB, in the webhook every tenant shares). What they add is charged."""
    import tracemalloc

    script = ("if [ x ]; then\n" + 'B="$A$A$A$A"\n' * 50
              + f"fi\nB=none\n{SERVER} --elastic-ep-backend $B")  # fmt: skip
    tracemalloc.start()
    try:
        read(["bash", "-c", script], env={"A": "x" * 1_000_000})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    "argv",
    [
        ["kubectl", "exec", "sglang-0", "--", "python3", "-m", "sglang.launch_server",
         "--elastic-ep-backend", "mooncake"],
        ["sh", "-c", "exec kubectl exec -it sglang-0 -- python3 -m sglang.launch_server "
                     "--elastic-ep-backend mooncake"],
        ["bash", "-c", "ssh gpu-1 python3 -m sglang.launch_server --elastic-ep-backend mooncake"],
        ["docker", "run", "lmsysorg/sglang", "python3", "-m", "sglang.launch_server",
         "--elastic-ep-backend", "mooncake"],
        ["gosu", "app", "kubectl", "exec", "p", "--", "python3", "-m", "sglang.launch_server",
         "--elastic-ep-backend", "mooncake"],
    ],
    ids=["kubectl-exec", "kubectl-in-sh", "ssh", "docker-run", "behind-gosu"],
)  # fmt: skip
def test_a_launch_line_run_elsewhere_is_not_this_containers(argv: list[str]) -> None:
    # Read as a worker, the kubectl image had the probe injected (python3 in an image
    # with none) and its Job never ran.
    r = cmdline.read(argv)
    assert r.launcher != "sglang.launch_server" and r.where != "argv"
    assert not (r.requested and not r.unplaced)  # no probe: at most rules and verdicts


def test_a_launcher_this_container_runs_is_still_read() -> None:
    r = cmdline.read(["gosu", "sglang", "python3", "-m", "sglang.launch_server",
                      "--elastic-ep-backend", "mooncake"])  # fmt: skip
    assert r.requested and r.where == "argv" and r.launcher == "sglang.launch_server"


# --- what changes which interpreter the launch finds (cmdline.steering) ------------------
# Found by review helpers: each ran the venv's python while the probe judged the image's
# own, and its "torch is not installed" became a verdict about the image.
STEERED_LAUNCH = "python3 -m sglang.launch_server --elastic-ep-backend mooncake"


@pytest.mark.parametrize(
    ("argv", "env", "said"),
    [
        (
            ["bash", "-c", f"source /opt/venv/bin/activate && {STEERED_LAUNCH}"],
            {},
            "source /opt/venv",
        ),
        (["bash", "-c", f"if [ -f /a ]; then source /a; fi; {STEERED_LAUNCH}"], {}, "source /a"),
        (["sh", "-c", f". /etc/conda.sh\n{STEERED_LAUNCH}"], {}, ". /etc/conda.sh"),
        (["bash", "-c", f'export "PATH=/opt/venv/bin:$PATH"; {STEERED_LAUNCH}'], {}, "PATH="),
        (["env", "PYTHONPATH=/opt/site", *STEERED_LAUNCH.split()], {}, "PYTHONPATH="),
        (["bash", "-c", f"BASH_ENV=/x {STEERED_LAUNCH}"], {}, "BASH_ENV="),
        (["micromamba", "run", "-n", "sgl", *STEERED_LAUNCH.split()], {}, "micromamba run"),
        (["bash", "-lc", STEERED_LAUNCH], {}, "bash -lc"),
        (["/bin/bash", "--login", "-c", STEERED_LAUNCH], {}, "bash --login"),
        # Text that arrives through a variable, as the reader expands it.
        (
            ["bash", "-c", "$LAUNCH"],
            {"LAUNCH": f"source /v/activate && {STEERED_LAUNCH}"},
            "source /v",
        ),
        (["bash", "-c", f"$PRE; {STEERED_LAUNCH}"], {"PRE": "source /v/activate"}, "source /v"),
    ],
)
def test_a_line_that_changes_what_the_launch_finds_says_what(
    argv: list[str], env: dict[str, str], said: str
) -> None:
    r = cmdline.read(argv, env=env)
    assert r.requested and r.steered is not None and r.steered.startswith(said), r.steered


@pytest.mark.parametrize(
    "argv",
    [
        STEERED_LAUNCH.split(),
        ["bash", "-c", STEERED_LAUNCH],
        ["bash", "-ec", f"cd /sgl-workspace && {STEERED_LAUNCH} --served-model-name PATHS"],
        ["bash", "-xc", f"export NCCL_DEBUG=INFO; echo source; {STEERED_LAUNCH}"],
    ],
)
def test_a_plain_launch_changes_nothing(argv: list[str]) -> None:
    r = cmdline.read(argv)
    assert r.requested and r.steered is None, r.steered


def test_a_line_too_large_to_read_is_not_known_to_change_nothing() -> None:
    script = f"{STEERED_LAUNCH} --json-model-override-args '{'x' * (shell.BUDGET + 10)}'"
    r = cmdline.read(["bash", "-c", script])
    assert r.requested and r.over_budget and r.steered == "a command line too large to read"


# --- where a command of the script's own shell starts: runs of assignments, and what is
# inside parentheses, quotes, `$(…)`, backquotes, comments or a function ----------------

REAL_SHELLS = ("bash", "dash")
# The launch is `{use}`; `$B` is the backend, `$ARGS` the server arguments.
# A quoted python line with `name()` in it (no python3 needed to run it here).
HOSTNAME = 'H=$(printf %s "import socket; print(socket.gethostname())")'
STEPS = 'EP=mooncake\nARGS="--tp-size 8"\n{between}\nARGS="$ARGS --elastic-ep-backend $EP"\n{use}'
OWN_SHELL = {
    # (script, the value bash and dash launch with); first what was read as none:
    "export-second-name": ("B=none; export A=1 B=mooncake; {use}", "mooncake"),
    # a name declared without a value sets nothing, and the run goes on after it:
    "export-after-a-bare-name": ("B=none; export A B=mooncake; {use}", "mooncake"),
    "export-between-bare-names": ("B=none\nexport A=1 C B=mooncake D\n{use}", "mooncake"),
    "readonly-after-a-bare-name": ("B=none\nreadonly A B=mooncake\n{use}", "mooncake"),
    "export-end-of-options": ("B=none; export -- A B=mooncake; {use}", "mooncake"),
    "export-after-a-quoted-bare-name": ('B=none; export "A" B=mooncake; {use}', "mooncake"),
    "export-continued-after-a-bare-name": ("B=none\nexport A \\\nB=mooncake\n{use}",
                                           "mooncake"),
    # a block after `|` runs in another process to its end, not to its first line's:
    "brace-group-after-a-pipe-over-lines": ("B=mooncake\necho | {{\nB=none\n}}\n{use}",
                                            "mooncake"),
    "brace-group-on-the-line-after-a-pipe": ("B=mooncake\necho |\n{{\nB=none\n}}\n{use}",
                                             "mooncake"),
    "loop-after-a-pipe": ("B=mooncake\necho x | while read -r l; do\nB=none\ndone\n{use}",
                          "mooncake"),
    # ... and a block's words that only look like its start or end change nothing:
    "an-argument-brace-inside-a-piped-block": (
        'EP=none\nEP=mooncake\nARGS="--tp 8"\necho | {{ cat; echo {{; }}\n'
        'ARGS="$ARGS --elastic-ep-backend $EP"\n{use}',
        "--tp 8 --elastic-ep-backend mooncake"),
    "a-case-pattern-like-an-opener-after-a-pipe": (
        'EP=none\nEP=mooncake\nARGS="--tp 8"\necho | case x in\nfor) ;;\nesac\n'
        'ARGS="$ARGS --elastic-ep-backend $EP"\n{use}',
        "--tp 8 --elastic-ep-backend mooncake"),
    # a default the script gives its own name is a value it may have:
    "self-default-then-none-in-a-piped-loop": (
        'B=${{B:-mooncake}}\necho x-prefill | while read -r h; do\n'
        '  case "$h" in *prefill*) B=none ;; esac\ndone\n{use}', "mooncake"),
    # a default is a word the shell makes: quotes removed and references put in, nested
    # ones and positional ones too (each read as unresolved: probed, never gated):
    "default-nested-in-a-default": ("B=${{EP_BACKEND:-${{DEFAULT_EP:-mooncake}}}}\n{use}",
                                    "mooncake"),
    "default-nested-two-deep": ("B=${{A:-${{C:-${{D:-mooncake}}}}}}\n{use}", "mooncake"),
    "default-nested-in-a-default-set-to-none": (
        "EP=\nD=none\nB=${{EP:-${{D:-mooncake}}}}\n{use}", "none"),
    "default-from-a-name-the-script-sets": ("D=mooncake\nB=${{EP:-$D}}\n{use}", "mooncake"),
    "default-from-a-braced-name": ("D=mooncake\nB=${{EP:-${{D}}}}\n{use}", "mooncake"),
    "quoted-default-in-double-quotes": ('B="${{EP:-"mooncake"}}"\n{use}', "mooncake"),
    "quoted-default-with-blanks-in-double-quotes": (
        'ARGS="${{ARGS:-"--tp 8 --elastic-ep-backend mooncake"}}"\n{use}',
        "--tp 8 --elastic-ep-backend mooncake"),
    "quoted-default-with-blanks-naming-none": (
        'ARGS=\nARGS="${{ARGS:-"--tp 8 --elastic-ep-backend none"}}"\n{use}',
        "--tp 8 --elastic-ep-backend none"),
    "nested-self-default-then-none-in-a-branch": (
        'B=${{B:-${{DEFAULT_EP:-mooncake}}}}\nif [ -z "$PATH" ]; then B=none; fi\n{use}',
        "mooncake"),
    "positional-default": ("B=${{1:-mooncake}}\n{use}", "mooncake"),
    "positional-default-in-double-quotes": ('B="${{1:-"moon"cake}}"\n{use}', "mooncake"),
    "self-default-then-none-in-a-branch": (
        'B=${{B:-mooncake}}\n[ -z "$PATH" ] && {{\nB=none\n}}\n{use}', "mooncake"),
    "a-default-with-quotes-inside": (
        'ARGS=${{ARGS:-"--tp 8 --elastic-ep-backend mooncake"}}\n{use}',
        "--tp 8 --elastic-ep-backend mooncake"),
    "a-default-with-single-quotes-inside": (
        "ARGS=${{ARGS:-'--tp 8 --elastic-ep-backend mooncake'}}\n{use}",
        "--tp 8 --elastic-ep-backend mooncake"),
    # an escaped `)` does not end a command substitution:
    "escaped-parenthesis-in-a-command-substitution": (
        "B=mooncake\nX=$(echo \\)\nB=none\n)\n{use}", "mooncake"),
    # `<< 1` in arithmetic is a shift, not a here-document that a later line `1` closes:
    "a-shift-by-a-number-in-arithmetic": (
        'B=none\nif [ -n "$PATH" ]; then B=mooncake; fi\nP=$(( 3 + (R << 1) ))\n{use}\n'
        "cat > /dev/null <<EOF\n1\nEOF", "mooncake"),
    # a here-document's delimiter is a word, not only a name: its body is no code
    **{
        f"here-document-delimiter-{i}": (
            f"B=mooncake\ncat > /dev/null <<{word}\nB=none\n{line}\n{{use}}", "mooncake")
        for i, (word, line) in enumerate([
            ("EOF-X", "EOF-X"), ("'END.1'", "END.1"), (".", "."), ("'1'", "1"),
            ("EO\\F", "EOF"), ('E"O"F', "EOF"), ('EOF"X"', "EOFX"), ("EOF$X", "EOF$X"),
            ("'END 1'", "END 1"), ('"a\\\\b"', "a\\b"),
        ])
    },
    "assignment-run": ("B=none; A=1 B=mooncake; {use}", "mooncake"),
    "subshell-over-lines": ("B=mooncake\n(\nB=none\n)\n{use}", "mooncake"),
    "heredoc-in-cmdsub": ("B=mooncake; X=$(cat <<EOF\nB=none\nEOF\n)\n{use}", "mooncake"),
    "backquotes": ("B=mooncake; X=`true; B=none`; {use}", "mooncake"),
    "comment": ("B=mooncake\n# set ;B=none\n{use}", "mooncake"),
    "function-called-before-reassignment": ("f() {{ {use}; }}; B=mooncake; f; B=none", "mooncake"),
    "argument-export": ("B=mooncake; : export B=none; {use}", "mooncake"),
    "comment-after-assignment": ("A=1 B=none\nB=mooncake # decode\n{use}", "mooncake"),
    "heredoc-backslash-delimiter": (
        "B=mooncake\ncat >/dev/null <<\\EOF\nB=none\nEOF\n{use}",
        "mooncake",
    ),
    "pipe-then-space": ("B=mooncake\necho x | \nB=none\n{use}", "mooncake"),
    "pipe-then-comment": ("B=mooncake\necho x | # c\nB=none\n{use}", "mooncake"),
    "continued-argument": ("B=mooncake\necho x >/dev/null \\\nB=none\n{use}", "mooncake"),
    # a step building on a name set twice around a function, a branch or a prefix:
    "step-after-function": (
        STEPS.format(between="ARGS=--tp-size\\ 4\nf() {{ :; }}", use="{use}"),
        "--tp-size 4 --elastic-ep-backend mooncake",
    ),
    "step-after-branch": (
        STEPS.format(between='if true; then ARGS="--tp-size 4"; fi', use="{use}"),
        "--tp-size 4 --elastic-ep-backend mooncake",
    ),
    "step-after-prefix": (
        STEPS.format(between='NCCL_DEBUG=INFO ARGS="--tp-size 1" true', use="{use}"),
        "--tp-size 8 --elastic-ep-backend mooncake",
    ),
    "step-after-quoted-parentheses": (
        STEPS.format(between='ARGS="--tp-size 4"\n' + HOSTNAME, use="{use}"),
        "--tp-size 4 --elastic-ep-backend mooncake",
    ),
    "export-continued-line": ("B=none\nexport NCCL_DEBUG=INFO \\\n  B=mooncake\n{use}", "mooncake"),
    "export-after-pipe": ("B=mooncake\necho x | \nexport B=none\n{use}", "mooncake"),
    "quoted-hash": (
        'B=none\nMSG="phase #1"\n[ -n "$MSG" ] && B=mooncake\necho "$MSG" >/dev/null\n{use}',
        "mooncake",
    ),
    # a step that adds the flag on one side of a test is read as taken, and one that
    # adds another backend as skipped:
    "step-after-then": (
        'EP=mooncake\nARGS="--tp-size 8"\n'
        'if [ -n "$EP" ]; then ARGS="$ARGS --elastic-ep-backend $EP"; fi\n{use}',
        "--tp-size 8 --elastic-ep-backend mooncake",
    ),
    "step-after-and": (
        'EP=mooncake\nARGS="--tp-size 8"\n'
        '[ -n "$EP" ] && ARGS="$ARGS --elastic-ep-backend $EP"\n{use}',
        "--tp-size 8 --elastic-ep-backend mooncake",
    ),
    "another-backend-after-and": (
        'ARGS="--elastic-ep-backend mooncake"\n'
        '[ -z "$ARGS" ] && ARGS="$ARGS --elastic-ep-backend none"\n{use}',
        "--elastic-ep-backend mooncake",
    ),
    # still read in order:
    "override-beside-a-loop": (
        'E=mooncake\nARGS="--elastic-ep-backend $E"\nfor i in 1; do :; done\n'
        'ARGS="$ARGS --elastic-ep-backend none"\n{use}',
        "--elastic-ep-backend mooncake --elastic-ep-backend none",
    ),
    "override-beside-an-or": (
        'E=mooncake\nARGS="--elastic-ep-backend $E"\nARGS="$ARGS --elastic-ep-backend none"\n'
        "false || true\n{use}",
        "--elastic-ep-backend mooncake --elastic-ep-backend none",
    ),
    "in-order-run": ("A=1 B=mooncake; B=none; {use}", "none"),
    "in-order-export": ("export A=1 B=mooncake\nB=none\n{use}", "none"),
    "in-order-after-a-piped-block": ("B=mooncake\necho | {{\ntrue\n}}\nB=none\n{use}", "none"),
    "in-order-export-after-a-bare-name": ("export A B=mooncake\nB=none\n{use}", "none"),
    "a-declaration-as-an-argument": ("B=mooncake; echo export A B=none; {use}", "mooncake"),
    "in-order-after-subshell": ("B=mooncake\n(\ntrue\n)\nB=none\n{use}", "none"),
    "in-order-after-cmdsub": ("B=mooncake; X=$(true); B=none; {use}", "none"),
    "in-order-quoted-parentheses": (
        'B=mooncake\nB=none\necho "usage: f()"\n' + HOSTNAME + "\n{use}",
        "none",
    ),
}


# What bash runs where dash does not, or stops: compared with bash alone.
BASH_ONLY = {
    # `|&` is a pipe (of stderr too): what comes after it runs in another process
    "pipe-and-stderr-into-a-block": ("B=mooncake\necho |& {{\nB=none\n}}\n{use}", "mooncake"),
    "pipe-and-stderr-over-lines": ("B=mooncake\necho |&\nB=none\n{use}", "mooncake"),
    # a read-only name keeps its value: bash goes on after the failed assignment (dash
    # stops: nothing is launched)
    "readonly-then-export": ("B=mooncake\nreadonly B\nexport A B=none\n{use}", "mooncake"),
    "readonly-then-assign": ("B=mooncake\nreadonly B\nB=none\n{use}", "mooncake"),
    "declare-r-then-assign": ("declare -r B=mooncake\nB=none\n{use}", "mooncake"),
    "readonly-end-of-options-then-assign": ("B=mooncake\nreadonly -- B\nB=none\n{use}",
                                            "mooncake"),
    # a block after `|` ends at a `}` right after `[[ … ]]`, not at a later function's
    "a-piped-block-closed-after-a-test": (
        'EP=none\n[ -z "$PATH" ] || EP=mooncake\nARGS="--tp 8"\n'
        'echo x | {{ read -r f; [[ -n $f ]] }}\nARGS="$ARGS --elastic-ep-backend $EP"\n'
        "function cleanup {{\n  true\n}}\n{use}",
        "--tp 8 --elastic-ep-backend mooncake"),
    # with bash's lastpipe, the last command of a pipeline runs in the script's own shell
    "lastpipe-step-in-a-piped-loop": (
        'shopt -s lastpipe\nEP=none\n[ -n "$PATH" ] && EP=mooncake\nARGS="--tp 8"\n'
        'echo h0 | while read -r h; do\n  ARGS="$ARGS --host $h --elastic-ep-backend $EP"\n'
        "done\n{use}", "--tp 8 --host h0 --elastic-ep-backend mooncake"),
    "ansi-c-quoted-here-document-delimiter": (
        "B=mooncake\ncat > /dev/null <<$'EOF'\nB=none\nEOF\n{use}", "mooncake"),
}
SHELL_CASES = [(*case, REAL_SHELLS) for case in OWN_SHELL.values()] + [
    (*case, ("bash",)) for case in BASH_ONLY.values()]


@pytest.mark.parametrize(("script", "value", "shells"), SHELL_CASES,
                         ids=[*OWN_SHELL.keys(), *BASH_ONLY.keys()])
def test_the_value_a_real_shell_launches_with_is_the_one_read(
    script: str, value: str, shells: tuple[str, ...]
) -> None:
    """What the launch gets, as bash and dash run the script, is what the reader reads:
    a mooncake value was hidden by a `none` set in another process, a comment, an
    argument or a here-document, by reading `export A=1 B=…` and `A=1 B=…` as setting
    only A, or by dropping a step that adds the flag to a name set twice (each read as
    no request, and the worker admitted unjudged, with no probe and no gate); a value set
    after a subshell or `$(…)` ends is still read in order."""
    name = "ARGS" if "ARGS=" in script else "B"
    for sh in shells:
        if shutil.which(sh) is None:
            continue
        # Only PATH from this machine: no variable it happens to export reaches the script.
        real = subprocess.run([sh, "-c", script.format(use=f'echo "${name}" >&2')],
                              capture_output=True, text=True, check=True,
                              env={"PATH": os.environ.get("PATH", os.defpath)}).stderr  # fmt: skip
        # (The last line: bash says on stderr where an assignment to a read-only name failed.)
        assert real.strip().splitlines()[-1] == value, (sh, real)
    launch = f"exec {SERVER} $ARGS" if name == "ARGS" else f"exec {SERVER} --elastic-ep-backend $B"
    r = read(["bash", "-c", script.format(use=launch)])
    assert r.requested is (value.split()[-1] == "mooncake"), (r.values, r.unresolved)
    assert r.unresolved is None, r.values
    assert not r.requested or r.where == "sh -c script", r.where  # read from the command


# A default written in the launch line itself, as bash and dash make it (no words after
# the script: $1 and "$@" are unset).
LAUNCH_DEFAULTS = {
    "double-quoted-word": ('--elastic-ep-backend ${EP:-"mooncake"}', "mooncake"),
    "single-quoted-word": ("--elastic-ep-backend ${EP:-'mooncake'}", "mooncake"),
    "escaped-word": ("--elastic-ep-backend ${EP:-moon\\cake}", "mooncake"),
    "nested": ("--elastic-ep-backend ${EP:-${DEFAULT_EP:-mooncake}}", "mooncake"),
    "nested-in-double-quotes": (
        '--elastic-ep-backend "${EP:-"${DEFAULT_EP:-mooncake}"}"', "mooncake"),
    "quoted-word-in-double-quotes": ('--elastic-ep-backend "${EP:-"mooncake"}"', "mooncake"),
    "positional": ('--elastic-ep-backend "${1:-mooncake}"', "mooncake"),
    "positional-unquoted": ("--elastic-ep-backend ${1:-mooncake}", "mooncake"),
    "all-positional": ('--elastic-ep-backend "${@:-mooncake}"', "mooncake"),
    "quoted-word-naming-none": ('--elastic-ep-backend ${EP:-"none"}', "none"),
    "nested-naming-none": ("--elastic-ep-backend ${EP:-${DEFAULT_EP:-none}}", "none"),
    # in double quotes a single quote, and a backslash before a letter, stay in the word
    # (SGLang then refuses the value: no request), where unquoted they go
    "single-quotes-kept-in-double-quotes": (
        "--elastic-ep-backend \"${EP:-'mooncake'}\"", "'mooncake'"),
    "backslash-kept-in-double-quotes": ('--elastic-ep-backend "${EP:-moon\\cake}"',
                                        "moon\\cake"),
}


@pytest.mark.parametrize(("flag", "value"), LAUNCH_DEFAULTS.values(), ids=LAUNCH_DEFAULTS.keys())
def test_a_default_in_the_launch_line_is_the_word_the_shell_makes(flag: str, value: str) -> None:
    """`--elastic-ep-backend ${EP:-"mooncake"}` (a common way to write a default),
    `${EP:-${DEFAULT_EP:-mooncake}}` and `"${1:-mooncake}"` launch with mooncake; the
    reading kept the quotes, cut the reference at its first `}` or knew no positional
    default, so the value was unresolved: warned and probed in the pod, but never gated
    (the model pulled before the probe ran). Each is read as bash and dash launch it
    where the image sets none of the names."""
    script = f"exec {SERVER} {flag}"
    for sh in REAL_SHELLS:
        if shutil.which(sh) is None:
            continue
        # (printf, not echo: dash's echo reads `\c` in `moon\cake` as "stop here")
        real = subprocess.run([sh, "-c", script.replace(f"exec {SERVER}", "printf '%s\\n'")],
                              capture_output=True, text=True, check=True,
                              env={"PATH": os.environ.get("PATH", os.defpath)}).stdout  # fmt: skip
        assert real.split() == ["--elastic-ep-backend", value], (sh, real)
    r = read(["bash", "-c", script])
    assert r.requested is (value == "mooncake"), r.values
    assert not r.requested or r.where == "sh -c script", r.where
    # (EP may be set in the image: `none` is the default assumed for it, so unresolved.)
    assert (r.unresolved is None) is r.requested, r.values


DEFAULTED_REFERENCES = {
    "set-positional-from-a-default": 'set -- ${EXTRA_ARGS:-}\n{launch} --model-path /m "$@"',
    "read-into-an-array": 'set -euo pipefail\nread -r -a EXTRA <<< "${EXTRA_ARGS:-}"\n'
                          '{launch} --model-path /m "${EXTRA[@]}"',
    "default-without-colon": 'set -- ${EXTRA_ARGS-}\n{launch} "$@"',
    "passed-as-one-argument": '{launch} --model-path /m --extra-args "${EXTRA_ARGS:-}"',
}


@pytest.mark.parametrize("script", DEFAULTED_REFERENCES.values(),
                         ids=DEFAULTED_REFERENCES.keys())
def test_an_env_value_put_in_through_a_default_is_a_request(script: str) -> None:
    """`set -- ${EXTRA_ARGS:-}; exec … "$@"` launches with the env's arguments, which
    no command places: the lenient reading put in `${EXTRA_ARGS` alone, read `…
    mooncake:-}`, and the worker was admitted unjudged (review helper). bash runs each
    with mooncake; each is read as a request."""
    env = {"EXTRA_ARGS": "--enable-eplb --elastic-ep-backend mooncake"}
    if shutil.which("bash") is not None:
        shell_env = {**env, "PATH": os.environ.get("PATH", os.defpath)}
        real = subprocess.run(["bash", "-c", script.replace("{launch}", "echo")],
                              capture_output=True, text=True, check=True,
                              env=shell_env).stdout  # fmt: skip
        assert real.split()[-2:] == ["--elastic-ep-backend", "mooncake"], real
    r = read(["bash", "-c", script.replace("{launch}", f"exec {SERVER}")], env=env)
    assert r.requested, (r.values, r.unresolved)


def test_a_step_in_a_piped_loop_counts_where_bash_may_run_it_in_its_own_shell() -> None:
    """`bash -O lastpipe` (or BASH_ENV, or a sourced file) runs the last command of a
    pipeline in the script's own shell, which the script's text need not say: a step in a
    piped block is read as taken, not dropped (it was, after a decoy `none`, and the
    worker admitted unjudged: review helper). Without lastpipe bash drops the step, and
    the reading errs on the side that judges the worker."""
    script = ('EP=mooncake\nARGS="--tp 8 --elastic-ep-backend none"\n'
              "get_role() { echo decode; }\nget_role | while read -r role; do\n"
              '  if [ "$role" = decode ]; then ARGS="$ARGS --elastic-ep-backend $EP"; fi\n'
              "done\n{use}")
    if shutil.which("bash") is not None:
        echo = script.replace("{use}", 'echo "$ARGS"')
        real = subprocess.run(["bash", "-O", "lastpipe", "-c", echo],
                              capture_output=True, text=True, check=True,
                              env={"PATH": os.environ.get("PATH", os.defpath)}).stdout  # fmt: skip
        assert real.split()[-1] == "mooncake", real
    launch = script.replace("{use}", f"exec {SERVER} $ARGS")
    for argv in (["bash", "-O", "lastpipe", "-c", launch], ["bash", "-c", launch]):
        r = read(argv)
        assert r.requested and r.where == "sh -c script", (argv[:3], r.values, r.unresolved)


@pytest.mark.parametrize("opener", ["<<'EOF'", "<<\\EOF", '<<"EOF"'])
def test_a_script_written_to_a_file_with_its_backend_set_in_it_is_a_request(
    opener: str, tmp_path: Path
) -> None:
    """A launch script written to a file and run (here or by another container) with
    its backend in a variable the script sets: no command of this container places it,
    and `--elastic-ep-backend $EP` there was no request (the worker admitted unwarned:
    review helper). bash runs it with mooncake; it is read as text no command places."""
    script = f'cat > "$F" {opener}\nEP=mooncake\n{{use}}\nEOF\nbash "$F"'
    env = {"F": str(tmp_path / "run.sh"), "PATH": os.environ.get("PATH", os.defpath)}
    real = subprocess.run(["bash", "-c", script.format(use='echo "$EP"')], capture_output=True,
                          text=True, check=True, env=env)  # fmt: skip
    assert real.stdout.split() == ["mooncake"]
    r = read(["bash", "-c", script.format(use=f"{SERVER} --elastic-ep-backend $EP")])
    # (`<<\\EOF`'s body words() reads as code, as before: there the launch is placed.)
    assert r.requested and r.where in (UNPLACED, "sh -c script"), (r.values, r.unresolved)
    # A value it does not set to mooncake, or not only, is still none of this (an
    # unquoted here-document takes the value the script has when it writes the file).
    reset = f'EP=mooncake; EP=none; cat > "$F" <<EOF\n{SERVER} --elastic-ep-backend $EP\nEOF'
    assert not read(["bash", "-c", reset]).requested
    # A comment sets nothing, before the script or in it.
    noted = "# EP=none\n" + script.format(use=f"{SERVER} --elastic-ep-backend $EP")
    assert read(["bash", "-c", noted]).requested
    noted = noted.replace("EP=mooncake", "# EP=none for prefill\nEP=mooncake")
    assert read(["bash", "-c", noted]).requested
    other = script.replace("EP=mooncake", "EP=none")
    assert not read(
        ["bash", "-c", other.format(use=f"{SERVER} --elastic-ep-backend $EP")]
    ).requested


UNKNOWN_BACKEND = {
    "in-a-branch": 'ARGS="--tp 8"\nif [ -n "$EP_BACKEND" ]; then\n'
    '  ARGS="$ARGS --elastic-ep-backend $EP_BACKEND"\nfi\n{use}',
    "after-an-or": 'cd / || exit 1\nARGS="--tp 8"\n'
    'ARGS="$ARGS --elastic-ep-backend $EP_BACKEND"\n{use}',
    "after-a-function": 'log() {{ echo "$*"; }}\nARGS="--tp 8"\n'
    'ARGS="$ARGS --elastic-ep-backend $EP_BACKEND"\n{use}',
    "contested-value": 'EP=none\n[ -n "$EP_BACKEND" ] && EP=$EP_BACKEND\n'
    'ARGS="--tp 8"\nARGS="$ARGS --elastic-ep-backend $EP"\n{use}',
    "assumed-default": 'log() {{ echo "$*"; }}\nARGS="--x"\n'
    'ARGS="$ARGS --elastic-ep-backend ${{EP_BACKEND:-none}}"\n{use}',
    "assumed-default-through-another-name": 'B="${{EP_BACKEND:-none}}"\n'
    'ARGS="$ARGS --elastic-ep-backend ${{B}}"\nfor i in 1; do :; done\n{use}',
    "default-assigned": ': ${{EP_BACKEND:=none}}\nARGS="--elastic-ep-backend $EP_BACKEND"\n{use}',
    "default-assigned-through-another-name": "B=${{EP_BACKEND:=none}}\n"
    'ARGS="--elastic-ep-backend $B"\n{use}',
    "set-only-in-a-subshell": 'ARGS="--elastic-ep-backend $EP_BACKEND"\n'
    "( export EP_BACKEND=none; true )\n{use}",
    "beside-an-own-default-asking-for-another": (
        'EP=${{EP:-"mooncake --elastic-ep-backend none"}}\n'
        'if [ -n "$EP_BACKEND" ]; then EP="$EP_BACKEND"; fi\n'
        'ARGS="--elastic-ep-backend $EP"\n{use}'),
    "beside-an-empty-value": 'start() {{ {use}; }}\nARGS=""\n'
    'ARGS="--elastic-ep-backend ${{EP_BACKEND}}"\nstart',
}


@pytest.mark.parametrize("script", UNKNOWN_BACKEND.values(), ids=UNKNOWN_BACKEND.keys())
def test_a_backend_known_only_at_launch_is_never_read_as_another(script: str) -> None:
    """A step or value whose backend comes from the image or an `envFrom` (bash launches
    with mooncake when EP_BACKEND holds it) stays unresolved (warned, probed) in a
    script with branches, an `||` or a function: the first cut of the taken/skipped
    rule read it as another backend and admitted the worker unwarned (review helper)."""
    env = {"EP_BACKEND": "mooncake", "PATH": os.environ.get("PATH", os.defpath)}
    real = subprocess.run(["bash", "-c", script.format(use='echo "$ARGS" >&2')],
                          capture_output=True, text=True, env=env).stderr  # fmt: skip
    assert "--elastic-ep-backend mooncake" in real, real
    r = read(["bash", "-c", script.format(use=f"exec {SERVER} $ARGS")])
    assert r.requested or r.unresolved is not None, r.values
    assert read(["bash", "-c", script.format(use=f"exec {SERVER} $ARGS")], env=env).requested


def _with_path(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PATH": os.environ.get("PATH", os.defpath)}


POSITIONALS_CHANGED = {
    "set-dash-dash": 'set -- mooncake\n{launch} --elastic-ep-backend "${{1:-none}}"',
    "set-words": 'set -e mooncake\n{launch} --elastic-ep-backend "${{1:-none}}"',
    "shift": 'shift\n{launch} --elastic-ep-backend "${{1:-none}}"',
    "a-functions-own": (
        "launch() {{ {launch} --elastic-ep-backend ${{1:-none}}; }}\nlaunch mooncake"),
}


@pytest.mark.parametrize("script", POSITIONALS_CHANGED.values(), ids=POSITIONALS_CHANGED.keys())
def test_a_positional_default_the_script_may_change_is_not_assumed_unset(script: str) -> None:
    """Where the script sets, shifts or (in a function) has its own positional
    parameters, `${1:-none}` past the words given is unknown, not unset: each launches
    mooncake, and was read as none, with nothing to warn (review helper). Read as
    unresolved (warned, probed), as before positional defaults were read."""
    args = ["prefill", "mooncake"] if script.startswith("shift") else []
    if shutil.which("bash") is not None:
        real = subprocess.run(["bash", "-c", script.format(launch="echo"), "sh", *args],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert real.split()[-2:] == ["--elastic-ep-backend", "mooncake"], real
    r = read(["bash", "-c", script.format(launch=f"exec {SERVER}"), "sh", *args])
    assert r.requested or r.unresolved is not None, r.values


def test_a_name_in_a_defaults_word_has_its_value_at_that_place() -> None:
    """`${EP_OVERRIDE:-$B}` with B set to mooncake, then to none: the first launch gets
    mooncake. Each B in a default's word took B's last value (none, none: no request,
    nothing to warn; review helper)."""
    script = ("B=mooncake\n{launch} --elastic-ep-backend ${{EP_OVERRIDE:-$B}} &\nB=none\n"
              "{launch} --port 30001 --elastic-ep-backend ${{EP_OVERRIDE:-$B}} &\nwait")
    env = {"EP_OVERRIDE": ""}
    if shutil.which("bash") is not None:
        real = subprocess.run(["bash", "-c", script.format(launch="echo")], capture_output=True,
                              text=True, check=True,
                              env=_with_path(env)).stdout  # fmt: skip
        assert sorted(line.split()[-1] for line in real.splitlines()) == ["mooncake", "none"]
    r = read(["bash", "-c", script.format(launch=SERVER)], env=env)
    assert r.requested and r.values == ["mooncake", "none"], r.values


def test_a_single_quote_in_a_double_quoted_default_is_a_letter_in_sh() -> None:
    """`echo "${BANNER:-starting the worker's server}"` before the launch: sh (dash,
    busybox, bash --posix) takes the quote as a letter. Read as a quote, it reached to
    the launch line's own quotes, the launch was read as echo's argument, and the worker
    was admitted unjudged (review helper)."""
    script = ('BACKEND=none\nif [ "$ROLE" = decode ]; then BACKEND=mooncake; fi\n'
              'echo "${{BANNER:-starting the worker\'s server}}" >&2\n'
              '{launch} --model-path /m --elastic-ep-backend "$BACKEND" '
              "--json-model-override-args '{{\"rope_scaling\": {{\"type\": \"yarn\"}}}}'\n")
    env = {"ROLE": "decode"}
    for sh in (["dash"], ["bash", "--posix"]):
        if shutil.which(sh[0]) is None:
            continue
        real = subprocess.run([*sh, "-c", script.format(launch="echo")], capture_output=True,
                              text=True, check=True,
                              env=_with_path(env)).stdout  # fmt: skip
        assert "--elastic-ep-backend mooncake" in real, (sh, real)
    r = read(["sh", "-c", script.format(launch=f"exec {SERVER}")], env=env)
    assert r.requested and r.where == "sh -c script", (r.values, r.where)


DEFAULT_WHERE_A_BRANCH_DOES_NOT_RUN = {
    "then": 'if [ "$ROLE" = prefill ]; then EP=none; fi\n'
            "{launch} --elastic-ep-backend ${{EP:-mooncake}}",
    "and": '[ "$ROLE" = prefill ] && EP=none\n{launch} --elastic-ep-backend "${{EP:-mooncake}}"',
    "nested": 'if [ "$ROLE" = prefill ]; then EP=none; fi\n'
              "{launch} --elastic-ep-backend ${{EP:-${{DEFAULT_EP:-mooncake}}}}",
    "quoted-after-an-empty-value": "EP=\nif [ \"$ROLE\" = prefill ]; then EP=none; fi\n"
                                   "{launch} --elastic-ep-backend ${{EP:-'moon'cake}}",
}


@pytest.mark.parametrize("script", DEFAULT_WHERE_A_BRANCH_DOES_NOT_RUN.values(),
                         ids=DEFAULT_WHERE_A_BRANCH_DOES_NOT_RUN.keys())
def test_a_default_at_a_use_counts_where_the_branch_that_sets_the_name_does_not_run(
    script: str,
) -> None:
    """The prefill role sets EP=none; every other role launches the default, mooncake.
    EP was read as none everywhere (the lenient reading saw the nested and quoted
    defaults not at all, and the plain one only as text no command places: never
    gated), and the decode workers admitted unjudged (review helper)."""
    env = {"ROLE": "decode"}
    for sh in REAL_SHELLS:
        if shutil.which(sh) is None:
            continue
        real = subprocess.run([sh, "-c", script.format(launch="echo")], capture_output=True,
                              text=True, check=True, env=_with_path(env)).stdout  # fmt: skip
        assert real.split() == ["--elastic-ep-backend", "mooncake"], (sh, real)
    r = read(["bash", "-c", script.format(launch=f"exec {SERVER}")], env=env)
    assert r.requested and r.where == "sh -c script", (r.values, r.where)


# (script, env, words after the script): each launches mooncake in bash and dash.
WHAT_SETS_IT_MAY_NOT_RUN = {
    "the-pods-env-value-past-a-branch": (
        'if [ "$ROLE" = prefill ]; then EP=none; fi\n'
        '{launch} --elastic-ep-backend "${{EP:-"mooncake"}}"', {"EP": "mooncake"}),
    "the-pods-env-value-past-an-and": (
        '[ "$ROLE" = prefill ] && EP=none\n{launch} --elastic-ep-backend "$EP"',
        {"EP": "mooncake"}),
    "a-default-naming-what-the-script-sets": (
        'DEFAULT_EP=mooncake\nif [ "$ROLE" = prefill ]; then EP=none; fi\n'
        '{launch} --elastic-ep-backend "${{EP:-$DEFAULT_EP}}"', {}),
    "a-default-past-a-block-over-lines": (
        'if [ "$ROLE" = prefill ]; then\n  EP=none\nfi\n'
        '{launch} --elastic-ep-backend "${{EP:-mooncake}}"', {}),
    "an-always-run-assignment-empty-at-launch": (
        'EP_BACKEND="${{EP_BACKEND_OVERRIDE}}"\n'
        'if [ "$ROLE" = prefill ]; then EP_BACKEND="none"; fi\n'
        '{launch} --elastic-ep-backend "${{EP_BACKEND:-mooncake}}"', {"EP_BACKEND_OVERRIDE": ""}),
    "set-after-the-launch-started": (
        'if [ "$ROLE" = prefill ]; then EP=none; fi\n'
        "{launch} --elastic-ep-backend ${{EP:-mooncake}} &\nEP=done\nwait", {}),
    "a-default-whose-name-a-block-sets": (
        'if [ "$ROLE" = prefill ]; then EP=none; DEF=none; fi\n'
        '{launch} --elastic-ep-backend "${{EP:-${{DEF:-mooncake}}}}"', {}),
    "a-self-default-emptied-in-a-block": (
        'EP_ARGS="${{EP_ARGS:-"--moe-a2a-backend deepep --elastic-ep-backend mooncake"}}"\n'
        'if [ "${{DISAGG_MODE:-decode}}" = prefill ]; then\n  EP_ARGS=""\nfi\n'
        "{launch} ${{EP_ARGS}}", {}),
}


@pytest.mark.parametrize(("script", "env"), WHAT_SETS_IT_MAY_NOT_RUN.values(),
                         ids=WHAT_SETS_IT_MAY_NOT_RUN.keys())
def test_the_value_a_name_has_where_what_sets_it_does_not_run_counts(
    script: str, env: dict[str, str]
) -> None:
    """The decode role skips the branch that sets none: it launches the pod's own
    `EP=mooncake` or the default at the use, which were read as none (no request, or one
    only in text no command places, never gated or probed: the second review of this
    reader). An assignment on its own line in a block may not run either."""
    env = {**env, "ROLE": "decode"}
    for sh in REAL_SHELLS:
        if shutil.which(sh) is None:
            continue
        real = subprocess.run([sh, "-c", script.format(launch="echo")], capture_output=True,
                              text=True, check=True, env=_with_path(env)).stdout  # fmt: skip
        assert real.split()[-2:] == ["--elastic-ep-backend", "mooncake"], (sh, real)
    r = read(["bash", "-c", script.format(launch=f"exec {SERVER}")], env=env)
    assert r.requested and r.where == "sh -c script", (r.values, r.where)


def test_what_may_change_the_positional_parameters_is_found_where_it_stands() -> None:
    """`shift` after `then` (the first review's fix looked only at a command's start)
    makes `${1:-none}` unknown, and `set -o pipefail` changes nothing (a pattern read
    `pipefail` as a parameter, and `${1:-mooncake}` as certain)."""
    shifted = (f'if [ "$1" = "--" ]; then shift; fi\n'
               f'exec {SERVER} --elastic-ep-backend "${{1:-none}}"')
    r = read(["bash", "-c", shifted, "sh", "--", "mooncake"])
    assert r.requested or r.unresolved is not None, r.values
    assert shell._may_shift("for i in 1; do set -- m; done") and shell._may_shift("eval set -- $E")
    # (not a sourced file, `source /opt/venv/bin/activate`, nor an argument)
    for other in (". ./args.sh", "source /opt/venv/bin/activate", "./run.sh",
                  'echo "env set up"', "find . -name x"):
        assert not shell._may_shift(other + "\nexec x"), other
    for options in ("set -o pipefail", "set -euo pipefail", "set -x", "set +o errexit -e"):
        assert not shell._may_shift(options + "\nexec x"), options
    piped = f'set -o pipefail\nexec {SERVER} --elastic-ep-backend "${{1:-mooncake}}"'
    r = read(["bash", "-c", piped, "sh", "none"])
    assert not r.requested or r.where != "sh -c script", (r.values, r.where)


# (script, env): what always runs sets the name before the launch; bash launches none.
SET_BY_WHAT_ALWAYS_RUNS = {
    "its-own-default-step": (
        'EP="${{EP:-none}}"\n{launch} --elastic-ep-backend "${{EP:-mooncake}}"', {}),
    "a-command-substitution": (
        "EP=$(echo none)\n{launch} --elastic-ep-backend ${{EP}}", {"EP": "mooncake"}),
    "a-declaration-with-an-option": (
        "declare -x EP=none\n{launch} --elastic-ep-backend $EP", {"EP": "mooncake"}),
}


@pytest.mark.parametrize(("script", "env"), SET_BY_WHAT_ALWAYS_RUNS.values(),
                         ids=SET_BY_WHAT_ALWAYS_RUNS.keys())
def test_what_always_runs_before_a_use_leaves_no_default_and_no_env_value(
    script: str, env: dict[str, str]
) -> None:
    """A default at a use, or the pod's env value, counts only where nothing that always
    runs set the name before: each of these launches none and was gated (the third
    review of this reader)."""
    if shutil.which("bash") is not None:
        real = subprocess.run(["bash", "-c", script.format(launch="echo")], capture_output=True,
                              text=True, check=True, env=_with_path(env)).stdout  # fmt: skip
        assert real.split() == ["--elastic-ep-backend", "none"], real
    r = read(["bash", "-c", script.format(launch=f"exec {SERVER}")], env=env)
    assert not (r.requested and r.where == "sh -c script"), (r.values, r.where)
