"""Apply an image's layers to a :class:`Tree`, one streamed pass each.

A layer's compression is taken from its first bytes, not its media type (docker
archives carry none, and mislabelled layers exist): gzip, zstd or a plain tar. A
plain tar opened from a file is read with seeks, so the gigabytes of torch's
libraries cost only their headers; a compressed one must be decompressed in full,
which is the floor any reader pays.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, cast

import zstandard

from epguard.webhook.scan.sources import Layer, SourceError
from epguard.webhook.scan.tarstream import (
    Budget,
    BudgetError,
    Entry,
    TarError,
    TarReader,
    text,
    unlimited,
)
from epguard.webhook.scan.tree import Tree, TreeError, wanted

_GZIP = b"\x1f\x8b"
_ZSTD = b"\x28\xb5\x2f\xfd"
# zstd frames may declare windows up to 2 GiB; 128 MiB is what `zstd --long=27` uses
# and bounds the decoder's memory.
ZSTD_MAX_WINDOW = 1 << 27


def compression(head: bytes) -> str:
    if head.startswith(_GZIP):
        return "gzip"
    if head.startswith(_ZSTD):
        return "zstd"
    return "none"


def _stream(f: IO[bytes], kind: str) -> IO[bytes]:
    if kind == "gzip":
        # GzipFile checks the CRC and length at the end of each member.
        return cast(IO[bytes], gzip.GzipFile(fileobj=f, mode="rb"))
    if kind == "zstd":
        dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        # Every frame: zstd:chunked layers are many frames (and skippable ones).
        return cast(IO[bytes], dctx.stream_reader(f, read_across_frames=True))
    return f


HASH_CHUNK = 8 << 20


def verify(layer: Layer, budget: Budget) -> None:
    """Refuse a layer whose bytes do not match its digest: one sequential read, at
    the speed of the disk (sha256 runs at ~1.7 GB/s here), under the scan's deadline
    (the bytes are the file's, not decompressed: they do not count as --max-bytes)."""
    if layer.expect is None:
        return
    algo, _, want = layer.expect.partition(":")
    if algo != "sha256":
        raise SourceError(f"layer {layer.index}: unsupported digest {layer.expect[:80]!r}")
    h = hashlib.sha256()
    try:
        with layer.open() as f:
            raw = cast(io.RawIOBase, f)
            buf = bytearray(HASH_CHUNK)
            view = memoryview(buf)
            while n := raw.readinto(buf):
                h.update(view[:n])
                budget.check()
    except OSError as exc:
        raise SourceError(f"layer {layer.index}: cannot read: {exc}") from None
    if h.hexdigest() != want:
        raise SourceError(f"layer {layer.index} ({layer.digest[:80]}) is corrupt or truncated: "
                          f"its content does not match {layer.expect}")


def apply_layer(tree: Tree, layer: Layer, budget: Budget | None = None) -> str:
    """Apply ``layer``; returns its compression. SourceError when it cannot be read,
    BudgetError past the scan's time or decompressed bytes."""
    budget = budget or unlimited()
    what = f"layer {layer.index} ({layer.digest[:80]})"
    verify(layer, budget)
    try:
        f = layer.open()
    except OSError as exc:
        raise SourceError(f"{what}: cannot open: {exc}") from None
    with f:
        head = f.read(4)
        f.seek(0)
        kind = compression(head)
        try:
            length = f.seek(0, os.SEEK_END) if kind == "none" and layer.seekable else None
            f.seek(0)
            stream = _stream(f, kind)
            reader = TarReader(stream, budget, seekable=length is not None, length=length,
                               what=f"{what} ({kind} tar)")
            for entry in reader:
                data = reader.data(entry) if entry.isreg() and not entry.sparse else None
                tree.apply(entry, data, layer.index)
        except (TreeError, BudgetError):
            raise
        except (TarError, EOFError, zlib.error, zstandard.ZstdError, OSError,
                ValueError) as exc:
            said = str(exc) if isinstance(exc, TarError) else f"{type(exc).__name__}: {exc}"
            raise SourceError(f"{what} ({kind} tar) is corrupt or truncated: {said}") from None
    return kind


def walk_rootfs(tree: Tree, root: Path, budget: Budget | None = None) -> None:
    """An unpacked root filesystem read as one layer (symlinks stay inside ``root``;
    only regular files are opened, so a FIFO cannot block the scan)."""
    budget = budget or unlimited()
    for info, full in _rootfs_entries(root):
        budget.check()
        keep = info.isreg() and wanted("/" + info.name) is not None
        data = _open_regular(full) if keep else None
        try:
            tree.apply(info, data, 0)
        finally:
            if data is not None:
                data.close()


def _open_regular(path: str) -> IO[bytes] | None:
    """``path`` opened for reading if it is still a regular file (never a FIFO that
    would block, never through a symlink); None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def _rootfs_entries(root: Path) -> Iterator[tuple[Entry, str]]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames) + sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            try:
                st = os.lstat(full)
            except OSError:
                continue
            # A name as a layer's would be: bytes that are not UTF-8 as \xNN.
            info = Entry(text(os.fsencode(rel)), b"6", 0)
            if stat.S_ISLNK(st.st_mode):
                info.type, info.linkname = b"2", text(os.fsencode(os.readlink(full)))
            elif stat.S_ISDIR(st.st_mode):
                info.type = b"5"
            elif stat.S_ISREG(st.st_mode):
                info.type, info.size = b"0", st.st_size
            yield info, full
