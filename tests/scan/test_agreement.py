"""The scan of an image archive finds the same image cause as the probe run on that image.

For every real-package environment the probe tests use (tests/probe/
test_probe_realpkgs.py), an image is built the way devcluster/images.py builds the
worker images: the Debian python3 root filesystem, the real torch 2.13.0 layer, then
SGLang and mooncake as they come from PyPI. All of them go into one OCI archive
(they share their blobs, as in a registry), cached in $EPGUARD_CACHE/images.

The probe then runs *on that image*: the same root filesystem, with the layers stacked
by overlayfs in a private mount namespace and the probe started by chroot, as root,
with no GPU and no driver, exactly the files the pod would have. (Not a pod: sixteen
5 GB images imported into containerd would take longer than the rest of the suite.
The two worker images do run as pods in tests/e2e/test_scan_on_node.py.) The probe
runs with --no-static, so the import, not the files, decides its side.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.probe.probe_harness import (
    MTE_CUDA12,
    MTE_CUDA13,
    MTE_CUDA13_OLD,
    MTE_JIT,
    MTE_NON_CUDA,
    SGLANG_EP,
    SGLANG_PG,
)
from tests.scan.imagebuild import ImageSpec, LayerSpec, pack, write_layer, write_layout
from tests.scan.scan_harness import IMAGES, REPO, TORCH_SITE, overlay, scan

pytestmark = [
    pytest.mark.realpkg,
    pytest.mark.bulk,
    # mount namespaces, overlayfs and chroot: what `make test` has anyway (the local node).
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for overlayfs and chroot"),
]

SITE = "usr/local/lib/python3.11/dist-packages"
DRIVER = {"libcuda.so.1"}
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
WORKER = ["python3", "-m", "sglang.launch_server", "--model-path", "/m",
          "--elastic-ep-backend", "mooncake"]

ENVS: list[tuple[str | None, str | None]] = [
    *((MTE_CUDA13, s) for s in SGLANG_EP + SGLANG_PG),
    (MTE_CUDA12, SGLANG_PG[0]), (MTE_CUDA12, SGLANG_EP[1]),
    (MTE_CUDA13_OLD, SGLANG_PG[0]), (MTE_CUDA13_OLD, SGLANG_EP[1]), (MTE_CUDA13_OLD, None),
    (MTE_NON_CUDA, SGLANG_PG[0]), (MTE_NON_CUDA, SGLANG_EP[1]),
    (MTE_JIT, SGLANG_PG[0]), (MTE_JIT, SGLANG_EP[1]),
    (None, SGLANG_PG[1]),
]
# Its environment causes (no driver here) are the probe's only.
COMPLETE = (MTE_CUDA13, SGLANG_PG[0])


def ref(env: tuple[str | None, str | None]) -> str:
    return "localhost/epguard/scan-matrix:" + "_".join(p or "none" for p in env)


def _layer(name: str, out: Path) -> Path:
    src = overlay(name)
    if not out.exists():
        write_layer(out.with_suffix(".partial"), LayerSpec(trees=[(src, SITE)]))
        out.with_suffix(".partial").replace(out)
    return out


@pytest.fixture(scope="session")
def matrix_archive() -> Path:
    """One OCI archive holding an image per environment; rebuilt when an input changes."""
    torch_layer = IMAGES / "layers" / "torch-2.13.0.tar"
    base = IMAGES / "python-base-rootfs.tar"
    for p in (torch_layer, base):
        if not p.is_file():
            pytest.fail(f"{p} missing: run `make tools` (devcluster/images.py)")
    names = sorted({n for env in ENVS for n in env if n})
    key = hashlib.sha256(" ".join(
        [f"{p}:{p.stat().st_mtime_ns}" for p in (torch_layer, base)]
        + [f"{n}:{(overlay(n) / '.done').stat().st_mtime_ns}" for n in names]
        + [ref(e) for e in ENVS]).encode()).hexdigest()
    archive = IMAGES / "scan-matrix.oci.tar"
    stamp = archive.with_suffix(".key")
    if archive.is_file() and stamp.is_file() and stamp.read_text() == key:
        return archive
    work = IMAGES / "scan-matrix.work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        layers = {n: _layer(n, work / f"{n}.tar") for n in names}
        images = [ImageSpec(ref(env), [(base, "none"), (torch_layer, "none")] + [
            (layers[n], "none") for n in (env[1], env[0]) if n], {
            "Env": [f"PATH={DEFAULT_PATH}"],
            "Cmd": ["python3"]}) for env in ENVS]
        write_layout(work / "layout", images)
        pack(work / "layout", archive.with_suffix(".partial"))
        archive.with_suffix(".partial").replace(archive)
        stamp.write_text(key)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return archive


@pytest.fixture(scope="session")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base image unpacked once, with mount points for the probe and its output."""
    root = tmp_path_factory.mktemp("image-root")
    with tarfile.open(IMAGES / "python-base-rootfs.tar") as tar:
        tar.extractall(root, filter="tar")
    for d in ("opt/epguard-probe", "out", "proc", "dev", SITE):
        (root / d).mkdir(parents=True, exist_ok=True)
    return root


