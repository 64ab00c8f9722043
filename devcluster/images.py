"""The images the local node runs, built here and cached by content in
``$EPGUARD_CACHE/images`` (no registry is reachable, so nothing is ever pulled).

``python -m devcluster.images`` (run by ``scripts/tools.d/40-images.sh``) builds
what is missing:

* ``pause.oci.tar`` (``localhost/epguard/pause:3.10``): the pod sandbox image,
  Kubernetes' own ``build/pause/linux/pause.c`` from the pinned ``k8s.io/kubernetes``
  module source, compiled static with gcc.

Each archive has a ``.key`` file next to it holding the hash of its inputs; a
changed input rebuilds it, an unchanged one is skipped in milliseconds.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from devcluster import binaries, ociimage
from devcluster.node import PAUSE_IMAGE

KUBERNETES_VERSION = "v1.35.4"
REPO_ROOT = Path(__file__).resolve().parent.parent


def images_dir() -> Path:
    return binaries.cache_dir() / "images"


def _current(archive: Path, key: str) -> bool:
    stamp = archive.with_suffix(".key")
    return archive.is_file() and stamp.is_file() and stamp.read_text() == key


def _stamp(archive: Path, key: str) -> None:
    archive.with_suffix(".key").write_text(key)


def pause_source() -> Path:
    gomodcache = subprocess.run(
        ["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True
    ).stdout.strip()
    src = Path(gomodcache) / f"k8s.io/kubernetes@{KUBERNETES_VERSION}/build/pause/linux/pause.c"
    if not src.is_file():
        # The module is in the cache once scripts/tools.d/10-kube.sh has run; this
        # fetches it otherwise (the Go module proxy is reachable, registries are not).
        subprocess.run(
            ["go", "mod", "download", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"],
            cwd=REPO_ROOT / "devcluster" / "go" / "node",
            check=True,
        )
    return src


def build_pause() -> Path:
    """The pause image archive, built if its source or compiler changed."""
    archive = images_dir() / "pause.oci.tar"
    src = pause_source()
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(src.read_bytes() + gcc.encode() + PAUSE_IMAGE.encode()).hexdigest()
    if _current(archive, key):
        return archive
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "pause"
        subprocess.run(
            ["gcc", "-Os", "-static", f"-DVERSION={KUBERNETES_VERSION}-epguard", "-o", str(binary),
             str(src)],
            check=True,
        )  # fmt: skip
        subprocess.run(["strip", str(binary)], check=True)
        layer = ociimage.layer_from_files([ociimage.LayerFile("pause", binary.read_bytes())])
    ociimage.write_archive(
        archive, PAUSE_IMAGE, [layer], {"Entrypoint": ["/pause"], "User": "65535:65535"}
    )
    _stamp(archive, key)
    return archive


BUSYBOX_IMAGE = "localhost/epguard/busybox:1"
_BUSYBOX = Path("/bin/busybox")


def build_busybox() -> Path:
    archive = images_dir() / "busybox.oci.tar"
    data = _BUSYBOX.read_bytes()
    key = hashlib.sha256(data + BUSYBOX_IMAGE.encode()).hexdigest()
    if _current(archive, key):
        return archive
    applets = subprocess.run(
        [str(_BUSYBOX), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    files = [ociimage.LayerFile("bin/busybox", data)]
    files += [ociimage.LayerFile(f"bin/{a}", symlink="busybox") for a in applets if a != "busybox"]
    files += [
        ociimage.LayerFile("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o644),
        ociimage.LayerFile("tmp/.keep", b"", 0o644),
    ]
    layer = ociimage.layer_from_files(files)
    ociimage.write_archive(archive, BUSYBOX_IMAGE, [layer], {"Cmd": ["/bin/sh"], "Env": [
        "PATH=/bin"]})  # fmt: skip
    _stamp(archive, key)
    return archive


PYTHON_BASE_IMAGE = "localhost/epguard/python-base:bookworm"
EPGUARD_IMAGE = "localhost/epguard/epguard:dev"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# python-is-python3: the Dockerfile runs `python`, as the python:3.11 images provide.
_BASE_PACKAGES = "python3,python3-venv,python3-pip,python-is-python3,ca-certificates"


def buildah(*args: str) -> list[str]:
    """buildah with a store of its own under the cache, vfs (no overlay mounts to leak)."""
    store = binaries.cache_dir() / "buildah"
    return ["buildah", "--root", str(store / "root"), "--runroot", str(store / "run"),
            "--storage-driver", "vfs", *args]  # fmt: skip


def _has_image(ref: str) -> bool:
    r = subprocess.run(buildah("inspect", "--type", "image", ref), capture_output=True, check=False)
    return r.returncode == 0


_LOCAL_CAS = Path("/usr/local/share/ca-certificates")


def _trust_hooks() -> list[str]:
    """mmdebstrap hooks that make the base trust what this machine trusts: the CAs an
    admin added under /usr/local/share/ca-certificates (here, the egress proxy's, without
    which pip in the Dockerfile's RUN cannot reach PyPI), and pip told to use the
    system bundle. A base built elsewhere gets whatever that machine adds, or nothing."""
    hooks = [
        "--customize-hook=printf '[global]\\ncert = /etc/ssl/certs/ca-certificates.crt\\n'"
        ' > "$1/etc/pip.conf"'
    ]
    if _LOCAL_CAS.is_dir() and any(_LOCAL_CAS.glob("*.crt")):
        hooks += [
            f"--customize-hook=copy-in {_LOCAL_CAS} /usr/local/share",
            '--customize-hook=chroot "$1" update-ca-certificates',
        ]
    return hooks


def _local_cas_digest() -> str:
    if not _LOCAL_CAS.is_dir():
        return ""
    return hashlib.sha256(
        b"".join(p.read_bytes() for p in sorted(_LOCAL_CAS.glob("*.crt")))
    ).hexdigest()


def build_python_base() -> str:
    """The Debian python3 base in buildah's store; returns its key (rebuilt when the
    package list changes)."""
    key = hashlib.sha256(
        f"{DEBIAN_MIRROR} bookworm {_BASE_PACKAGES} {_local_cas_digest()}".encode()
    ).hexdigest()
    stamp = images_dir() / "python-base.key"
    # The rootfs tar is kept: it is also the bottom layer of the worker images.
    rootfs = python_base_rootfs()
    current = stamp.is_file() and stamp.read_text() == key and rootfs.is_file()
    if current and _has_image(PYTHON_BASE_IMAGE):
        return key
    with tempfile.TemporaryDirectory() as tmp:
        partial = Path(tmp) / "rootfs.tar"
        subprocess.run(
            ["mmdebstrap", "--variant=apt", f"--include={_BASE_PACKAGES}", "--mode=root",
             "--quiet", *_trust_hooks(), "bookworm", str(partial), DEBIAN_MIRROR],
            check=True,
        )  # fmt: skip
        container = subprocess.run(
            buildah("from", "scratch"), capture_output=True, text=True, check=True
        ).stdout.strip()
        try:
            subprocess.run(buildah("add", container, str(partial), "/"), check=True)
            subprocess.run(
                buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:"
                        "/usr/bin:/sbin:/bin", "--cmd", "python3", container),
                check=True,
            )  # fmt: skip
            subprocess.run(buildah("commit", "--quiet", container, PYTHON_BASE_IMAGE), check=True)
        finally:
            subprocess.run(buildah("rm", container), capture_output=True, check=False)
        shutil.move(partial, rootfs)
    stamp.write_text(key)
    return key


def python_base_rootfs() -> Path:
    return images_dir() / "python-base-rootfs.tar"


def _source_files() -> list[Path]:
    """What the Dockerfile copies: tracked and untracked-but-not-ignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "--", "Dockerfile", "pyproject.toml",
         "README.md", "webhook", "probe"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return sorted(REPO_ROOT / line for line in out.splitlines() if (REPO_ROOT / line).is_file())


