"""Every rendered object against the Kubernetes OpenAPI schemas (strict: unknown fields
fail) of each Kubernetes minor the chart supports, from the kubernetes-validate package.
Objects of CRD-defined kinds (cert-manager, prometheus-operator) validate structurally,
and ImageVerdicts against the chart's own CRD schema."""

from __future__ import annotations

import copy
import re
from functools import cache
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml
from kubernetes_validate import utils as kv  # type: ignore[import-untyped]
from packaging.version import Version
from referencing import Registry, Resource

from tests.chart.chartlib import CHART, Rendered, render

CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
MIN_MINOR = Version(re.sub(r"[^0-9.]", "", CHART_META["kubeVersion"].split("-")[0]))
VERSIONS = sorted(
    {v for v in kv.all_versions() if Version(v) >= Version(f"{MIN_MINOR.major}.{MIN_MINOR.minor}")},
    key=Version,
)
CRD_KINDS = {
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
}
NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def test_the_supported_range_starts_at_the_charts_kube_version_and_is_wide() -> None:
    assert VERSIONS[0] == "1.30.0"
    assert len(VERSIONS) >= 6  # 1.30 .. 1.35 at least


@cache
def _definitions(schema_dir: str) -> Registry:
    path = f"kubernetes-json-schema/{schema_dir}/_definitions.json"
    return Resource.from_contents(kv.schema_contents(path, schema_dir)) @ Registry()


@cache
def kube_validator(version: str, api_version: str, kind: str) -> Any:
    """The strict schema of one kind in one Kubernetes minor, as ``kv.validate`` builds it
    (the newest schema set not newer than ``version``; ``rbac.authorization.k8s.io/v1``
    is filed as ``rbac-v1``), built once: ``kv.validate`` reads the 3 MB
    ``_definitions.json`` again for every object (0.6 s a variant and version, ~40 s of
    the suite). None where the package has no schema for the kind."""
    schema_version = [v for v in kv.all_versions() if Version(v) <= Version(version)][-1]
    schema_dir = f"v{schema_version}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = kv.schema_contents(
            f"kubernetes-json-schema/{schema_dir}/{kind.lower()}-{group_version}.json", version
        )
    except FileNotFoundError:
        return None
    registry = Resource.from_contents(schema) @ _definitions(schema_dir)
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(variant: Rendered, version: str) -> None:
    problems = []
    for obj in variant.objects:
        key = (obj["apiVersion"], obj["kind"])
        if key in CRD_KINDS:
            continue
        validator = kube_validator(version, *key)
        if validator is None:
            problems.append(f"no Kubernetes {version} schema for {key[1]} {key[0]}")
            continue
        for e in validator.iter_errors(obj):
            path = ".".join(str(p) for p in e.path)
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {e.message}")
    assert not problems, f"{variant.name} vs Kubernetes {version}:\n" + "\n".join(problems)


@pytest.mark.parametrize("version", [VERSIONS[0], VERSIONS[-1]])
def test_the_schemas_refuse_a_misspelt_field_and_a_wrong_type(version: str) -> None:
    deployment = copy.deepcopy(render(name="defaults").one("Deployment", "epguard-webhook"))
    validator = kube_validator(version, deployment["apiVersion"], deployment["kind"])
    assert validator is not None and not list(validator.iter_errors(deployment))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["imagePullPolicyy"] = "Always"
    container["ports"][0]["containerPort"] = "8443"
    errors = [e.message for e in validator.iter_errors(deployment)]
    assert any("imagePullPolicyy" in m for m in errors), errors
    assert any("'8443' is not of type 'integer'" in m for m in errors), errors


def test_crd_typed_objects_are_structurally_sound(variant: Rendered) -> None:
    for obj in variant.objects:
        if (obj["apiVersion"], obj["kind"]) not in CRD_KINDS:
            continue
        assert set(obj) <= {"apiVersion", "kind", "metadata", "spec"}
        assert NAME.match(obj["metadata"]["name"]) and len(obj["metadata"]["name"]) <= 63
        assert isinstance(obj["spec"], dict) and obj["spec"]
        for value in obj["metadata"].get("labels", {}).values():
            assert isinstance(value, str)


