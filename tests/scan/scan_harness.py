"""Layers and helpers for the scan tests, made from real files.

The base layer is the Debian python3 root filesystem the worker images use
(``make tools`` builds it); mooncake and SGLang come from the real wheels of
scripts/tools.d/30-realpkgs.sh. Torch is the one stand-in: its real dist-info,
``__init__.py`` and ``version.py``, and the *names* of its libraries as empty files,
because the scan reads nothing else of torch and its 4.7 GB would make every
format test a copy of the worker image (the full images are scanned in
test_agreement.py and bench/scan_bench.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.probe.probe_harness import TORCH_ENV, overlay
from tests.scan.imagebuild import LayerSpec, write_layer

REPO = Path(__file__).resolve().parents[2]
# The console script installed beside the interpreter running the tests (make's .venv, or
# any other environment epguard was installed into).
EPGUARD = Path(sys.executable).with_name("epguard")
SITE = "usr/local/lib/python3.11/dist-packages"
TORCH_SITE = next((TORCH_ENV / "lib").glob("python3*/site-packages"), TORCH_ENV / "missing")
IMAGES = Path(os.environ.get("EPGUARD_CACHE", Path.home() / ".cache" / "epguard")) / "images"
SGLANG_SOURCES = (
    "srt/distributed/parallel_state.py",
    "srt/elastic_ep/elastic_ep.py",
    "srt/distributed/bootstrap.py",
    "srt/model_executor/model_runner.py",
    "srt/distributed/device_communicators/mooncake_transfer_engine.py",
)


def base_rootfs() -> Path:
    path = IMAGES / "python-base-rootfs.tar"
    if not path.is_file():
        pytest.fail(f"{path} missing: run `make tools` (devcluster/images.py)")
    return path


def torch_spec() -> LayerSpec:
    if not (TORCH_ENV / ".done").is_file():
        pytest.fail("torch env missing: run `make tools`")
    t = TORCH_SITE
    info = next(t.glob("torch-*.dist-info"))
    spec = LayerSpec(trees=[(info, f"{SITE}/{info.name}")])
    for rel in ("torch/__init__.py", "torch/version.py"):
        spec.files[f"{SITE}/{rel}"] = (t / rel).read_bytes()
    spec.empty_named.append((t / "torch" / "lib", f"{SITE}/torch/lib"))
    for lib in sorted((t / "nvidia").glob("*/lib")):
        spec.empty_named.append((lib, f"{SITE}/{lib.relative_to(t)}"))
    return spec


def sglang_spec(name: str) -> LayerSpec:
    src = overlay(name)
    info = next(src.glob("sglang-*.dist-info"))
    spec = LayerSpec()
    spec.files[f"{SITE}/{info.name}/METADATA"] = (info / "METADATA").read_bytes()
    spec.files[f"{SITE}/sglang/__init__.py"] = (src / "sglang" / "__init__.py").read_bytes()
    for rel in SGLANG_SOURCES:
        p = src / "sglang" / rel
        if p.is_file():
            spec.files[f"{SITE}/sglang/{rel}"] = p.read_bytes()
    return spec


def mooncake_spec(name: str, skip=lambda rel: False) -> LayerSpec:
    return LayerSpec(trees=[(overlay(name), SITE)], skip=skip)


@dataclass
class Pieces:
    base: Path
    torch: Path
    sglang_pg: Path
    sglang_ep: Path


@pytest.fixture(scope="session")
def pieces(tmp_path_factory: pytest.TempPathFactory) -> Pieces:
    d = tmp_path_factory.mktemp("scan-layers")
    return Pieces(
        base=base_rootfs(),
        torch=write_layer(d / "torch.tar", torch_spec()),
        sglang_pg=write_layer(d / "sglang-pg.tar", sglang_spec("sglang-0.5.18")),
        sglang_ep=write_layer(d / "sglang-ep.tar", sglang_spec("sglang-0.5.16")),
    )


@dataclass
class Scan:
    rc: int
    stdout: str
    stderr: str

    @property
    def doc(self) -> dict:
        return json.loads(self.stdout)

    @property
    def classes(self) -> list[str]:
        return [c["classification"] for c in self.doc["causes"]]


def scan(image: Path, *args: str, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> Scan:
    """The real command, as a CI step runs it."""
    proc = subprocess.run([str(EPGUARD), "scan", str(image), *args], capture_output=True,
                          text=True, timeout=600, env=env, cwd=cwd)
    return Scan(proc.returncode, proc.stdout, proc.stderr)
