"""Build image archives for the scan tests: layers from real files, in every format.

A layer is a plain tar file; ``compress`` turns it into gzip or zstd. ``write_layout``
writes an OCI image layout directory holding one or more images (they share blobs,
as a registry would); ``pack`` turns a directory into a tar archive (an OCI archive
from a layout); ``write_docker`` writes what ``docker save`` writes.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

MEDIA = {
    "none": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}


@dataclass
class LayerSpec:
    """Files for one layer: (source, destination) trees and extra entries."""

    trees: list[tuple[Path, str]] = field(default_factory=list)
    skip: Callable[[str], bool] = lambda rel: False
    whiteouts: list[str] = field(default_factory=list)  # paths, e.g. usr/x/.wh.mooncake
    files: dict[str, bytes] = field(default_factory=dict)
    empty_named: list[tuple[Path, str]] = field(default_factory=list)  # names only


def _info(name: str, size: int = 0, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.type, ti.mode, ti.mtime = size, kind, 0o755 if kind == tarfile.DIRTYPE else 0o644, 0
    return ti


def write_layer(out: Path, spec: LayerSpec) -> Path:
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for src, dest in spec.trees:
            for dirpath, dirnames, filenames in os.walk(src):
                dirnames.sort()
                rel_dir = os.path.relpath(dirpath, src)
                for name in sorted(filenames):
                    rel = os.path.normpath(os.path.join(rel_dir, name))
                    if spec.skip(rel) or "__pycache__" in rel or name == ".done":
                        continue
                    full = os.path.join(dirpath, name)
                    arc = f"{dest}/{rel}"
                    if os.path.islink(full):
                        ti = _info(arc, 0, tarfile.SYMTYPE)
                        ti.linkname = os.readlink(full)
                        tar.addfile(ti)
                    else:
                        with open(full, "rb") as f:
                            tar.addfile(_info(arc, os.path.getsize(full)), f)
        for src, dest in spec.empty_named:
            for name in sorted(os.listdir(src)):
                tar.addfile(_info(f"{dest}/{name}"), io.BytesIO(b""))
        for path in spec.whiteouts:
            tar.addfile(_info(path), io.BytesIO(b""))
        for path, data in spec.files.items():
            tar.addfile(_info(path, len(data)), io.BytesIO(data))
    return out


def compress(layer: Path, how: str) -> Path:
    if how == "none":
        return layer
    out = layer.with_suffix(layer.suffix + (".gz" if how == "gzip" else ".zst"))
    with open(layer, "rb") as src, open(out, "wb") as dst:
        if how == "gzip":
            with gzip.GzipFile(fileobj=dst, mode="wb", compresslevel=1, mtime=0) as z:
                shutil.copyfileobj(src, z, 1 << 20)
        else:
            zstandard.ZstdCompressor(level=1).copy_stream(src, dst)
    return out


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _blob(root: Path, data: bytes | Path) -> tuple[str, int]:
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    if isinstance(data, Path):
        hexd = _sha(data)
        target = blobs / hexd
        if not target.exists():
            try:
                os.link(data, target)  # the big layers are shared, not copied
            except OSError:
                shutil.copyfile(data, target)
        return hexd, data.stat().st_size
    hexd = hashlib.sha256(data).hexdigest()
    (blobs / hexd).write_bytes(data)
    return hexd, len(data)


def image_config(config: dict[str, Any], diff_ids: list[str]) -> bytes:
    return json.dumps({"architecture": "amd64", "os": "linux", "config": config,
                       "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()


@dataclass
class ImageSpec:
    ref: str
    layers: list[tuple[Path, str]]  # (blob file, compression)
    config: dict[str, Any] = field(default_factory=dict)


def write_layout(root: Path, images: Iterable[ImageSpec]) -> dict[str, str]:
    """An OCI layout; returns {ref: manifest digest}."""
    root.mkdir(parents=True, exist_ok=True)
    manifests, digests = [], {}
    for img in images:
        descs = []
        for blob, how in img.layers:
            hexd, size = _blob(root, blob)
            descs.append({"mediaType": MEDIA[how], "digest": f"sha256:{hexd}", "size": size})
        cfg = image_config(img.config, [d["digest"] for d in descs])
        chex, csize = _blob(root, cfg)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": f"sha256:{chex}", "size": csize},
            "layers": descs}).encode()
        mhex, msize = _blob(root, manifest)
        digests[img.ref] = f"sha256:{mhex}"
        manifests.append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                          "digest": f"sha256:{mhex}", "size": msize,
                          "annotations": {"org.opencontainers.image.ref.name": img.ref}})
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return digests


def pack(src: Path, out: Path) -> Path:
    """``src``'s contents as a tar archive (no compression), names relative to src."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                tar.add(full, arcname=os.path.relpath(full, src), recursive=False)
    return out


def write_docker(root: Path, img: ImageSpec) -> Path:
    """The layout of ``docker save`` (before docker 25): <id>/layer.tar, <config>.json."""
    root.mkdir(parents=True, exist_ok=True)
    names, diff_ids = [], []
    for i, (blob, _how) in enumerate(img.layers):
        d = root / f"layer{i}"
        d.mkdir()
        target = d / "layer.tar"
        if blob.stat().st_dev == root.stat().st_dev:
            os.link(blob, target)
        else:
            shutil.copyfile(blob, target)
        names.append(f"layer{i}/layer.tar")
        diff_ids.append("sha256:" + _sha(blob))
    cfg = image_config(img.config, diff_ids)
    chex = hashlib.sha256(cfg).hexdigest()
    (root / f"{chex}.json").write_bytes(cfg)
    (root / "manifest.json").write_text(json.dumps(
        [{"Config": f"{chex}.json", "RepoTags": [img.ref], "Layers": names}]))
    (root / "repositories").write_text("{}")
    return root
