"""Where an image's layers come from: an OCI image layout directory, an OCI archive
(``buildah push … oci-archive:``, ``skopeo copy … oci-archive:``), a docker archive
(``docker save``) or an unpacked root filesystem.

Only the small JSON documents (index, manifest, config) are read whole, each with a
size limit; a layer is handed out as a stream opened when it is applied. Inside an
uncompressed archive a blob is a byte range of the archive file, so an uncompressed
layer is read with seeks over the file contents the diagnosis does not need.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from epguard.webhook.scan.tarstream import Budget, BudgetError, TarError, TarReader, unlimited

# Index, manifest and config are a few KB; 8 MiB is room for configs with a long
# history, not for a document built to exhaust memory.
MAX_DOCUMENT_BYTES = 8 << 20
# More layers than any runtime accepts (overlayfs stacks at most ~500 lower dirs).
MAX_LAYERS = 500
# Entries of the outer archive itself: blobs and a few documents.
MAX_ARCHIVE_MEMBERS = 100_000
# Their names (blobs/sha256/<64 hex>, <id>/layer.tar: under 100 bytes each): what the
# member table may hold, so 100,000 names of 4 KB cannot take 400 MB.
MAX_ARCHIVE_NAME_BYTES = 16 << 20
# How deep an index may nest indexes (multi-platform images nest one level).
MAX_INDEX_DEPTH = 4

_MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_REF_ANNOTATIONS = ("org.opencontainers.image.ref.name", "io.containerd.image.name")


class SourceError(Exception):
    """Not an image we can read: the message says what was expected and found."""


@dataclass
class Layer:
    index: int
    digest: str
    media_type: str
    open: Callable[[], IO[bytes]]
    seekable: bool  # opened as a file whose tar members can be skipped by seeking
    # sha256 of the blob as stored: a layer that does not match is corrupt (or not the
    # layer the manifest names), and is refused before a byte of it is parsed.
    expect: str | None = None


@dataclass
class Source:
    kind: str  # "oci-layout" | "oci-archive" | "docker-archive" | "rootfs"
    path: str
    ref: str | None
    # The digest pods pin and the kubelet reports: the manifest's, or for a
    # multi-platform image the index's (a registry serves the index under the tag).
    # None for a docker archive or a rootfs: they keep no manifest.
    digest: str | None
    config: dict[str, Any]
    layers: list[Layer] = field(default_factory=list)
    rootfs: Path | None = None  # kind == "rootfs": the directory itself
    # The image ID: what the kubelet reports as imageID for an image with no registry
    # digest (one imported with `ctr images import`); a pulled one shows the manifest's.
    config_digest: str | None = None
    close: Callable[[], None] = lambda: None
    # A multi-platform image: the manifest of the platform read, inside the index.
    platform_digest: str | None = None


class _Range(io.RawIOBase):
    """Bytes [start, start+size) of an open file, as a file of its own."""

    def __init__(self, path: str, start: int, size: int) -> None:
        self._f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self._start, self._size, self._pos = start, size, 0
        self._at = -1  # the file's own offset, so sequential reads need no lseek

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._size - self._pos)
        if n <= 0:
            return 0
        if self._at != self._start + self._pos:
            self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got
        self._at = self._start + self._pos
        return got

    def close(self) -> None:
        self._f.close()
        super().close()


def _obj(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SourceError(f"{what} is not JSON: {exc}") from None


def _check_digest(digest: str, data: bytes, what: str) -> None:
    algo, _, want = digest.partition(":")
    if algo != "sha256" or len(want) != 64:
        raise SourceError(f"{what}: unsupported digest {digest[:80]!r}")
    if hashlib.sha256(data).hexdigest() != want:
        raise SourceError(f"{what}: content does not match its digest {digest}")


class _Blobs:
    """Blob access by digest: a directory (OCI layout) or members of an archive."""

    def __init__(self, path: str, members: dict[str, tuple[int, int]] | None) -> None:
        self.path = path
        self.members = members

    def _blob_name(self, digest: str) -> str:
        algo, _, hexd = digest.partition(":")
        if algo != "sha256" or len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
            raise SourceError(f"unsupported or malformed digest {digest[:80]!r}")
        return f"blobs/sha256/{hexd}"

    def read_name(self, name: str, what: str) -> bytes:
        if self.members is None:
            p = Path(self.path) / name
            try:
                size = p.stat().st_size
                if size > MAX_DOCUMENT_BYTES:
                    raise SourceError(f"{what} is {size} bytes, over {MAX_DOCUMENT_BYTES}")
                return p.read_bytes()
            except OSError as exc:
                raise SourceError(f"{what}: cannot read {name}: {exc.strerror}") from None
        m = self.members.get(name)
        if m is None:
            raise SourceError(f"{what}: {name} is not in the archive")
        start, size = m
        if size > MAX_DOCUMENT_BYTES:
            raise SourceError(f"{what} is {size} bytes, over {MAX_DOCUMENT_BYTES}")
        with _Range(self.path, start, size) as f:
            data = f.read(size)
        if len(data) != size:
            raise SourceError(f"{what}: the archive ends inside {name} (truncated)")
        return data

    def read(self, digest: str, what: str) -> bytes:
        data = self.read_name(self._blob_name(digest), what)
        _check_digest(digest, data, what)
        return data

    def opener(self, name: str, what: str) -> Callable[[], IO[bytes]]:
        if self.members is None:
            p = Path(self.path) / name
            if not p.is_file():
                raise SourceError(f"{what}: {name} is missing from the layout")
            return lambda: open(p, "rb")
        m = self.members.get(name)
        if m is None:
            raise SourceError(f"{what}: {name} is not in the archive")
        start, size = m
        if start + size > os.path.getsize(self.path):
            raise SourceError(f"{what}: the archive ends inside {name} (truncated)")
        path = self.path
        return lambda: cast(IO[bytes], _Range(path, start, size))

    def layer_opener(self, digest: str, what: str) -> Callable[[], IO[bytes]]:
        return self.opener(self._blob_name(digest), what)


def _archive_members(path: str, budget: Budget) -> dict[str, tuple[int, int]]:
    """(offset, size) of each regular member, read with the scan's own tar reader
    (``tarstream``: a hostile header cannot make it loop or read a huge name)."""
    members: dict[str, tuple[int, int]] = {}
    count = names = 0
    try:
        with open(path, "rb") as f:
            reader = TarReader(f, budget, seekable=True, length=os.fstat(f.fileno()).st_size,
                               what="the archive")
            for m in reader:
                count += 1
                if count > MAX_ARCHIVE_MEMBERS:
                    raise SourceError(f"more than {MAX_ARCHIVE_MEMBERS} entries: not an image")
                name = m.name[2:] if m.name.startswith("./") else m.name
                if m.isreg() and not m.sparse:
                    names += len(name) + 100
                    if names > MAX_ARCHIVE_NAME_BYTES:
                        raise SourceError(f"the archive's member names take more than "
                                          f"{MAX_ARCHIVE_NAME_BYTES >> 20} MiB: not an image")
                    members[name] = (m.offset_data, m.stored)
    except TarError as exc:
        said = str(exc)
        if "truncated" in said:
            raise SourceError(said) from None
        raise SourceError(f"not a tar archive ({said})") from None
    except BudgetError:
        raise
    except (EOFError, OSError) as exc:
        raise SourceError(f"the archive is truncated or unreadable: {exc}") from None
    if count == 0:
        raise SourceError("not a tar archive (no member in it)")
    return members


def _pick(index: Any, blobs: _Blobs, ref: str | None, platform: str, depth: int = 0
          ) -> tuple[str, Any, str | None, str]:
    """(digest listed in ``index``, the platform manifest, ref name, that manifest's
    digest) chosen from an OCI index."""
    if depth > MAX_INDEX_DEPTH:
        raise SourceError("indexes nested too deep")
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list) or not manifests:
        raise SourceError("index.json lists no manifests")
    named = []
    for d in manifests:
        if not isinstance(d, dict) or not isinstance(d.get("digest"), str):
            raise SourceError("index.json has a manifest entry without a digest")
        ann = _obj(d.get("annotations"))
        names = [ann[a] for a in _REF_ANNOTATIONS if isinstance(ann.get(a), str)]
        named.append((d, names))
    if ref is not None and depth == 0:
        chosen = [d for d, names in named if any(n == ref or n.endswith(":" + ref) or
                                                 n.split("/")[-1] == ref for n in names)]
        if not chosen:
            have = sorted({n for _, names in named for n in names})
            raise SourceError(f"no image named {ref!r} here; it holds: "
                              f"{', '.join(have)[:1000] or 'unnamed images'}")
    else:
        chosen = [d for d, _ in named]
        plat = [d for d in chosen if _platform(d) in (platform, None)]
        if not plat and depth > 0:
            have = sorted({str(_platform(d)) for d in chosen})
            raise SourceError(f"the image index has no {platform} image (it holds "
                              f"{', '.join(have)[:400]}): name one with --platform")
        chosen = plat or chosen
        if len(chosen) > 1 and depth == 0 and not any(d.get("platform") for d in chosen):
            have = sorted({n for _, names in named for n in names})
            raise SourceError(f"{len(chosen)} images here; name one with --ref "
                              f"({', '.join(have)[:1000] or 'none is named'})")
    d = chosen[0]
    names = next(n for dd, n in named if dd is d)
    data = blobs.read(d["digest"], "manifest")
    doc = _json(data, "manifest")
    media = doc.get("mediaType") or d.get("mediaType") if isinstance(doc, dict) else None
    if media in _INDEX_TYPES or (isinstance(doc, dict) and "manifests" in doc):
        _, manifest, name, inner = _pick(doc, blobs, None, platform, depth + 1)
        # The image's digest is this descriptor's, the index's: the one a registry
        # serves under the tag, pods pin, and the kubelet reports as imageID. The
        # platform manifest inside is kept beside it.
        return d["digest"], manifest, name or (names[0] if names else None), inner
    return d["digest"], doc, names[0] if names else None, d["digest"]


def _platform(d: dict[str, Any]) -> str | None:
    p = d.get("platform")
    if not isinstance(p, dict):
        return None
    return f"{p.get('os')}/{p.get('architecture')}"


def _layers_from_manifest(manifest: Any, blobs: _Blobs) -> list[Layer]:
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    if not isinstance(layers, list):
        raise SourceError("the manifest lists no layers")
    if len(layers) > MAX_LAYERS:
        raise SourceError(f"{len(layers)} layers, over {MAX_LAYERS}")
    out = []
    for i, d in enumerate(layers):
        if not isinstance(d, dict) or not isinstance(d.get("digest"), str):
            raise SourceError(f"layer {i} has no digest")
        media = str(d.get("mediaType") or "")
        if "nondistributable" in media or d.get("urls"):
            raise SourceError(f"layer {i} ({d['digest']}) is not in this image (foreign layer)")
        opener = blobs.layer_opener(d["digest"], f"layer {i}")
        out.append(Layer(i, d["digest"], media, opener, seekable=True, expect=d["digest"]))
    return out


def _config(manifest: Any, blobs: _Blobs) -> dict[str, Any]:
    c = manifest.get("config") if isinstance(manifest, dict) else None
    if not isinstance(c, dict) or not isinstance(c.get("digest"), str):
        raise SourceError("the manifest names no config")
    doc = _json(blobs.read(c["digest"], "image config"), "image config")
    if not isinstance(doc, dict):
        raise SourceError("the image config is not an object")
    return doc


def _oci(path: str, blobs: _Blobs, kind: str, ref: str | None, platform: str) -> Source:
    layout = _json(blobs.read_name("oci-layout", "oci-layout"), "oci-layout")
    if not isinstance(layout, dict) or "imageLayoutVersion" not in layout:
        raise SourceError("oci-layout has no imageLayoutVersion")
    index = _json(blobs.read_name("index.json", "index.json"), "index.json")
    digest, manifest, name, inner = _pick(index, blobs, ref, platform)
    config = _config(manifest, blobs)
    return Source(kind, path, name, digest, config, _layers_from_manifest(manifest, blobs),
                  config_digest=_obj(_obj(manifest).get("config")).get("digest"),
                  platform_digest=inner if inner != digest else None)


def _docker(path: str, blobs: _Blobs, ref: str | None) -> Source:
    doc = _json(blobs.read_name("manifest.json", "manifest.json"), "manifest.json")
    if not isinstance(doc, list) or not doc:
        raise SourceError("manifest.json lists no images")
    entries = [e for e in doc if isinstance(e, dict)]
    if ref is not None:
        entries = [e for e in entries if any(
            isinstance(t, str) and (t == ref or t.split("/")[-1] == ref or t.endswith(":" + ref))
            for t in e.get("RepoTags") or [])]
        if not entries:
            raise SourceError(f"no image tagged {ref!r} in manifest.json")
    elif len(entries) > 1:
        raise SourceError(f"{len(entries)} images in manifest.json; name one with --ref")
    e = entries[0]
    config_name, layer_names = e.get("Config"), e.get("Layers")
    if not isinstance(config_name, str) or not isinstance(layer_names, list):
        raise SourceError("manifest.json entry lacks Config or Layers")
    if len(layer_names) > MAX_LAYERS:
        raise SourceError(f"{len(layer_names)} layers, over {MAX_LAYERS}")
    config_bytes = blobs.read_name(config_name, "image config")
    config = _json(config_bytes, "image config")
    if not isinstance(config, dict):
        raise SourceError("the image config is not an object")
    found = _obj(config.get("rootfs")).get("diff_ids")
    diff_ids: list[Any] = found if isinstance(found, list) else []
    layers = []
    for i, name in enumerate(layer_names):
        if not isinstance(name, str):
            raise SourceError(f"layer {i} is not a file name")
        # docker save stores layers uncompressed: the config's diff_id is their digest.
        # (Newer docker writes an OCI layout beside manifest.json and is read as OCI.)
        expect = diff_ids[i] if i < len(diff_ids) and isinstance(diff_ids[i], str) else None
        layers.append(Layer(i, name, "", blobs.opener(name, f"layer {i}"), seekable=True,
                            expect=expect))
    tags = [t for t in e.get("RepoTags") or [] if isinstance(t, str)]
    # `docker save` keeps no manifest, so there is no digest a registry would serve or
    # a pod could pin (None: `--record` refuses it). The config's sha256 is the image
    # ID docker shows; the file is named after it, and a name that says otherwise is
    # a forgery (it would let the report name any digest).
    image_id = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    named = config_name.rsplit("/", 1)[-1].removesuffix(".json")
    if len(named) == 64 and all(c in "0123456789abcdef" for c in named) \
            and f"sha256:{named}" != image_id:
        raise SourceError(f"image config: {config_name[:200]} is named after sha256:{named} "
                          f"but its content is {image_id}")
    return Source("docker-archive", path, tags[0] if tags else None, None, config, layers,
                  config_digest=image_id)


def open_source(path: str, ref: str | None = None, platform: str = "linux/amd64",
                budget: Budget | None = None) -> Source:
    """The image at ``path``; SourceError with the reason when it is not one."""
    p = Path(path)
    if p.is_dir():
        if (p / "oci-layout").is_file():
            return _oci(path, _Blobs(path, None), "oci-layout", ref, platform)
        if (p / "manifest.json").is_file():
            return _docker(path, _Blobs(path, None), ref)
        if (p / "usr").is_dir() or (p / "etc").is_dir() or (p / "bin").exists():
            return Source("rootfs", path, None, None, {}, rootfs=p)
        raise SourceError(f"{path} is a directory with no oci-layout, no manifest.json and "
                          "no root filesystem (usr/, etc/)")
    if not p.exists():
        raise SourceError(f"{path}: no such file or directory")
    if not p.is_file():
        raise SourceError(f"{path} is not a regular file or directory")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic[:2] == b"\x1f\x8b" or magic == b"\x28\xb5\x2f\xfd":
        raise SourceError(f"{path} is a compressed file; decompress the archive first "
                          "(its layers may stay compressed)")
    members = _archive_members(path, budget or unlimited())
    blobs = _Blobs(path, members)
    if "oci-layout" in members and "index.json" in members:
        return _oci(path, blobs, "oci-archive", ref, platform)
    if "manifest.json" in members:
        return _docker(path, blobs, ref)
    raise SourceError(f"{path} is a tar archive without oci-layout/index.json or manifest.json:"
                      " not an OCI or docker image archive")
