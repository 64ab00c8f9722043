"""The reader agrees with SGLang's own parser, release by release.

For every cached SGLang release, SGLang's real parser (``ServerArgs.add_cli_args`` on an
``argparse.ArgumentParser``, in the real-package environment: real torch, the release's
pinned transformers) runs as a long-lived child (scripts/sglang_options.py SERVE) and
judges hypothesis-generated command lines over that release's real option table: flags
with and without values, prefixes, ``=``, repeats, ``--``. The reader, with that release's
table, must give the same answer on each line wrapped in every launcher and wrapper form.
Where SGLang refuses to start (an ambiguous prefix, a missing value, a bad choice or
type), either answer is allowed; those cases are counted and printed.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epguard.probe import cmdline
from scripts import sglang_options
from tests.probe.probe_harness import overlay, torch_python

pytestmark = [pytest.mark.realpkg, pytest.mark.bulk]

RELEASES = [t.release for t in cmdline.tables()]
EXAMPLES = 300
# Values a generated option may get: the backend's choices (and one it refuses) for the
# backend, numbers (most options are ints) and a word for the rest.
BACKEND_VALUES = ["mooncake", "mooncake", "mooncake", "none", "nixl", "MoonCake"]
OTHER_VALUES = ["8", "8", "1", "0.5", "x", "mooncake"]


class SGLangParser:
    """SGLang's parser for one release, in a child process, one argv per request."""

    def __init__(self, release: str) -> None:
        path = overlay(f"sglang-{release}")
        self.proc = subprocess.Popen(
            [str(torch_python()), "-c", sglang_options.SERVE],
            env=sglang_options.parser_env(path),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        ready = json.loads(self.proc.stdout.readline() or "{}")
        assert ready.get("ready") == release, f"SGLang {release}'s parser did not start"
        # What scripts/sglang_options.py records for this release, read from the parser
        # this process built.
        self.table: dict[str, Any] = ready["table"]

    def judge(self, argv: list[str]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        result: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return result

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module", params=RELEASES)
def sglang(request: pytest.FixtureRequest) -> Iterator[tuple[str, SGLangParser]]:
    parser = SGLangParser(request.param)
    yield request.param, parser
    parser.close()


def _options(release: str) -> list[tuple[object, str]]:
    table = next(t for t in cmdline.tables() if t.release == release)
    return [
        (nargs, name) for nargs, names in table.options for name in names if name.startswith("--")
    ]


@st.composite
def server_args(draw: st.DrawFn, release: str) -> list[str]:
    options = _options(release)
    backend = [(o, n) for o, n in options if n == cmdline.BACKEND]
    near = [(o, n) for o, n in options if n.startswith(("--elastic", "--enable-dp", "--ep"))]
    # Options that take no value never make SGLang refuse a line, and they are the ones a
    # hand-kept flag list gets wrong (--enable-dp-lm-head swallowing the next word).
    flags = [(o, n) for o, n in options if o == 0]
    # --model-path is required: without it SGLang refuses every line.
    out: list[str] = ["--model-path", "m"]
    for _ in range(draw(st.integers(0, 6))):
        nargs, name = draw(
            st.sampled_from(backend)
            | st.sampled_from(near)
            | st.sampled_from(flags)
            | st.sampled_from(options)
        )
        if draw(st.integers(0, 7)) == 0:  # an abbreviation: argparse decides if it is one
            # Mostly long ones (often unique), sometimes short ones (often ambiguous).
            shortest = draw(st.sampled_from([3, max(3, len(name) - 8)]))
            name = name[: draw(st.integers(shortest, len(name)))]
        values = BACKEND_VALUES if cmdline.BACKEND.startswith(name) else OTHER_VALUES
        value = draw(st.sampled_from(values))
        # Mostly what SGLang accepts (a value where one is taken, none where not); now and
        # then what it refuses (a missing value, "=" on a flag).
        form = draw(st.sampled_from(["plain"] * 6 + ["equals"] * 2 + ["odd"]))
        if form == "odd":
            out += [name] if nargs != 0 else [f"{name}={value}"]
        elif nargs == 0:
            out.append(name)
        elif form == "equals":
            out.append(f"{name}={value}")
        else:
            out += [name, value]
        if draw(st.integers(0, 20)) == 0:
            out.append("--")
    return out


def wrapped(args: list[str]) -> list[tuple[str, list[str], dict[str, str]]]:
    """One command line in every launcher and wrapper form the reader knows, with the
    container environment the form reads (``$LAUNCH``)."""
    launch = ["python3", "-m", "sglang.launch_server", *args]
    line = shlex.join(launch)
    plain: list[tuple[str, list[str]]] = [
        ("python -m", launch),
        (
            "abs interpreter",
            ["/opt/venv/bin/python3.11", "-u", "-m", "sglang.launch_server", *args],
        ),
        ("sglang serve", ["sglang", "serve", *args]),
        ("dynamo.sglang", ["python3", "-m", "dynamo.sglang", *args]),
        ("sh -c", ["sh", "-c", line]),
        ("bash -o pipefail -c", ["bash", "-o", "pipefail", "-c", line + " 2>&1 | tee /l"]),
        ("busybox sh -c", ["busybox", "sh", "-c", line]),
        (
            "bash -euxc, wrappers",
            [
                "bash",
                "-euxc",
                "cd /w; exec env A=1 nohup timeout 9h numactl -N 0 taskset -c 0-7 " + line,
            ],
        ),
        ("script with two commands", ["sh", "-c", "echo start && " + line + "\nwait"]),
        ("nested sh -c", ["sh", "-c", "sh -c 'true'; bash -lc " + shlex.quote(line)]),
        ("dash -c", ["dash", "-c", line]),
        ("assignments before the command", ["sh", "-c", "A=1 B='x y' " + line]),
        ("; script", ["sh", "-c", "set -e; cd /w; " + line + "; echo done"]),
    ]
    with_env = ("variable from the container env", ["sh", "-c", 'exec sh -c "$LAUNCH"'],
                {"LAUNCH": line})  # fmt: skip
    return [(form, argv, {}) for form, argv in plain] + [with_env]


STATS: Counter[str] = Counter()


def test_reader_agrees_with_sglangs_own_parser(sglang: tuple[str, SGLangParser]) -> None:
    release, parser = sglang

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(server_args(release))
    def check(args: list[str]) -> None:
        truth = parser.judge(args)
        STATS[f"{release} cases"] += 1
        if not truth["ok"]:
            STATS[f"{release} refused by SGLang"] += 1
            return
        expected = truth["backend"] == cmdline.WANTED
        STATS[f"{release} requested"] += expected
        for form, argv, env in wrapped(args):
            got = cmdline.read(argv, env=env, release=release)
            assert got.requested is expected, (form, argv, truth, got.refusals)

    check()
    cases = STATS[f"{release} cases"]
    print(
        f"\nSGLang {release}: {cases} generated cases x {len(wrapped([]))} forms; "
        f"{STATS[f'{release} refused by SGLang']} refused by SGLang, "
        f"{STATS[f'{release} requested']} request mooncake"
    )
    assert cases >= EXAMPLES // 2
    assert STATS[f"{release} requested"] > 0  # the corpus does exercise the question


# What `scripts/sglang_options.py --check` asks, in three parts, so that each cached
# release's parser is built once in the session (the fixture's process) and not twice.


def test_the_shipped_table_is_what_this_release_defines(sglang: tuple[str, SGLangParser]) -> None:
    release, parser = sglang
    shipped = json.loads(sglang_options.OUT.read_text())["releases"][release]
    assert parser.table["options"] == shipped["options"], "rerun scripts/sglang_options.py"
    assert parser.table["backend_choices"] == shipped["backend_choices"]


def test_every_cached_release_is_in_the_shipped_table() -> None:
    cached = [o.name.removeprefix("sglang-") for o in sglang_options.sglang_overlays()]
    assert cached, "no cached SGLang release: run `make tools`"
    assert set(cached) <= set(RELEASES), "rerun scripts/sglang_options.py"


def test_the_shipped_table_is_rendered_as_the_script_renders_it() -> None:
    text = sglang_options.OUT.read_text()
    assert sglang_options.render(json.loads(text)) == text
