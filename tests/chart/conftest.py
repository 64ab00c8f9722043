"""Fixtures for the chart tests (helpers live in chartlib.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.chart.chartlib import CHART, VARIANT_IDS, VARIANTS, Rendered, render, variant_args


@pytest.fixture(params=VARIANTS, ids=VARIANT_IDS)
def variant(request: pytest.FixtureRequest) -> Rendered:
    path: Path | None = request.param
    return render(*variant_args(path), name=path.stem if path else "defaults")


@pytest.fixture
def defaults() -> Rendered:
    return render(name="defaults")


@pytest.fixture
def rendered_with() -> Callable[..., Rendered]:
    def _render(*extra: str) -> Rendered:
        return render(*extra)

    return _render


@pytest.fixture
def ci_file() -> Iterator[Callable[[str], Rendered]]:
    def _load(stem: str) -> Rendered:
        return render("-f", str(CHART / "ci" / f"{stem}.yaml"), name=stem)

    yield _load
