"""values.yaml and values.schema.json: every value documented, every value typed, and a
typo fails the install instead of being ignored."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from epguard.webhook.engine.workloads import KindError, parse_kinds
from tests.chart.chartlib import CHART, CI_VALUES, run_helm, template

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)


def resolve(node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref:
        return resolve(SCHEMA["definitions"][ref.rsplit("/", 1)[1]])
    return node


def object_schemas(node: Any, path: str = "$") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if node.get("type") == "object" or "properties" in node:
            yield path, node
        for key, child in node.items():
            yield from object_schemas(child, f"{path}.{key}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from object_schemas(child, f"{path}[{i}]")


class TestSchemaShape:
    def test_every_object_schema_closes_its_keys(self) -> None:
        for path, node in object_schemas(SCHEMA):
            ap = node.get("additionalProperties")
            assert ap is False or isinstance(ap, dict), f"{path} allows any key"
            if "properties" in node:
                assert ap is False, f"{path} has known keys but accepts others"
            if isinstance(ap, dict):
                assert (ap != {} and ap.get("type") != "object") or ap.get(
                    "additionalProperties"
                ) is False, path

    def test_every_value_in_values_yaml_has_a_schema(self) -> None:
        def walk(values: Any, schema: dict[str, Any], path: str) -> None:
            schema = resolve(schema)
            if isinstance(values, dict) and "properties" in schema:
                for key, child in values.items():
                    assert key in schema["properties"], f"{path}.{key} is not in the schema"
                    walk(child, schema["properties"][key], f"{path}.{key}")

        walk(VALUES, SCHEMA, "")

    def test_the_defaults_satisfy_the_schema(self) -> None:
        jsonschema.validate(VALUES, SCHEMA)

    @pytest.mark.parametrize("path", CI_VALUES, ids=[p.stem for p in CI_VALUES])
    def test_every_ci_variant_satisfies_the_schema(self, path: Any) -> None:
        jsonschema.validate(yaml.safe_load(path.read_text()), SCHEMA)


class TestDocumentation:
    def test_every_value_has_a_doc_comment_directly_above_it(self) -> None:
        """Every leaf of the values tree (per the schema; sections with their own keys
        are not leaves) carries a `# --` comment right above its line."""
        lines = VALUES_TEXT.splitlines()
        key = re.compile(r"^(\s*)([A-Za-z][\w.-]*):")
        stack: list[tuple[int, str]] = []
        documented: dict[tuple[str, ...], bool] = {}
        for i, line in enumerate(lines):
            m = key.match(line)
            if not m or line.lstrip().startswith("-"):
                continue
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = (*(k for _, k in stack), m.group(2))
            stack.append((indent, m.group(2)))
            j = i - 1
            while (
                j >= 0
                and lines[j].strip().startswith("#")
                and not lines[j].strip().startswith("# --")
            ):
                j -= 1
            documented[path] = j >= 0 and lines[j].strip().startswith("# --")

        def leaves(
            values: Any, schema: dict[str, Any], path: tuple[str, ...]
        ) -> Iterator[tuple[str, ...]]:
            schema = resolve(schema)
            if (
                isinstance(values, dict)
                and "properties" in schema
                and path
                and not documented.get(path)
            ):
                for k, child in values.items():
                    yield from leaves(child, schema["properties"][k], (*path, k))
            elif not path:
                for k, child in values.items():
                    yield from leaves(child, schema["properties"][k], (k,))
            else:
                yield path

        missing = [".".join(p) for p in leaves(VALUES, SCHEMA, ()) if not documented.get(p)]
        assert not missing, f"values without a `# --` comment: {missing}"

    def test_the_failure_policy_default_is_justified_where_it_is_set(self) -> None:
        block = VALUES_TEXT.split("failurePolicy: Ignore")[0].rsplit("# --", 1)[1]
        assert "matchConditions" in block and "probe" in block and "Fail" in block

    def test_the_verdict_ttl_trade_off_is_explained_where_it_is_set(self) -> None:
        block = prose(VALUES_TEXT.split("verdictTTLHours: 24")[0].rsplit("# --", 1)[1])
        for point in (
            "Tags move",  # why tag verdicts expire at all
            "warns",  # what happens after the TTL
            "digest",  # digest-pinned verdicts refuse while the ImageVerdict exists
            "a newer probe outcome for the same image replaces the verdict",
            "kubectl delete imageverdict",
            "EPGUARD_VERDICT_TTL_HOURS",
        ):
            assert point in block, point

    def test_injection_says_why_it_cannot_fail_closed(self) -> None:
        block = prose(VALUES_TEXT.split("\ninjection:")[0].rsplit("\n\n", 1)[1])
        assert "opt in" in block and "failurePolicy is always Ignore" in block


def prose(comment_block: str) -> str:
    """A `#` comment block as one line of text (wrapping removed)."""
    return " ".join(line.strip().lstrip("#").strip() for line in comment_block.splitlines())


class TestTyposFail:
    @pytest.mark.parametrize(
        ("setting", "complaint"),
        [
            ("webhook.mdoe=warn", "mdoe"),
            ("webhook.failurePolicy=fail", "failurePolicy"),
            ("webhook.timeoutSeconds=60", "timeoutSeconds"),
            ("tls.certManger.enabled=true", "certManger"),
            ("rules.extra[0].image=x", "extra"),
            ("webhook.resources.limit.memory=1Gi", "limit"),
            ("controller.affinity.podAntiAfinity.x=1", "podAntiAfinity"),
            ("image.digest=latest", "digest"),
            ("webhook.mode=block", "mode"),
            ("injection.enable=false", "enable"),
            ("injection.probelevel=smoke", "probelevel"),
            ("injection.probeLevel=full", "probeLevel"),
            ("injection.timeoutSeconds=60", "timeoutSeconds"),
            ("injection.image=a b", "image"),
            ("webhook.verdictTTLHours=-1", "verdictTTLHours"),
            ("webhook.verdictTtlHours=12", "verdictTtlHours"),
        ],
    )
    def test_helm_refuses_a_wrong_value(self, setting: str, complaint: str) -> None:
        proc = run_helm("template", "x", str(CHART), "--set", setting, check=False)
        assert proc.returncode != 0, f"{setting} was accepted"
        assert complaint in proc.stderr

    def test_a_typo_in_a_values_file_fails_too(self, tmp_path: Any) -> None:
        f = tmp_path / "v.yaml"
        f.write_text("networkPolicy:\n  enable: false\n")
        proc = run_helm("template", "x", str(CHART), "-f", str(f), check=False)
        assert proc.returncode != 0 and "enable" in proc.stderr


class TestSettingsThatWouldBreakTheCluster:
    """Values the schema's types allow but that render something an admin would regret
    (found by an admin's review of the chart)."""

    @pytest.mark.parametrize(
        "settings",
        [
            ("webhook.podDisruptionBudget.minAvailable=2",),
            ("controller.podDisruptionBudget.minAvailable=100%",),
            # the disruption controller rounds a percentage up: 60% of 2 is 2
            ("webhook.podDisruptionBudget.minAvailable=60%",),
            ("webhook.replicaCount=3", "webhook.podDisruptionBudget.minAvailable=3"),
        ],
    )
    def test_a_budget_that_keeps_every_replica_up_is_refused(
        self, settings: tuple[str, ...]
    ) -> None:
        # (Rendered, it made `kubectl drain` of a node running a replica wait forever.)
        args = [a for s in settings for a in ("--set", s)]
        proc = run_helm("template", "x", str(CHART), *args, check=False)
        assert proc.returncode != 0, f"{settings} was accepted"
        assert "could ever be drained" in proc.stderr and "minAvailable" in proc.stderr

    @pytest.mark.parametrize(
        ("settings", "kept"),
        [
            (("webhook.podDisruptionBudget.minAvailable=50%",), "50%"),
            (("webhook.replicaCount=3", "webhook.podDisruptionBudget.minAvailable=2"), 2),
            (("webhook.podDisruptionBudget.minAvailable=0",), 0),
        ],
    )
    def test_a_budget_that_lets_one_replica_go_is_rendered(
        self, settings: tuple[str, ...], kept: object
    ) -> None:
        args = [a for s in settings for a in ("--set", s)]
        [pdb] = [
            o
            for o in template(*args)
            if o["kind"] == "PodDisruptionBudget" and "webhook" in o["metadata"]["name"]
        ]
        assert pdb["spec"]["minAvailable"] == kept

    def test_an_extra_kind_with_an_empty_path_list_is_refused(self) -> None:
        # The webhook refuses it at start (no path), so the release ran no webhook.
        kind = {"group": "g.io", "versions": ["v1"], "kind": "K", "resource": "ks"}
        for field in ("templates", "podSpecs", "containers"):
            value = json.dumps([{**kind, field: []}])
            proc = run_helm(
                "template", "x", str(CHART), "--set-json", f"webhook.extraKinds={value}",
                check=False,
            )
            assert proc.returncode != 0 and field in proc.stderr, (field, proc.stderr[-300:])

    def test_an_extra_kind_listed_twice_is_refused_by_the_chart_and_the_webhook(self) -> None:
        # Two entries of one resource (one a version) rendered two webhooks of one name,
        # which the API server refuses: the whole install or upgrade failed.
        kinds = [
            {"group": "example.com", "versions": [v], "kind": "InferenceService",
             "resource": "inferenceservices", "templates": [f"spec.{v}"]}
            for v in ("v1", "v2")
        ]  # fmt: skip
        value = json.dumps(kinds)
        proc = run_helm(
            "template", "x", str(CHART), "--set-json", f"webhook.extraKinds={value}", check=False
        )
        assert proc.returncode != 0 and "listed twice" in proc.stderr, proc.stderr[-300:]
        with pytest.raises(KindError, match="listed twice"):
            parse_kinds(value, "webhook.extraKinds")