def test_every_object_name_is_a_valid_dns_name(variant: Rendered) -> None:
    for obj in variant.objects:
        name = obj["metadata"]["name"]
        assert NAME.match(name) and len(name) <= 253, name
        if obj["kind"] in {"Service", "Deployment"}:
            assert len(name) <= 63


@cache
def imageverdict_schema() -> dict[str, Any]:
    crd = next(
        o
        for o in render().objects
        if o["kind"] == "CustomResourceDefinition"
        and o["metadata"]["name"] == "imageverdicts.epguard.io"
    )
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


GOOD_VERDICT = {
    "apiVersion": "epguard.io/v1alpha1",
    "kind": "ImageVerdict",
    "metadata": {"name": "sha256-0123"},
    "spec": {
        "image": "docker.io/lmsysorg/sglang:v0.5.22-cu130",
        "digest": "sha256:" + "0" * 64,
        "verdict": "Unusable",
        "reason": "Mooncake PG was not built against torch==2.14.1.",
        "versions": {"sglang": "0.5.22", "torch": "2.14.1", "mooncake": "0.3.13.post1"},
        "firstSeen": "2026-11-30T20:00:00Z",
        "lastSeen": "2026-11-30T21:00:00Z",
        "pod": "inference/worker-0",
        "count": 3,
    },
}


class TestImageVerdictSchema:
    def test_a_verdict_as_the_controller_records_it_is_accepted(self) -> None:
        jsonschema.validate(GOOD_VERDICT, imageverdict_schema())

    @pytest.mark.parametrize(
        "spec_patch",
        [{"verdict": "Broken"}, {"count": 0}, {"image": None}, {"versions": {"torch": 2}}],
        ids=["unknown-verdict", "zero-count", "no-image", "non-string-version"],
    )
    def test_a_malformed_verdict_is_refused(self, spec_patch: dict[str, Any]) -> None:
        spec = {**GOOD_VERDICT["spec"], **spec_patch}  # type: ignore[dict-item]
        spec = {k: v for k, v in spec.items() if v is not None}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**GOOD_VERDICT, "spec": spec}, imageverdict_schema())

    def test_the_printer_columns_point_at_fields_the_schema_has(self) -> None:
        crd = next(
            o
            for o in render().objects
            if o["kind"] == "CustomResourceDefinition"
            and o["metadata"]["name"] == "imageverdicts.epguard.io"
        )
        props = imageverdict_schema()["properties"]
        for col in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
            node: dict[str, Any] = {"properties": props}
            for part in col["jsonPath"].lstrip(".").split("."):
                node = (
                    node["properties"][part]
                    if "properties" in node
                    else node["additionalProperties"]
                )

    def test_the_crd_schemas_are_structural(self, variant: Rendered) -> None:
        """The API server's structural-schema rules that a JSON-schema check misses: every
        node typed (or explicitly open), and properties never beside additionalProperties."""

        def walk(node: dict[str, Any], path: str) -> None:
            assert not ("properties" in node and "additionalProperties" in node), path
            if not node.get("x-kubernetes-preserve-unknown-fields") and path != "$.metadata":
                assert "type" in node, f"{path} has no type"
            for key, child in node.get("properties", {}).items():
                walk(child, f"{path}.{key}")
            if isinstance(node.get("additionalProperties"), dict):
                walk(node["additionalProperties"], f"{path}.*")
            if isinstance(node.get("items"), dict):
                walk(node["items"], f"{path}[]")

        for crd in variant.all("CustomResourceDefinition"):
            for version in crd["spec"]["versions"]:
                walk(version["schema"]["openAPIV3Schema"], "$")
