"""The webhook, `epguard check` and the in-pod probe give the same answer to "does this
container ask for mooncake elastic EP?" on the same command lines: one test, three entry
points, each used the way it is in production (HTTPS /validate on a real TLS server, the
CLI on a manifest file, the probe directory run as ``python3 probe -- ARGV``)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from epguard.webhook.command import main
from tests import realmanifests
from tests.factory import DENY_ALL_RULES, container, pod, review
from tests.probe.probe_harness import PROBE_DIR, clean_env
from tests.servers import RunningServer, running_server

FLAG = ["--elastic-ep-backend", "mooncake"]
LAUNCH = ["python3", "-m", "sglang.launch_server", "--model-path", "m"]


def _cases() -> list[tuple[str, list[str]]]:
    cases: list[tuple[str, list[str]]] = []
    for line in realmanifests.command_lines():
        cases.append((f"real line {line.line} as sh -c", ["sh", "-c", line.text]))
        words = shlex.split(line.text)
        if not any(w in ("&", "&&", "2>&1") for w in words):
            cases.append((f"real line {line.line} as a list", words))
    cases += [
        ("dp-lm-head before the flag", [*LAUNCH, "--enable-dp-lm-head", *FLAG]),
        (
            "bash -o pipefail",
            ["bash", "-o", "pipefail", "-c", shlex.join([*LAUNCH, *FLAG]) + " 2>&1 | tee log"],
        ),
        ("busybox sh", ["busybox", "sh", "-c", shlex.join([*LAUNCH, *FLAG])]),
        (
            "two launch lines",
            [
                "sh",
                "-c",
                shlex.join([*LAUNCH, "--elastic-ep-backend", "none"])
                + "; "
                + shlex.join([*LAUNCH, *FLAG]),
            ],
        ),
        (
            "sh -c before the launch",
            ["sh", "-c", "sh -c 'echo hi' && " + shlex.join([*LAUNCH, *FLAG])],
        ),
        (
            "wrappers",
            ["env", "A=1", "nohup", "numactl", "-N", "0", "taskset", "-c", "0-3", *LAUNCH, *FLAG],
        ),
        ("equals form", [*LAUNCH, "--elastic-ep-backend=mooncake"]),
        ("long prefix", [*LAUNCH, "--elastic-ep-backe", "mooncake"]),
        ("none", [*LAUNCH, "--elastic-ep-backend", "none"]),
        ("elasticsearch", ["filebeat", "--elasticsearch-url", "http://es:9200"]),
        ("flag after --", [*LAUNCH, "--", *FLAG]),
        ("commented out", ["bash", "-c", shlex.join(LAUNCH) + " # --elastic-ep-backend mooncake"]),
    ]
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def deny_all_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tmp_path_factory.mktemp("server"), DENY_ALL_RULES) as s:
        yield s


def worker_pod(argv: list[str]) -> dict[str, object]:
    return pod([container(image=realmanifests.CONCRETE_IMAGE, command=argv, args=[])])


def webhook_says(server: RunningServer, argv: list[str]) -> bool:
    with server.client() as c:
        resp = c.post("/validate", json=review(worker_pod(argv)))
    resp.raise_for_status()
    return not resp.json()["response"]["allowed"]


def check_says(tmp_path: Path, rules: Path, argv: list[str]) -> bool:
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(worker_pod(argv)))
    code = main(["check", "--rules", str(rules), str(path)])
    assert code in (0, 1)
    return code == 1


def probe_says(tmp_path: Path, argv: list[str]) -> bool:
    # The venv's Python has no torch: a requested check ends quickly with "unusable";
    # what matters here is only whether the probe found a request at all.
    proc = subprocess.run(
        [
            sys.executable,
            str(PROBE_DIR),
            "--json",
            "--termination-log",
            "",
            "--timeout",
            "30",
            "--",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        cwd=tmp_path,
    )
    report = json.loads(proc.stdout)
    # A request read only on the safe side (text no command places) is one the webhook
    # judges by rules and verdicts but never probes, and the probe says so instead of
    # judging it: the same answer, given as "nothing to check" (docs/cmdline.md).
    return bool(
        report["verdict"] != "not-requested" or "text no command places" in report["message"]
    )


@pytest.mark.parametrize(("what", "argv"), CASES, ids=[w for w, _ in CASES])
def test_webhook_check_and_probe_give_the_same_answer(
    what: str,
    argv: list[str],
    deny_all_server: RunningServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(DENY_ALL_RULES)
    answers = {
        "webhook": webhook_says(deny_all_server, argv),
        "check": check_says(tmp_path, rules, argv),
        "probe": probe_says(tmp_path, argv),
    }
    capsys.readouterr()
    assert len(set(answers.values())) == 1, answers
    labelled = next(
        (
            c.requests_mooncake
            for c in realmanifests.command_lines()
            if what.startswith(f"real line {c.line} ")
        ),
        None,
    )
    if labelled is not None:
        assert answers["webhook"] is labelled


def test_the_three_agree_on_generated_command_lines(
    deny_all_server: RunningServer, tmp_path: Path
) -> None:
    # A sample of the corpus that tests/probe/test_sglang_parser.py checks against
    # SGLang's own parser (hypothesis over the real option tables), through all three
    # entry points: the probe is a process per case, so a sample, not all of it.
    from hypothesis import HealthCheck, given, settings

    from tests.probe.test_sglang_parser import server_args

    rules = tmp_path / "rules.yaml"
    rules.write_text(DENY_ALL_RULES)
    seen: list[bool] = []

    @settings(max_examples=30, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(server_args("0.5.23"))
    def check(args: list[str]) -> None:
        launch = ["python3", "-m", "sglang.launch_server", *args]
        for argv in (launch, ["sh", "-c", shlex.join(launch)]):
            answers = {
                "webhook": webhook_says(deny_all_server, argv),
                "check": check_says(tmp_path, rules, argv),
                "probe": probe_says(tmp_path, argv),
            }
            assert len(set(answers.values())) == 1, (argv, answers)
            seen.append(answers["webhook"])

    check()
    assert True in seen and False in seen  # the sample asks both questions
