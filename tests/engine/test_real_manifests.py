"""Public SGLang manifests and command lines (tests/realmanifests.py): with a rule that
denies every image, `epguard check` refuses exactly the files labelled as requesting
mooncake elastic EP, of every kind in the folder, and none of the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from epguard.probe import cmdline
from epguard.webhook.command import main
from tests import realmanifests
from tests.factory import DENY_ALL_RULES


@pytest.fixture
def deny_all(tmp_path: Path) -> str:
    path = tmp_path / "rules.yaml"
    path.write_text(DENY_ALL_RULES)
    return str(path)


MANIFESTS = realmanifests.manifests()


@pytest.mark.parametrize("manifest", MANIFESTS, ids=[m.file for m in MANIFESTS])
def test_check_refuses_exactly_the_files_labelled_yes(
    manifest: realmanifests.Manifest,
    deny_all: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / manifest.file
    path.write_text(yaml.safe_dump_all(manifest.documents))
    code = main(["check", "--rules", deny_all, "-o", "json", str(path)])
    out, _ = capsys.readouterr()
    denied = [r for r in json.loads(out) if not r["allowed"]]
    assert code == (1 if manifest.requests_mooncake else 0), out
    assert bool(denied) is manifest.requests_mooncake, out
    for r in denied:
        assert "deny-everything" in r["message"]


def test_the_folder_covers_every_kind_epguard_was_asked_to_judge() -> None:
    realmanifests.require()
    kinds = {d["kind"] for m in MANIFESTS for d in m.documents if m.requests_mooncake}
    assert {
        "DynamoGraphDeployment",
        "LeaderWorkerSet",
        "RoleBasedGroup",
        "DisaggregatedSet",
        "ClusterServingRuntime",
        "StatefulSet",
        "Deployment",
    } <= kinds


LINES = realmanifests.command_lines()


@pytest.mark.parametrize("line", LINES, ids=[f"line{c.line}" for c in LINES])
def test_real_command_lines_are_read_as_labelled(line: realmanifests.CommandLine) -> None:
    # The lines are shell text (or lists joined with spaces): read them as a shell would.
    assert cmdline.read(["sh", "-c", line.text]).requested is line.requests_mooncake