def build_epguard() -> Path:
    """The project's Dockerfile built on the Debian python3 base, as an OCI archive."""
    base_key = build_python_base()
    archive = images_dir() / "epguard.oci.tar"
    digest = hashlib.sha256(base_key.encode())
    for f in _source_files():
        digest.update(str(f.relative_to(REPO_ROOT)).encode() + b"\0" + f.read_bytes())
    key = digest.hexdigest()
    if _current(archive, key):
        return archive
    with tempfile.TemporaryDirectory() as tmp:
        # A clean context: only what the Dockerfile may copy, never .venv or .run.
        context = Path(tmp) / "context"
        for f in _source_files():
            dest = context / f.relative_to(REPO_ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(f.read_bytes())
        # buildah keeps the Dockerfile's cache mounts (uv's) under $TMPDIR/buildah-cache:
        # under the cache, beside its store, not in /var/tmp.
        tmpdir = binaries.cache_dir() / "buildah" / "tmp"
        tmpdir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            buildah("bud", "--quiet", "--network", "host", "--isolation", "chroot",
                    "--layers=false", "--build-arg", f"BASE_IMAGE={PYTHON_BASE_IMAGE}",
                    "--build-arg", f"REVISION={key[:12]}", "-t", EPGUARD_IMAGE, str(context)),
            check=True, env={**os.environ, "TMPDIR": str(tmpdir)},
        )  # fmt: skip
    tmp_archive = archive.with_suffix(".partial")
    tmp_archive.unlink(missing_ok=True)
    subprocess.run(
        buildah("push", "--quiet", EPGUARD_IMAGE, f"oci-archive:{tmp_archive}:{EPGUARD_IMAGE}"),
        check=True,
    )
    tmp_archive.replace(archive)
    _stamp(archive, key)
    # The archive is the product; buildah's vfs copy of it (and of every earlier build,
    # untagged by this one) is ~0.5 GB each and would fill the disk build after build.
    subprocess.run(buildah("rmi", EPGUARD_IMAGE), capture_output=True, check=False)
    subprocess.run(buildah("rmi", "--prune"), capture_output=True, check=False)
    return archive


