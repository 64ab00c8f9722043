"""Helpers for the chart tests: render the chart with the real helm binary (which
scripts/tools.d/20-kubectl-helm.sh puts in $EPGUARD_CACHE/bin), once per values variant
per test session."""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "epguard"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE = "epguard"
NAMESPACE = "epguard-system"
CACHE = Path(os.environ.get("EPGUARD_CACHE", Path.home() / ".cache" / "epguard"))

Obj = dict[str, Any]


def helm_path() -> Path:
    path = CACHE / "bin" / "helm"
    if not path.is_file():
        pytest.fail(
            f"helm not found at {path}: run scripts/tools.sh (make tools) first", pytrace=False
        )
    return path


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # Keep helm away from the user's config, caches and any real cluster.
    for var, sub in (("HELM_CONFIG_HOME", "config"), ("HELM_CACHE_HOME", "cache")):
        env[var] = str(CACHE / "helm" / sub)
    env["HELM_DATA_HOME"] = str(CACHE / "helm" / "data")
    env["KUBECONFIG"] = "/dev/null"
    proc = subprocess.run(
        [str(helm_path()), *args], capture_output=True, text=True, env=env, timeout=120
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@dataclass
class Rendered:
    name: str
    objects: list[Obj]

    def all(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> Obj:
        found = [o for o in self.all(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one {kind} {name or ''}, got {len(found)}"
        return found[0]

    def maybe(self, kind: str, name: str | None = None) -> Obj | None:
        found = [o for o in self.all(kind) if name is None or o["metadata"]["name"] == name]
        return found[0] if found else None


def template(*extra: str) -> list[Obj]:
    out = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra).stdout
    return [d for d in yaml.safe_load_all(out) if d]


_cache: dict[tuple[str, ...], Rendered] = {}


def render(*extra: str, name: str = "") -> Rendered:
    key = tuple(extra)
    if key not in _cache:
        _cache[key] = Rendered(name or " ".join(extra) or "defaults", template(*extra))
    elif name and _cache[key].name != name:
        # The same render asked for under another name (tests key expectations on the
        # variant's name): the objects are shared, the name is the caller's.
        return Rendered(name, _cache[key].objects)
    return _cache[key]


@functools.cache
def notes(*extra: str) -> str:
    """What `helm install` prints after NOTES: (a client-side dry run; cached)."""
    out = run_helm(
        "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *extra
    ).stdout
    return out.split("NOTES:", 1)[1]


def variant_args(path: Path | None) -> tuple[str, ...]:
    return () if path is None else ("-f", str(path))


VARIANTS: list[Path | None] = [None, *CI_VALUES]
VARIANT_IDS = ["defaults", *(p.stem for p in CI_VALUES)]


def _cel_replace(s: Any, old: Any, new: Any) -> Any:
    import celpy

    return celpy.celtypes.StringType(str(s).replace(str(old), str(new)))


# Kubernetes CEL functions that cel-python lacks, for
# ``Environment.program(…, functions=CEL_FUNCTIONS)``: the strings library's ``replace``
# (every occurrence). The chart's matchConditions no longer call it (they use only
# standard CEL); an expression that does still evaluates as on the API server.
CEL_FUNCTIONS: dict[str, Any] = {"replace": _cel_replace}


def vap_refusal(spec: Obj, request: Obj, obj: Obj | None, old: Obj | None = None) -> str | None:
    """What a ValidatingAdmissionPolicy's ``spec`` says of one request, evaluated as the
    API server does (cel-python): None when a matchCondition leaves the request out or
    every validation holds, else the first failing validation's message."""
    import celpy
    from celpy.adapter import json_to_cel

    env = celpy.Environment()

    def run(expression: str, activation: dict[str, Any]) -> Any:
        return env.program(env.compile(expression), functions=CEL_FUNCTIONS).evaluate(activation)

    activation: dict[str, Any] = {
        "request": json_to_cel(request),
        "object": json_to_cel(obj),
        "oldObject": json_to_cel(old),
    }
    if not all(run(m["expression"], activation) for m in spec.get("matchConditions", [])):
        return None
    activation["variables"] = celpy.celtypes.MapType(
        {
            celpy.celtypes.StringType(v["name"]): run(v["expression"], activation)
            for v in spec.get("variables", [])
        }
    )
    for v in spec["validations"]:
        if not run(v["expression"], activation):
            return str(run(v["messageExpression"], activation))
    return None
