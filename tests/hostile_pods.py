"""Hostile admission inputs, shared by the bounded-work test and bench/argv_bench.py.

* ``nested_script_pod``: 48 containers, each a ~64 KB ``sh -c`` script that nests
  ``bash -c '…'`` inside itself and asks for mooncake at the bottom; every container
  differs, so no cache helps.
* ``doubling_env_pod``: a ~1.5 KB pod whose ``$(VAR)`` chain doubles at each step (the
  last variable would be 2**40 times the first).
"""

from __future__ import annotations

import shlex
from typing import Any

CONTAINERS = 48
SCRIPT_BYTES = 64 * 1024
# Refused by the test rules (tests/factory.py TEST_RULES).
IMAGE = "docker.io/lmsysorg/sglang:v0.5.16-cu129"


def _pod(name: str, containers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"containers": containers},
    }


def _worker(*before: str) -> dict[str, Any]:
    """A worker asking for mooncake, ``before`` its launcher."""
    return {
        "name": "worker",
        "image": IMAGE,
        "command": [*before, "python3", "-m", "sglang.launch_server"],
        "args": ["--elastic-ep-backend", "mooncake"],
    }


def _nested_script(i: int, size: int = SCRIPT_BYTES) -> str:
    launch = f"python3 -m sglang.launch_server --port {8000 + i} --elastic-ep-backend mooncake"
    filler = " ".join(f"echo step-{i}-{n};" for n in range(60))
    script = launch
    while True:
        wrapped = f"{filler} bash -c {shlex.quote(script)}"
        if len(wrapped) > size:
            # Pad to the size asked for: more plain commands in front.
            pad = size - len(script) - 1
            return ("true; " * (pad // 6 + 1))[:pad] + "\n" + script
        script = wrapped


def nested_script_pod(size: int = SCRIPT_BYTES) -> dict[str, Any]:
    containers = [
        {"name": f"w{i}", "image": IMAGE, "command": ["sh", "-c", _nested_script(i, size)]}
        for i in range(CONTAINERS)
    ]
    return _pod("nested", containers)


def doubling_env_pod(steps: int = 40) -> dict[str, Any]:
    env = [{"name": "V0", "value": "--elastic-ep-backend mooncake "}]
    env += [{"name": f"V{n}", "value": f"$(V{n - 1})$(V{n - 1})"} for n in range(1, steps)]
    container = {
        "name": "worker",
        "image": IMAGE,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": [f"$(V{steps - 1})"],
        "env": env,
    }
    return _pod("doubling", [container])


def many_words_pod(words: int = 1000) -> dict[str, Any]:
    """48 containers, each a distinct plain argv of ``words`` words asking for mooncake:
    argparse's share of the work, which the per-review parse budget bounds."""
    containers = []
    for i in range(CONTAINERS):
        args = [
            "--model-path",
            f"m{i}",
            *(["--tp", "1"] * (words // 2)),
            "--elastic-ep-backend",
            "mooncake",
        ]
        containers.append(
            {
                "name": f"w{i}",
                "image": IMAGE,
                "command": ["python3", "-m", "sglang.launch_server"],
                "args": args,
            }
        )
    return _pod("words", containers)


def wrapper_prefix_pod(words: int = 245_000) -> dict[str, Any]:
    """A ~1.4 MB pod: a first container that is plainly not mooncake (so a check that
    stops at the first answer stays cheap), then one whose command is ``words`` words of
    ``A=1`` in front of a launcher asking for mooncake -- a copy of the line per skipped
    word made reading it quadratic."""
    plain = {"name": "plain", "image": IMAGE, "args": ["--elastic-ep-backend", "none"]}
    return _pod("prefix", [plain, _worker(*["A=1"] * words)])


def unclosed_groups_pod(size: int = 30_000) -> dict[str, Any]:
    """Two containers of groups that never close, each ``size`` characters: ``$(`` with no
    ``)`` (the kubelet's expansion; a pattern scanned to the end from each took 2.9 s at
    40 KB) and a brace group ``{,,,…`` (a backtracking pattern took 5.7 s at 30,000
    commas), then a worker asking for mooncake."""
    return _pod("unclosed", [
        {"name": "refs", "image": IMAGE, "command": ["sh", "-c", "echo " + "$(" * (size // 2)],
         "env": [{"name": "X", "value": "1"}]},
        {"name": "braces", "image": IMAGE,
         "command": ["bash", "-c", "echo --elastic-ep-backend {" + "," * size]},
        _worker(),
    ])  # fmt: skip


def assignment_like_pod(size: int = 30_000) -> dict[str, Any]:
    """A script of ``size`` characters of what the reader's assignment patterns look at
    (`a[ ` and `;a[` with no `]`, `B=x&&`, `export -x -y`, `{V=`, `${a:=` with no `}`),
    after a launch line whose value is a variable: an element pattern that scanned to the
    end of the line from each `a[` took 863 ms, each `{V=` read a value to the end of the
    text (6.1 s and 150 MB at 30 KB), and each `${` was scanned to the end for its `}`
    (113 ms) (found by review helpers)."""
    part = size // 6
    script = (
        "python3 -m sglang.launch_server --elastic-ep-backend $B\n"
        + "a[ " * (part // 3)
        + "\n"
        + "B=x&&" * (part // 5)
        + "\n"
        + "export -x -y " * (part // 13)
        + "\n"
        + "{V=" * (part // 3)
        + "\n"
        + ";a[" * (part // 3)
        + "\n"
        + "${a:=" * (part // 5)
    )
    script_container = {"name": "script", "image": IMAGE, "command": ["bash", "-c", script]}
    return _pod("assignment-like", [script_container, _worker()])


def references_pod(size: int = 30_000) -> dict[str, Any]:
    """A script of ``size`` characters of parameter references that never close or nest
    past the limit, with quotes inside (`${`, `"${`, `A="${x` after `;`, `${"x" `,
    `${a:-` five hundred deep), after a launch line whose value is a variable: what
    shell.references() and an assigned value's double quotes look at."""
    part = size // 5
    script = (
        "python3 -m sglang.launch_server --elastic-ep-backend $B\n"
        + "${" * (part // 2)
        + "\n"
        + '"${' * (part // 3)
        + "\n"
        + ';A="${x' * (part // 7)
        + "\n"
        + '${"x" ' * (part // 6)
        + "\n"
        + "${a:-" * 500 + "}" * 500
    )
    script_container = {"name": "script", "image": IMAGE, "command": ["bash", "-c", script]}
    return _pod("references", [script_container, _worker()])
