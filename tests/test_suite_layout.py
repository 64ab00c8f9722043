"""make test's second phase collects the node's tests and the waiting ones only from the
folders scripts/test.sh names (collecting the whole suite took 8 s of the node's phase):
a test so marked anywhere else would never run. Read from the sources, as text. And
tests/conftest.py's LONG_MODULES names modules that exist (a renamed one would only lose
its place in the first phase's order, silently)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import LONG_MODULES

REPO = Path(__file__).resolve().parents[1]
SCRIPT = (REPO / "scripts" / "test.sh").read_text()


def _dirs(name: str) -> list[str]:
    found = re.search(rf"^{name}=\(([^)]*)\)$", SCRIPT, re.M)
    assert found, f"scripts/test.sh sets no {name}"
    return found.group(1).split()


def _marked(marker: str) -> set[str]:
    pattern = re.compile(rf"\bpytest\.mark\.{marker}\b")
    return {
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("*.py")
        if pattern.search(path.read_text())
    }


@pytest.mark.parametrize(("marker", "dirs"), [("node", "node_dirs"), ("waits", "waits_dirs")])
def test_every_test_so_marked_is_in_a_folder_its_run_collects(marker: str, dirs: str) -> None:
    folders = _dirs(dirs)
    marked = _marked(marker)
    assert marked, f"no test is marked {marker}: the pattern or the marker changed"
    outside = sorted(p for p in marked if not any(p.startswith(f"{d}/") for d in folders))
    assert outside == [], f"marked {marker} but outside {folders}"


def test_the_second_phase_runs_collect_those_folders() -> None:
    assert '-m node --durations=15 "${node_dirs[@]}"' in SCRIPT
    assert '"${waits_dirs[@]}" >"$logs/waits"' in SCRIPT


def test_every_long_module_exists() -> None:
    assert [m for m in LONG_MODULES if not (REPO / m).is_file()] == []
