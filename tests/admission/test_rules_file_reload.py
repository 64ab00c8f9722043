"""The rules file is re-read when it changes (a mounted ConfigMap works without API
access), and a bad change keeps the last good rules."""

from __future__ import annotations

from pathlib import Path

from epguard.webhook.admission.server import Runtime
from epguard.webhook.settings import Settings

ONE = "rules:\n  - {id: one, image: 'x/y:*', reason: r, remedy: m}\n"
TWO = ONE + "  - {id: two, image: 'x/z:*', reason: r, remedy: m}\n"


def runtime(tmp_path: Path, text: str) -> tuple[Runtime, Path]:
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return Runtime(Settings(rules=str(path), tls_cert=None, tls_key=None, watch="off")), path


def ids(rt: Runtime) -> list[str]:
    return [r.id for r in rt.state.rules.current.rules]


def test_reloads_a_changed_rules_file(tmp_path: Path) -> None:
    rt, path = runtime(tmp_path, ONE)
    assert not rt.check_rules_file()  # unchanged
    path.write_text(TWO)
    assert rt.check_rules_file()
    assert ids(rt) == ["one", "two"]


def test_a_bad_rules_file_change_keeps_the_last_good_rules(tmp_path: Path) -> None:
    rt, path = runtime(tmp_path, ONE)
    path.write_text(TWO.replace("two", "one"))
    assert not rt.check_rules_file()
    assert ids(rt) == ["one"]
    rejected = rt.metrics.registry.get_sample_value(
        "epguard_rules_reloads_total", {"source": "file", "result": "rejected"}
    )
    assert rejected == 1
    path.unlink()  # a vanished file (mid-swap of a ConfigMap volume) changes nothing
    assert not rt.check_rules_file() and ids(rt) == ["one"]


def test_configmap_rules_stay_in_force_over_a_file_change(tmp_path: Path) -> None:
    from epguard.webhook.engine.rules import load_rules_text

    rt, path = runtime(tmp_path, ONE)
    rt.state.rules.set_live(load_rules_text("rules: []", "cm"))
    path.write_text(TWO)
    rt.check_rules_file()
    assert ids(rt) == []
    rt.state.rules.set_live(None)
    assert ids(rt) == ["one", "two"]