@dataclass(frozen=True)
class WorkerImage:
    """An SGLang worker image: the Debian python3 base, the real torch 2.13.0 (CUDA 13)
    install from ``scripts/tools.d/30-realpkgs.sh``, and real SGLang and mooncake wheels
    (``overlays``, names under ``$EPGUARD_CACHE/realpkgs/overlays``), all in the system
    Python's ``/usr/local/lib/python3.11/dist-packages``: what a team's image holds."""

    ref: str
    name: str
    overlays: tuple[str, ...]
    why: str
    # Debian packages on top of the python3 base (the worker's system libraries).
    apt: tuple[str, ...] = ()


# The mooncake wheel here cannot work in this image, whatever the node: it is the CUDA 12
# build beside CUDA 13 torch (libcudart.so.12 is not in the image).
BAD_WORKER = WorkerImage(
    ref="localhost/epguard/sglang:0.5.23-mte0.3.13",
    name="worker-bad",
    overlays=("sglang-0.5.23", "mte-0.3.13.post1"),
    why="CUDA 12 mooncake-transfer-engine 0.3.13.post1 beside CUDA 13 torch 2.13.0",
)
# Everything this image needs is in it (the CUDA 13 mooncake build beside CUDA 13 torch,
# SGLang 0.5.20 importing mooncake.pg, rdma-core userspace, libcurl): its only fault is the
# machine's, no GPU and so no NVIDIA driver (libcuda.so.1) mounted into the container.
ENV_ONLY_WORKER = WorkerImage(
    ref="localhost/epguard/sglang:0.5.20-mte-cuda13-0.3.13",
    name="worker-env-only",
    overlays=("sglang-0.5.20", "mte-cuda13-0.3.13.post1"),
    why="complete image; fails only where no GPU driver is mounted",
    apt=("libibverbs1", "ibverbs-providers", "libnuma1", "libcurl4"),
)
WORKER_IMAGES = (BAD_WORKER, ENV_ONLY_WORKER)
_SITE = "usr/local/lib/python3.11/dist-packages"


