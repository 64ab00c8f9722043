"""The ELF reader and dependency walk, on the real mooncake wheels' shared objects.

``readelf -d`` (binutils) is the independent oracle for DT_NEEDED and RPATH; the
dynamic loader (ctypes) is the oracle for which system libraries exist here.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from epguard.probe import elf
from tests.probe.probe_harness import MTE_CUDA12, MTE_CUDA13, TORCH_ENV, overlay

pytestmark = pytest.mark.realpkg


def readelf(path: Path) -> tuple[list[str], list[str]]:
    out = subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, check=True
    ).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)
    paths = re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[(.+?)\]", out)
    return needed, [p for entry in paths for p in entry.split(":")]


def loads(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def pg_files(name: str) -> list[Path]:
    pkg = overlay(name) / "mooncake"
    return [*sorted(pkg.glob("pg_2_13_0.*.so")), pkg / "libmooncake_pg.so"]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils' readelf not installed")
@pytest.mark.parametrize("name", [MTE_CUDA12, MTE_CUDA13])
def test_reads_the_same_needed_and_rpath_as_readelf(name):
    for path in pg_files(name):
        dyn = elf.read_dynamic(str(path))
        needed, paths = readelf(path)
        assert dyn.needed == needed
        assert dyn.rpath + dyn.runpath == paths


def test_a_non_elf_file_is_not_parsed(tmp_path):
    bogus = tmp_path / "libfake.so"
    bogus.write_bytes(b"#!/bin/sh\n" * 20)
    assert elf.read_dynamic(str(bogus)) is None
    assert elf.read_dynamic(str(tmp_path / "absent.so")) is None


def test_resolves_origin_relative_libraries_of_the_wheel():
    # libmooncake_pg.so finds its bundled glog/yaml-cpp through $ORIGIN/../*.libs.
    roots = [str(p) for p in pg_files(MTE_CUDA13)]
    missing = {name for name, _ in elf.missing_libraries(roots)}
    assert not any(
        name.startswith(("libglog", "libyaml-cpp", "libmooncake_pg_device")) for name in missing
    )


def test_libraries_mapped_by_torch_count_as_present():
    # torch 2.13.0+cu130 maps libcudart.so.13 from its nvidia wheel, not from a system dir.
    cudart = sorted(TORCH_ENV.glob("lib/python*/site-packages/nvidia/**/libcudart.so.13"))
    assert cudart, "torch's CUDA 13 runtime wheel not found in the env"
    roots = [str(p) for p in pg_files(MTE_CUDA13)]
    without = {n for n, _ in elf.missing_libraries(roots)}
    with_torch = {n for n, _ in elf.missing_libraries(roots, loaded=[str(cudart[0])])}
    assert "libcudart.so.13" in without
    assert "libcudart.so.13" not in with_torch


@pytest.mark.parametrize(
    "lib", ["libcuda.so.1", "libibverbs.so.1", "libmlx5.so.1", "libnuma.so.1", "libcurl.so.4"]
)
def test_system_library_is_missing_exactly_when_the_loader_cannot_open_it(lib):
    roots = [str(p) for p in pg_files(MTE_CUDA13)]
    missing = {n for n, _ in elf.missing_libraries(roots)}
    assert (lib in missing) == (not loads(lib))


def test_names_who_needs_each_missing_library():
    roots = [str(p) for p in pg_files(MTE_CUDA12)]
    by = dict(elf.missing_libraries(roots))
    assert by["libcudart.so.12"].startswith("pg_2_13_0.")
    if not loads("libcuda.so.1"):
        assert by["libcuda.so.1"] == "libmooncake_pg.so"
