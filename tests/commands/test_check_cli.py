"""`epguard check`: the same engine offline, for CI pipelines."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml

from epguard.webhook.command import main
from tests.factory import GOOD_IMAGE, TEST_RULES, container, pod, pod_spec, template, workload


@pytest.fixture
def rules(tmp_path: Path) -> str:
    path = tmp_path / "rules.yaml"
    path.write_text(TEST_RULES)
    return str(path)


def write(tmp_path: Path, *docs: object, name: str = "m.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


def test_exits_1_and_prints_the_denial_in_the_webhooks_words(
    tmp_path: Path, rules: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, workload("Deployment"), {"apiVersion": "v1", "kind": "Service"})
    assert main(["check", "--rules", rules, path]) == 1
    out, err = capsys.readouterr()
    assert f'{path}: Deployment ml/w: DENY: container "worker" in spec.template' in out
    assert "[epguard rule sglang-0516-cu129-test]" in out
    assert "1 object(s) checked (1 of other kinds skipped), 1 denied" in err


def test_a_flag_the_shell_joins_from_quoted_pieces_is_judged(
    tmp_path: Path, rules: str, capsys: pytest.CaptureFixture[str]
) -> None:
    script = "exec python3 -m sglang.launch_server -''-elastic-ep-backend mooncake"
    path = write(tmp_path, pod([container(command=["sh", "-c", script], args=[])]))
    assert main(["check", "--rules", rules, path]) == 1
    assert 'DENY: container "worker"' in capsys.readouterr().out


def test_exits_0_with_warnings_only(
    tmp_path: Path, rules: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, pod([container(image=GOOD_IMAGE)]))
    assert main(["check", "--rules", rules, path]) == 0
    assert 'WARN: container "worker"' in capsys.readouterr().out


def test_reads_helm_template_output_on_stdin(
    rules: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rendered = (
        "---\n# Source: chart/templates/deploy.yaml\n"
        + yaml.safe_dump(workload("StatefulSet"))
        + "---\n# Source: chart/templates/empty.yaml\n---\n"
        + yaml.safe_dump(
            workload("Deployment", template(pod_spec([container(image=GOOD_IMAGE, args=[])])))
        )
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(rendered))
    assert main(["check", "--rules", rules, "-"]) == 1
    out = capsys.readouterr().out
    assert "<stdin>: StatefulSet ml/w: DENY" in out and "Deployment" not in out


def test_unpacks_lists(tmp_path: Path, rules: str, capsys: pytest.CaptureFixture[str]) -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [pod(name="a"), workload("CronJob", name="b")],
    }
    assert main(["check", "--rules", rules, write(tmp_path, doc)]) == 1
    out = capsys.readouterr().out
    assert "Pod ml/a: DENY" in out and "CronJob ml/b: DENY" in out


def test_warn_mode_reports_but_passes(
    tmp_path: Path, rules: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "--rules", rules, "--mode", "warn", write(tmp_path, pod())]) == 0
    assert "WOULD DENY (warn mode)" in capsys.readouterr().out


def test_honours_and_can_ignore_the_skip_annotation(tmp_path: Path, rules: str) -> None:
    path = write(tmp_path, pod(annotations={"epguard.io/skip": "checked"}))
    assert main(["check", "--rules", rules, path]) == 0
    assert main(["check", "--rules", rules, "--no-skip", path]) == 1


def test_json_output(tmp_path: Path, rules: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--rules", rules, "-o", "json", write(tmp_path, pod())]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data[0]["allowed"] is False and data[0]["result"] == "denied"
    assert "sglang-0516-cu129-test" in data[0]["message"]


def test_exits_2_on_bad_yaml_bad_rules_or_missing_files(
    tmp_path: Path, rules: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")
    assert main(["check", "--rules", rules, str(bad)]) == 2
    assert main(["check", "--rules", str(bad), str(bad)]) == 2
    assert main(["check", "--rules", rules, str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "not valid YAML" in err and "cannot read" in err


def test_uses_the_builtin_rules_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, pod([container(image="lmsysorg/sglang:v0.5.23-cu130")]))
    assert main(["check", path]) == 0
    assert "sglang-0523-torch-2141-no-prebuilt-pg, warn" in capsys.readouterr().out


def test_validates_rules_files(
    tmp_path: Path, rules: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["rules", rules]) == 0
    assert "3 rule(s) OK" in capsys.readouterr().out
    dup = tmp_path / "dup.yaml"
    dup.write_text(TEST_RULES + "  - {id: pinned-digest-test, image: x, reason: r, remedy: m}\n")
    assert main(["rules", str(dup)]) == 2
    assert "duplicate rule id 'pinned-digest-test'" in capsys.readouterr().err


def test_check_judges_an_extra_kind_given_with_kinds(
    tmp_path: Path, rules: str, capsys: pytest.CaptureFixture[str]
) -> None:
    kinds = tmp_path / "kinds.yaml"
    kinds.write_text(
        "- group: serving.example.com\n  versions: [v1]\n  kind: InferencePool\n"
        "  resource: inferencepools\n  templates: ['spec.workers[].template']\n"
    )
    obj = {
        "apiVersion": "serving.example.com/v1",
        "kind": "InferencePool",
        "metadata": {"name": "p", "namespace": "ml"},
        "spec": {"workers": [{"name": "w", "template": template()}]},
    }
    path = write(tmp_path, obj)
    assert main(["check", "--rules", rules, path]) == 0  # an unknown kind is skipped
    assert main(["check", "--rules", rules, "--kinds", str(kinds), path]) == 1
    out, _ = capsys.readouterr()
    assert 'container "worker" in spec.workers[w].template' in out
    kinds.write_text("- kind: Broken\n")
    assert main(["check", "--rules", rules, "--kinds", str(kinds), path]) == 2
    assert "group" in capsys.readouterr().err
