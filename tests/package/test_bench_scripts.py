"""Every benchmark script under bench/ still loads: its imports name what the tree has.
The benchmarks print figures and are run by hand, so nothing else would notice one that
a refactor broke (bench/preflight_node_bench.py imported a helper the node tests no
longer had, and failed at its first line, unnoticed for a session)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_the_benchmark_loads_and_has_a_main(script: Path) -> None:
    # Not run as __main__: only its definitions and imports execute.
    names = runpy.run_path(str(script), run_name="epguard_bench_load")
    assert callable(names.get("main")), f"{script.name} has no main()"