def _realpkgs() -> Path:
    return binaries.cache_dir() / "realpkgs"


def _torch_layer() -> Path:
    """The torch venv's site-packages as one uncompressed layer, shared by every worker
    image (containerd stores it once)."""
    venv = _realpkgs() / "torch-2.13.0"
    done = venv / ".done"
    if not done.is_file():
        raise FileNotFoundError(f"{venv} not built: run scripts/tools.d/30-realpkgs.sh")
    site = next((venv / "lib").glob("python3*/site-packages"))
    layer = images_dir() / "layers" / "torch-2.13.0.tar"
    key = f"{site} {done.stat().st_mtime_ns}"
    if _current(layer, key):
        return layer
    layer.parent.mkdir(parents=True, exist_ok=True)
    ociimage.layer_from_dir(site, _SITE, layer.with_suffix(".partial"))
    layer.with_suffix(".partial").replace(layer)
    _stamp(layer, key)
    return layer


def _worker_rootfs(apt: tuple[str, ...]) -> tuple[Path, str]:
    """The python3 base's rootfs, or one bootstrapped with ``apt`` packages added; and
    its key."""
    base_key = build_python_base()
    if not apt:
        return python_base_rootfs(), base_key
    key = hashlib.sha256(f"{base_key} {','.join(sorted(apt))}".encode()).hexdigest()
    rootfs = images_dir() / f"rootfs-{key[:16]}.tar"
    if rootfs.is_file():
        return rootfs, key
    # mmdebstrap picks the output format from the name: keep it ending in .tar.
    partial = rootfs.with_suffix(".partial.tar")
    subprocess.run(
        ["mmdebstrap", "--variant=apt", f"--include={_BASE_PACKAGES},{','.join(apt)}",
         "--mode=root", "--quiet", *_trust_hooks(), "bookworm", str(partial), DEBIAN_MIRROR],
        check=True,
    )  # fmt: skip
    partial.replace(rootfs)
    return rootfs, key


def build_worker(image: WorkerImage) -> Path:
    archive = images_dir() / f"{image.name}.oci.tar"
    torch = _torch_layer()
    rootfs, rootfs_key = _worker_rootfs(image.apt)
    overlays = [_realpkgs() / "overlays" / o for o in image.overlays]
    for o in overlays:
        if not (o / ".done").is_file():
            raise FileNotFoundError(f"{o} not built: run scripts/tools.d/30-realpkgs.sh")
    key = hashlib.sha256(
        " ".join([image.ref, rootfs_key, torch.with_suffix(".key").read_text(),
                  *(f"{o}:{(o / '.done').stat().st_mtime_ns}" for o in overlays)]).encode()
    ).hexdigest()  # fmt: skip
    if _current(archive, key):
        return archive
    with tempfile.TemporaryDirectory(dir=images_dir()) as tmp:
        # One directory holding every overlay, as `pip install` into one prefix would.
        merged = Path(tmp) / "site"
        for o in overlays:
            shutil.copytree(o, merged, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".done"))
        top = ociimage.layer_from_dir(merged, _SITE, Path(tmp) / "overlays.tar")
        ociimage.write_archive(
            archive,
            image.ref,
            [rootfs, torch, top],
            {
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                "Cmd": ["python3"],
                "Labels": {"io.epguard.test.why": image.why},
            },
        )
    _stamp(archive, key)
    return archive


def built_workers() -> list[Path]:
    """The worker image archives that `make tools` built (all of them, normally)."""
    return [a for a in (images_dir() / f"{i.name}.oci.tar" for i in WORKER_IMAGES) if a.is_file()]


def main() -> int:
    images_dir().mkdir(parents=True, exist_ok=True)
    builds: list[Callable[[], Path]] = [build_pause, build_busybox, build_epguard]
    builds += [functools.partial(build_worker, image) for image in WORKER_IMAGES]
    for build in builds:
        start = time.monotonic()
        archive = build()
        print(f"images: {archive.name} ready ({time.monotonic() - start:.1f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
