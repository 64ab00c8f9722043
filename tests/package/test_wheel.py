"""What `pip install epguard` puts on a machine: one top-level import package,
``epguard``, and console scripts that point into it. A generic top-level ``webhook`` or
``probe`` would overwrite (or be overwritten by) another distribution's."""

from __future__ import annotations

import configparser
import zipfile
from pathlib import Path

import pytest

from tests.package.wheel import build_wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    tops = {name.split("/", 1)[0] for name in _names(wheel)}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("epguard-")
    assert tops - dist_info == {"epguard"}


def test_epguard_is_a_namespace_holding_the_webhook_and_the_probe(wheel: Path) -> None:
    names = set(_names(wheel))
    assert "epguard/__init__.py" not in names  # a namespace: no code of its own
    parts = {n.split("/")[1] for n in names if n.startswith("epguard/") and n.count("/") >= 2}
    assert parts == {"webhook", "probe"}
    # What the probe reads at run time ships beside it (SGLang's option table).
    assert "epguard/probe/sglang_options.json" in names
    assert "epguard/probe/py.typed" in names and "epguard/webhook/py.typed" in names
    # Every part of the webhook is a package in the wheel, not only its top.
    for part in ("engine", "admission", "cluster", "controller", "scan"):
        assert f"epguard/webhook/{part}/__init__.py" in names


def test_every_console_script_points_into_epguard(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (entry_points,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(z.read(entry_points).decode())
    scripts = dict(parser["console_scripts"])
    assert scripts, "no console scripts"
    for name, target in scripts.items():
        assert target.startswith("epguard."), f"{name} = {target}"