@dataclass
class Probed:
    rc: int
    report: dict
    stderr: str


def probe_in_image(root: Path, env: tuple[str | None, str | None], out: Path,
                   *opts: str) -> Probed:
    """The probe run on the image's files: overlayfs stacks the layers top first."""
    lower = ":".join(str(overlay(n)) for n in (env[0], env[1]) if n) + f":{TORCH_SITE}"
    out.mkdir(parents=True, exist_ok=True)
    log = out / "report.json"
    script = f"""
set -e
mount --make-rprivate /
mount -t overlay overlay -o ro,lowerdir={lower} {root}/{SITE}
mount --bind {REPO / "probe"} {root}/opt/epguard-probe
mount --bind {out} {root}/out
mount -t proc proc {root}/proc
mount --rbind /dev {root}/dev
exec chroot {root} /usr/bin/python3 -I /opt/epguard-probe --json --termination-log \
  /out/message {' '.join(opts)} -- {' '.join(WORKER)} > {log}
"""
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                          text=True, timeout=600,
                          env={"PATH": DEFAULT_PATH, "HOME": "/root"})
    text = log.read_text() if log.exists() else ""
    if not text.strip():
        pytest.fail(f"the probe printed no report (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return Probed(proc.returncode, json.loads(text), proc.stderr)


@pytest.mark.parametrize("env", ENVS, ids=[ref(e).split(":", 1)[1] for e in ENVS])
def test_scan_finds_the_image_cause_the_probe_finds_on_that_image(
        env, matrix_archive, rootfs, tmp_path):
    probed = probe_in_image(rootfs, env, tmp_path / "probe", "--no-static")
    got = probed.report
    r = scan(matrix_archive, "--json", "--ref", ref(env))
    assert r.rc in (0, 1), r.stderr
    scanned = r.doc["causes"]
    row = "{}\t{} ({})\t{}".format(
        ref(env).split(":", 1)[1], got["classification"], got["scope"] or "usable",
        ",".join(c["classification"] for c in scanned) or "none")
    print("agreement:", row)
    if got["scope"] == "image":
        assert r.rc == 1
        assert scanned[0]["classification"] == got["classification"]
        assert set(got["missing_libraries"]) - DRIVER == set(scanned[0]["missing_libraries"])
        assert r.doc["versions"] == got["versions"]
    else:
        # Usable, or a cause of this machine (no driver, no GPU): nothing in the files.
        assert got["classification"] in ("no-driver", "usable", "smoke-failed")
        assert r.rc == 0, scanned
        assert scanned == []
    if env == COMPLETE:
        # This machine's missing driver shows in the probe and never in the scan.
        assert "libcuda.so.1" in got["missing_libraries"]
        assert all("libcuda.so.1" not in c["missing_libraries"] for c in scanned)
        assert any(g.startswith("driver: libcuda.so.1") for g in r.doc["gpu_only"])
    # The probe's own fast path, from the same files, decides the same way.
    fast = probe_in_image(rootfs, env, tmp_path / "fast").report
    assert fast["classification"] == got["classification"]
    if fast["decided_from"] == "files":
        assert any(c["classification"] == fast["classification"] and c["proven"]
                   for c in scanned)
