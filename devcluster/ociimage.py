"""OCI image archives written directly, for images that are only files (no build steps).

No outside registry is reachable here, so every image the node runs is built here as
an archive, which the node pushes into its own registry (``Registry.push_archive``) and
the kubelet pulls. For an image that is a static binary
(the pause image) or a prepared root filesystem, a build tool adds nothing: this
writes the OCI image layout (``oci-layout``, ``index.json``, blobs) as one tar naming
the image ``ref``. Layers are written with fixed mtimes, owners and
order, so the same files give the same digests, and the cache can key on them.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
_MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
# Large layers (a torch install is ~5 GB) stay uncompressed: gzip would cost minutes
# on two cores and save nothing, since the archive never leaves this machine.
_MEDIA_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True)
class LayerFile:
    """One file of a layer: its path in the image, its bytes and mode; or, with
    ``symlink`` set, a symbolic link to that target."""

    path: str
    data: bytes = b""
    mode: int = 0o755
    symlink: str | None = None


def _tar_info(name: str, size: int, mode: int, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.type = size, mode, kind
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    return info


def layer_from_files(files: Iterable[LayerFile]) -> bytes:
    """An uncompressed layer tar holding ``files`` (parent directories included)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for f in sorted(files, key=lambda f: f.path):
            parts = f.path.strip("/").split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    tar.addfile(_tar_info(d, 0, 0o755, tarfile.DIRTYPE))
            if f.symlink is not None:
                info = _tar_info("/".join(parts), 0, 0o777, tarfile.SYMTYPE)
                info.linkname = f.symlink
                tar.addfile(info)
            else:
                tar.addfile(_tar_info("/".join(parts), len(f.data), f.mode), io.BytesIO(f.data))
    return buf.getvalue()


def layer_from_dir(source: Path, dest: str, out: Path) -> Path:
    """Write an uncompressed layer tar to ``out`` holding the tree ``source`` at image path
    ``dest``; owners are reset to root, modes and mtimes kept (so byte-compiled files
    stay valid)."""

    def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        parts = dest.strip("/").split("/")
        for i in range(1, len(parts)):
            tar.addfile(_tar_info("/".join(parts[:i]), 0, 0o755, tarfile.DIRTYPE))
        tar.add(source, arcname="/".join(parts), filter=owned_by_root)
    return out


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _blob_file(tar: tarfile.TarFile, path: Path, digest: str) -> None:
    size = path.stat().st_size
    with path.open("rb") as f:
        tar.addfile(_tar_info(f"blobs/sha256/{digest[7:]}", size, 0o644), f)


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    tar.addfile(_tar_info(f"blobs/sha256/{digest[7:]}", len(data), 0o644), io.BytesIO(data))
    return digest


def _json(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def write_archive(
    path: Path, ref: str, layers: Sequence[bytes | Path], config: Mapping[str, Any]
) -> str:
    """Write an OCI archive of one linux/amd64 image named ``ref`` with uncompressed layer
    tars ``layers`` (bottom first; bytes are gzipped, files stored as they are) and image
    ``config`` (Entrypoint, Env, User, ...); returns the manifest digest (what containerd
    reports as the image's digest)."""
    gz = [gzip.compress(layer, mtime=0) if isinstance(layer, bytes) else layer for layer in layers]
    diff_ids = [
        "sha256:" + hashlib.sha256(layer).hexdigest()
        if isinstance(layer, bytes)
        else _sha256_file(layer)
        for layer in layers
    ]
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": dict(config),
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        config_bytes = _json(image_config)
        layer_descs = []
        for g, diff_id in zip(gz, diff_ids, strict=True):
            if isinstance(g, bytes):
                layer_descs.append(
                    {"mediaType": _MEDIA_LAYER, "digest": _blob(tar, g), "size": len(g)}
                )
            else:
                _blob_file(tar, g, diff_id)
                layer_descs.append(
                    {"mediaType": _MEDIA_LAYER_TAR, "digest": diff_id, "size": g.stat().st_size}
                )
        manifest = _json(
            {
                "schemaVersion": 2,
                "mediaType": _MEDIA_MANIFEST,
                "config": {
                    "mediaType": _MEDIA_CONFIG,
                    "digest": _blob(tar, config_bytes),
                    "size": len(config_bytes),
                },
                "layers": layer_descs,
            }
        )
        manifest_digest = _blob(tar, manifest)
        index = _json(
            {
                "schemaVersion": 2,
                "manifests": [
                    {
                        "mediaType": _MEDIA_MANIFEST,
                        "digest": manifest_digest,
                        "size": len(manifest),
                        "annotations": {"io.containerd.image.name": ref},
                    }
                ],
            }
        )
        for name, data in (
            ("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
            ("index.json", index),
        ):
            tar.addfile(_tar_info(name, len(data), 0o644), io.BytesIO(data))
    tmp.replace(path)
    return manifest_digest


def archive_images(path: Path) -> dict[str, str]:
    """{image name: manifest digest} of an OCI archive, from its index.json (tarfile
    seeks over the blobs, so this is quick even for a multi-GB archive)."""
    with tarfile.open(path) as tar:
        member = tar.extractfile("index.json")
        if member is None:
            return {}
        index = json.load(member)
    names = {}
    for m in index.get("manifests", []):
        annotations = m.get("annotations", {})
        name = annotations.get("io.containerd.image.name") or annotations.get(
            "org.opencontainers.image.ref.name"
        )
        if name:
            names[str(name)] = str(m["digest"])
    return names
