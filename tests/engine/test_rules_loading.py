"""Loading rules: the exact schema, clear errors, the shipped defaults and their evidence."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from epguard.webhook.engine.imageref import parse
from epguard.webhook.engine.rules import (
    RulesError,
    RuleSet,
    RulesHolder,
    default_rules_path,
    load_rules_file,
    load_rules_text,
)

GOOD = """
rules:
  - id: a
    image: "lmsysorg/sglang:v0.5.23*"
    reason: r
    remedy: m
"""


def test_defaults_action_to_deny_and_normalizes_the_glob() -> None:
    rule = load_rules_text(GOOD, "t").rules[0]
    assert rule.action == "deny"
    assert rule.image == "docker.io/lmsysorg/sglang:v0.5.23*"


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        (
            "rules:\n  - {id: a, image: x, reason: r, remedy: m}\n"
            "  - {id: a, image: y, reason: r, remedy: m}",
            "duplicate rule id 'a' at rules[0] and rules[1]",
        ),
        (
            "rules:\n  - {id: a, image: x, reason: r, remedy: m, action: block}",
            "rules[0] (id 'a'): action",
        ),
        ("rules:\n  - {id: a, image: x, remedy: m}", "reason: Field required"),
        ("rules:\n  - {id: a, image: x, reason: r}", "remedy: Field required"),
        ("rules:\n  - {id: a, image: x, reason: '', remedy: m}", "reason"),
        ("rules:\n  - {id: a, reason: r, remedy: m}", "a rule needs 'image' (a glob) or 'digest'"),
        ("rules:\n  - {id: a, digest: md5, reason: r, remedy: m}", "digest"),
        ("rules:\n  - {id: a, image: x, reason: r, remedy: m, remedyy: n}", "remedyy"),
        ("rules:\n  - {image: x, reason: r, remedy: m}", "id: Field required"),
        ("rules:\n  - {id: 'a b', image: x, reason: r, remedy: m}", "id"),
        ("rules: {a: 1}", "'rules' must be a list"),
        ("rules:\n  - just a string", "rules[0] must be a mapping"),
        ("- a\n- b", "top level must be a mapping"),
        ("rulez: []", "unknown top-level key"),
        ("rules: [\n", "not valid YAML"),
    ],
)
def test_rejects_a_bad_file_with_a_clear_error(text: str, complaint: str) -> None:
    with pytest.raises(RulesError) as err:
        load_rules_text(text, "the-file.yaml")
    assert complaint in str(err.value)
    assert str(err.value).startswith("the-file.yaml: ")


def test_accepts_empty_rules() -> None:
    assert len(load_rules_text("", "t")) == 0
    assert len(load_rules_text("rules: []", "t")) == 0
    assert len(load_rules_text("rules:", "t")) == 0


def test_reports_an_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(RulesError, match="cannot read rules file"):
        load_rules_file(str(tmp_path / "missing.yaml"))


def test_matches_digest_rules_on_the_pinned_digest_only() -> None:
    digest = "sha256:" + "cd" * 32
    upper = "sha256:" + "CD" * 32  # digests compare case-insensitively
    rs = load_rules_text(
        f"rules:\n  - {{id: d, digest: '{digest}', reason: r, remedy: m}}\n"
        f"  - {{id: both, image: 'r.io/x:*', digest: '{upper}', reason: r, remedy: m}}",
        "t",
    )
    # With a digest, an image glob only has to name the repository: name@sha256 has no tag.
    assert [r.id for r in rs.match(parse(f"r.io/x@{digest}"))] == ["d", "both"]
    assert [r.id for r in rs.match(parse(f"r.io/x:v1@{digest}"))] == ["d", "both"]
    assert [r.id for r in rs.match(parse(f"r.io/other@{digest}"))] == ["d"]
    assert rs.match(parse("r.io/x:v1")) == ()


def test_tag_globs_do_not_match_digest_only_references() -> None:
    rs = load_rules_text(GOOD, "t")
    assert rs.match(parse("lmsysorg/sglang:v0.5.23-cu130"))
    assert not rs.match(parse("lmsysorg/sglang@sha256:" + "0" * 64))
    assert not rs.match(parse("lmsysorg/sglang:v0.5.2"))


def test_holder_prefers_live_rules_and_falls_back_to_the_file() -> None:
    file_rules = load_rules_text(GOOD, "file")
    holder = RulesHolder(file_rules)
    live = RuleSet((), "cm")
    holder.set_live(live)
    assert holder.current is live
    holder.set_live(None)
    assert holder.current is file_rules


def test_ships_default_rules_that_load() -> None:
    rules = load_rules_file(default_rules_path())
    assert len(rules) >= 3


def test_every_default_rule_cites_its_evidence_and_inference_only_warns() -> None:
    rules = load_rules_file(default_rules_path()).rules
    for rule in rules:
        assert rule.evidence, rule.id
        assert any(tag in rule.evidence for tag in ("[V]", "[R]", "[I]")), rule.id
        if "[I]" in rule.evidence:
            assert rule.action == "warn", f"{rule.id} rests on inference but denies"


def test_default_rules_file_is_plain_yaml_of_the_documented_shape() -> None:
    with open(default_rules_path(), encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    assert set(data) == {"rules"}
    for entry in data["rules"]:
        assert set(entry) <= {"id", "image", "digest", "reason", "remedy", "action", "evidence"}


def test_default_rules_catch_sglang_0523_images() -> None:
    rules = load_rules_file(default_rules_path())
    ids = [r.id for r in rules.match(parse("lmsysorg/sglang:v0.5.23-cu130-runtime"))]
    assert ids == ["sglang-0523-torch-2141-no-prebuilt-pg"]
    assert not rules.match(parse("lmsysorg/sglang:v0.5.21-cu130"))


def test_a_digest_rule_with_a_registry_port_names_the_repository_not_the_port() -> None:
    digest = "sha256:" + "ef" * 32
    rs = load_rules_text(
        f"rules:\n  - {{id: p, image: 'r.io:5000/x:v*', digest: '{digest}', reason: r, remedy: m}}",
        "t",
    )
    assert [r.id for r in rs.match(parse(f"r.io:5000/x@{digest}"))] == ["p"]
    assert rs.match(parse(f"r.io:5000/y@{digest}")) == ()


def test_every_shipped_rule_cites_rows_of_the_compatibility_evidence_in_the_repo() -> None:
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "compatibility.md").read_text()
    rows = set(re.findall(r"^\| ([SMLD][0-9]+) \|", doc, flags=re.M))
    assert {"S7", "M10", "M12", "L1", "D3"} <= rows
    rules = yaml.safe_load(Path(default_rules_path()).read_text())["rules"]
    assert rules
    for rule in rules:
        cited = set(re.findall(r"\b([SMLD][0-9]+)\b", rule["evidence"]))
        assert cited, f"{rule['id']} cites no row of docs/compatibility.md"
        assert cited <= rows, f"{rule['id']} cites rows that do not exist: {cited - rows}"


def test_the_built_in_rules_have_no_glob_that_can_never_match() -> None:
    from epguard.webhook.engine.rules import default_rules_path, load_rules_file, rule_warnings

    assert rule_warnings(load_rules_file(default_rules_path())) == []


@pytest.mark.parametrize(
    ("glob", "matched", "missed"),
    [
        ("docker.io/sglang:0.5*", ["sglang:0.5.22", "index.docker.io/library/sglang:0.5.1"],
         ["sglang:0.6"]),
        ("index.docker.io/sglang:*", ["sglang", "sglang:1"], ["lmsysorg/sglang:1"]),
        ("docker.io/lmsys*", ["lmsysorg/sglang:v1"], ["sglang:1"]),  # a wildcard: as written
        ("lmsysorg/sglang", ["lmsysorg/sglang@sha256:" + "0" * 64], ["lmsysorg/sglang"]),
        ("lmsysorg/sglang:*", ["lmsysorg/sglang", "lmsysorg/sglang:v1"], ["lmsysorg/other:v1"]),
    ],
)  # fmt: skip
def test_a_glob_is_normalized_as_an_image_reference_is(
    glob: str, matched: list[str], missed: list[str]
) -> None:
    """Docker Hub's one-word names written under its host matched no pod at all, silently
    (found by a review helper); a glob with a wildcard in its repository is left as
    written."""
    rs = load_rules_text(f"rules:\n  - {{id: a, image: '{glob}', reason: r, remedy: m}}", "t")
    assert all(rs.match(parse(image)) for image in matched)
    assert not any(rs.match(parse(image)) for image in missed)


def test_a_glob_without_a_tag_is_warned_about() -> None:
    """It matches only digest-pinned references without a tag, never lmsysorg/sglang or
    lmsysorg/sglang:v1: the admin hears it at load, not the day the image gets through."""
    from epguard.webhook.engine.rules import rule_warnings

    rs = load_rules_text(
        "rules:\n  - {id: a, image: 'lmsysorg/sglang', reason: r, remedy: m}\n"
        "  - {id: b, image: 'lmsysorg/sglang:*', reason: r, remedy: m}", "t"
    )  # fmt: skip
    (warning,) = rule_warnings(rs)
    assert "rule 'a'" in warning and "names no tag" in warning
    assert "'docker.io/lmsysorg/sglang:*'" in warning


def test_a_rules_text_of_too_many_nodes_is_refused_before_it_is_built() -> None:
    # 600 KB of "[a,a,a,...]" took 23 s and 188 MB to load: a rules review anyone can
    # post would take the webhook past its 256 Mi. Counted on the parser's events first.
    import tracemalloc

    from epguard.webhook.engine.rules import MAX_YAML_EVENTS

    bomb = "rules: [" + ",".join(["a"] * 300_000) + "]"
    tracemalloc.start()
    try:
        with pytest.raises(RulesError, match=f"more than {MAX_YAML_EVENTS:,} YAML events"):
            load_rules_text(bomb, "live")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16_000_000, peak


def test_a_large_real_rules_file_still_loads() -> None:
    rule = (
        '  - id: rule-{i}\n    image: "registry.example.com/ml/sglang-{i}:*"\n'
        '    reason: "libcudart.so.12: cannot open shared object file"\n'
        '    remedy: "rebuild on torch 2.9 with mooncake-transfer-engine 0.3.7"\n'
    )
    text = "rules:\n" + "".join(rule.format(i=i) for i in range(5_000))
    assert len(text) > 800_000  # near the 1 MiB a ConfigMap holds
    assert len(load_rules_text(text, "live").rules) == 5_000


def test_yaml_aliases_are_counted_as_what_they_repeat() -> None:
    # One event each, but a copy each use once built: 40 rules naming one 200 KB anchor
    # twice held 16 MB, and a 1 MiB ConfigMap of such rules would need ~10 GB.
    anchor = "x" * 200_000
    rules = ['  - id: r0\n    image: "x:*"\n    reason: &b "' + anchor + '"\n    remedy: *b\n']
    rules += [f'  - id: r{i}\n    image: "x:*"\n    reason: *b\n    remedy: *b\n'
              for i in range(1, 40)]  # fmt: skip
    with pytest.raises(RulesError, match="each alias counted as what it repeats"):
        load_rules_text("rules:\n" + "".join(rules), "live")
    # Nested ("billion laughs"): each level ten aliases of the one below.
    levels = ["a0: &a0 [" + ",".join(["lol"] * 10) + "]"]
    levels += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    with pytest.raises(RulesError, match="each alias counted as what it repeats"):
        load_rules_text("\n".join(levels) + "\nrules: []\n", "live")
    # An alias an admin writes to share a remedy still loads.
    shared = (
        'rules:\n  - id: a\n    image: "x:*"\n    reason: "r"\n    remedy: &fix "rebuild"\n'
        '  - id: b\n    image: "y:*"\n    reason: "r"\n    remedy: *fix\n'
    )
    assert [r.remedy for r in load_rules_text(shared, "live").rules] == ["rebuild", "rebuild"]


def test_nesting_past_the_pure_python_loaders_depth_is_a_rules_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where PyYAML has no libyaml (a stand-in: this machine's has it), the pure-Python
    # loader raises RecursionError, which is no YAMLError.
    from epguard.webhook.engine import rules

    monkeypatch.setattr(rules, "_LOADER", yaml.SafeLoader)
    with pytest.raises(RulesError, match="nested too deep"):
        load_rules_text("rules: " + "[" * 5000 + "]" * 5000, "live")
