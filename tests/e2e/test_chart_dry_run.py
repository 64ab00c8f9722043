"""`kubectl apply --dry-run=server` of every rendered variant against a real
kube-apiserver (devcluster): the API server's own validation -- CEL compilation of the
matchConditions, structural CRD schemas, RBAC rule shapes -- which no offline schema
check reproduces. Kinds whose CRDs belong to other projects (cert-manager,
prometheus-operator) are left out; tests/chart/test_kube_schemas.py covers them."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.chart.chartlib import CACHE, NAMESPACE, VARIANT_IDS, VARIANTS, render, variant_args
from tests.control_plane import running_control_plane

pytestmark = pytest.mark.e2e

FOREIGN_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")
KUBECTL = CACHE / "bin" / "kubectl"


@pytest.fixture(scope="module")
def kubeconfig() -> Iterator[Path]:
    with running_control_plane() as cp:
        subprocess.run(
            [str(KUBECTL), "create", "namespace", NAMESPACE],
            env={**os.environ, "KUBECONFIG": str(cp.kubeconfig)},
            check=True,
            capture_output=True,
        )
        yield cp.kubeconfig


@pytest.mark.parametrize("values", VARIANTS, ids=VARIANT_IDS)
def test_the_api_server_accepts_every_rendered_object(
    values: Path | None, kubeconfig: Path
) -> None:
    variant = render(*variant_args(values), name=values.stem if values else "defaults")
    objs = [o for o in variant.objects if not o["apiVersion"].startswith(FOREIGN_GROUPS)]
    proc = subprocess.run(
        [str(KUBECTL), "apply", "--dry-run=server", "-f", "-"],
        input="\n---\n".join(yaml.safe_dump(o) for o in objs),
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(server dry run)") == len(objs)
