"""An image's merged file tree, built from its layers as they stream past.

Layers are applied bottom first, as a container runtime would: a later entry
replaces an earlier one, ``.wh.NAME`` deletes ``NAME`` and ``.wh..wh..opq`` hides
everything lower layers put in its directory. Every entry's name, type, size and
link target is kept (a few hundred bytes each; the largest worker images hold some
10^5 files); file *contents* only for the few paths the diagnosis reads
(:func:`wanted`), and of an ELF file only what ``probe/elf.py`` parses: its
DT_NEEDED / RPATH / RUNPATH, and, for mooncake's compiled modules, the identifier
strings that tell which names they define. Nothing is written to disk.

:class:`Tree` answers the read-only calls of ``probe/files.py`` so that the probe's
own static diagnosis runs on it unchanged.
"""

from __future__ import annotations

import io
import posixpath
import re
import struct
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from epguard.probe import elf, files, requirement
from epguard.webhook.engine.text import cut
from epguard.webhook.scan.tarstream import Budget, unlimited

# Limits on what one archive may make us hold, with the reason for each.
# 1 million entries: five times the largest SGLang images seen (~2e5 files).
MAX_ENTRIES = 1_000_000
# What the tree itself may hold: every entry is charged its node (measured: ~200
# bytes, a directory ~260), its name and its link target, and the charge is never
# given back (an entry deleted by a whiteout and made again is charged twice). A real
# worker image (48,000 entries) takes ~15 MB; 256 MiB is room for ~900,000 entries of
# ordinary names, and what 200,000 names of 4,000 bytes would take is refused.
MAX_TREE_BYTES = 256 << 20
ENTRY_BYTES = 256
# PATH_MAX on Linux; a longer name or link target cannot exist in a running container.
MAX_PATH = 4096
# What the kernel follows before ELOOP.
MAX_SYMLINKS = 40
# Contents kept in memory (texts, ELF headers): far above what a real image needs
# (~10 MB), low enough that an archive of huge "METADATA" files cannot exhaust memory.
MAX_KEPT_BYTES = 128 << 20
# A file read whole to parse its ELF headers; larger ones are read through a window.
WHOLE_ELF_BYTES = 32 << 20
# The window: the headers and, for ordinary libraries, the dynamic string table.
ELF_PREFIX_BYTES = 4 << 20
# A text the diagnosis reads: the probe's own limit (probe/files.py), so that the scan
# and the probe read the same first bytes of a loader, a METADATA or a source, and
# agree on what an oversized one says.
TEXT_BYTES = files.MAX_TEXT_BYTES
CHUNK = 1 << 20
# Notes (what could not be read): the first 100, each cut to 1,000 characters, then one
# line that counts the rest; 200,000 unreadable files cannot make a 216 MB report.
MAX_NOTES = 100
MAX_NOTE_CHARS = 1000
# Nodes visited to apply whiteouts and to resolve paths, over the whole scan: ~50x
# what a real image needs; the deadline is checked every CHECK_EVERY of them.
MAX_VISITS = 50_000_000
CHECK_EVERY = 1 << 16

OPAQUE = ".wh..wh..opq"
WHITEOUT = ".wh."

_DIST_RE = re.compile(r"^(torch|sglang|mooncake)[-_.a-z0-9]*\.(dist-info|egg-info)$", re.I)
_EXT_RE = re.compile(r"^(pg_|ep_|_ep\.)")
_SGLANG_SOURCES = frozenset("sglang/" + rel for rel in requirement.SOURCES)
# Libraries under these are torch's own (preloaded by `import torch`); their
# dependencies are torch's concern, and they are the largest files in the image.
_TORCH_TREES = ("/torch/", "/nvidia/", "/triton/")


class TreeError(Exception):
    """The layers are not a file tree we will read (too many entries, a bad name)."""


class Member(Protocol):
    """A layer entry: ``tarstream.Entry`` (or ``tarfile.TarInfo``, in tests)."""

    name: str
    size: int
    linkname: str

    def isreg(self) -> bool: ...
    def isdir(self) -> bool: ...
    def issym(self) -> bool: ...
    def islnk(self) -> bool: ...


@dataclass(slots=True)
class Node:
    kind: str  # "d" directory, "f" regular file, "l" symlink, "o" other (device, fifo)
    layer: int
    size: int = 0
    link: str | None = None
    children: dict[str, Node] | None = None
    text: str | None = None
    dynamic: Any = None  # probe.elf.Dynamic
    strings: frozenset[str] | None = None


@dataclass
class Kept:
    """What the diagnosis will read of one file, decided from its path alone."""

    text: bool = False
    elf: bool = False
    strings: bool = False
    # A text the probe reads whole or not at all, up to this many bytes (an SGLang
    # source: probe/requirement.py MAX_SOURCE_BYTES); 0: the first TEXT_BYTES, as for loaders.
    whole: int = 0


def wanted(path: str) -> Kept | None:
    """Which parts of the file at ``path`` (absolute, normalised) the diagnosis reads."""
    parent, base = posixpath.split(path)
    pbase = posixpath.basename(parent)
    if base in ("METADATA", "PKG-INFO") and _DIST_RE.match(pbase):
        return Kept(text=True)
    if base.endswith(".egg-info") and _DIST_RE.match(base):
        return Kept(text=True)
    if base == "version.py" and pbase == "torch":
        return Kept(text=True)
    if path == "/etc/ld.so.conf" or parent == "/etc/ld.so.conf.d":
        return Kept(text=True)
    if pbase == "mooncake":
        if base.endswith(".py"):
            return Kept(text=True)
        if ".so" in base:
            return Kept(elf=True, strings=bool(_EXT_RE.match(base)))
    if base == "pg_py.cpp" and parent.endswith("/mooncake/_pg_jit"):
        return Kept(text=True)
    for rel in _SGLANG_SOURCES:
        if path.endswith("/" + rel):
            return Kept(text=True, whole=requirement.MAX_SOURCE_BYTES)
    if base.startswith("lib") and ".so" in base and not any(t in path for t in _TORCH_TREES):
        return Kept(elf=True)
    return None


class _Bytes(io.BytesIO):
    """A file read whole, as the ELF reader sees it: a read or a seek past its end is
    cut at the end (a DT_STRSZ of 2^64-1 reads what there is, never overflows)."""

    def read(self, size: int | None = -1) -> bytes:
        n = len(self.getbuffer())
        return super().read(n if size is None or size < 0 or size > n else size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return super().seek(max(0, min(offset, len(self.getbuffer()) + 1)), whence)


class _Window(io.RawIOBase):
    """A forward-only stream seen as a seekable file: the first ``prefix`` bytes are
    kept, later ones can be reached only by reading on. ELF headers, the program
    headers and (for most libraries) the string table sit in the prefix; the dynamic
    section and (for auditwheel-patched ones) the string table lie further on. A read
    past the prefix returns at most ``prefix`` bytes, and the stream (the member's
    contents) ends where the member does."""

    def __init__(self, stream: IO[bytes], prefix: int) -> None:
        self._stream = stream
        self._limit = prefix
        self._head = stream.read(prefix)
        self._at = len(self._head)  # how far the stream has been read
        self._pos = 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0 or offset < 0:
            raise OSError("only absolute seeks")
        self._pos = offset
        return offset

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            raise OSError("unbounded read")
        size = min(size, self._limit)
        end = self._pos + size
        if end <= len(self._head):
            data = self._head[self._pos:end]
        elif self._pos >= self._at:
            while self._at < self._pos:
                skipped = self._stream.read(min(CHUNK, self._pos - self._at))
                if not skipped:
                    return b""
                self._at += len(skipped)
            data = self._stream.read(size)
            self._at += len(data)
        else:
            raise OSError("backward read outside the kept prefix")
        self._pos += len(data)
        return data


def _normal(name: str) -> str | None:
    """``./usr/lib/x`` -> ``/usr/lib/x``; None for a name that escapes the root."""
    parts = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            return None
        parts.append(part)
    return "/" + "/".join(parts)


def _str_bytes(s: str) -> int:
    """What a str of ``s`` costs: one byte a character if ASCII, up to four if not."""
    return 49 + (len(s) if s.isascii() else 4 * len(s))


@dataclass
class Tree:
    """The merged tree; also the probe's ``files`` interface over it."""

    root: Node = field(default_factory=lambda: Node("d", -1, children={}))
    entries: int = 0
    kept_bytes: int = 0
    tree_bytes: int = 0  # what the nodes, names and link targets are charged
    notes: list[str] = field(default_factory=list)
    dropped_notes: int = 0
    budget: Budget = field(default_factory=unlimited)
    visits: int = 0
    _cache: dict[tuple[str, bool], tuple[str, Node] | None] = field(default_factory=dict)

    # --- limits -----------------------------------------------------------------------

    def note(self, text: str) -> None:
        """Say what could not be read; past MAX_NOTES, only count it."""
        if len(self.notes) >= MAX_NOTES:
            self.dropped_notes += 1
            return
        self.notes.append(cut(text, MAX_NOTE_CHARS))

    def _charge(self, name: str, link: str | None = None, directory: bool = False) -> None:
        n = ENTRY_BYTES + (64 if directory else 0) + _str_bytes(name)
        if link:
            n += _str_bytes(link)
        self.tree_bytes += n
        if self.tree_bytes > MAX_TREE_BYTES:
            raise TreeError(f"the entries' names, link targets and nodes take more than "
                            f"{MAX_TREE_BYTES >> 20} MiB (after {self.entries} entries): "
                            "not an image we will read")

    def _visit(self, n: int = 1) -> None:
        before = self.visits
        self.visits += n
        if self.visits > MAX_VISITS:
            raise TreeError(f"more than {MAX_VISITS} nodes visited to merge layers and "
                            "resolve paths: not an image we will read")
        if before // CHECK_EVERY != self.visits // CHECK_EVERY:
            self.budget.check()

    # --- building ---------------------------------------------------------------------

    def _dir(self, path: str, layer: int) -> Node:
        node = self.root
        for part in path.split("/")[1:] if path != "/" else []:
            assert node.children is not None
            child = node.children.get(part)
            if child is None or child.kind != "d":
                self._charge(part, directory=True)
                child = Node("d", layer, children={})
                node.children[part] = child
                self._count()
            node = child
        return node

    def _count(self) -> None:
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise TreeError(f"more than {MAX_ENTRIES} entries: not an image we will read")

    def apply(self, member: Member, data: IO[bytes] | None, layer: int) -> None:
        """Apply one layer entry; ``data`` reads the file's contents (regular files)."""
        if self._cache:
            self._cache.clear()
        if len(member.name) > MAX_PATH:
            raise TreeError(f"an entry name longer than {MAX_PATH} bytes in layer {layer}")
        if len(member.linkname) > MAX_PATH:
            raise TreeError(f"a link target longer than {MAX_PATH} bytes in layer {layer}")
        path = _normal(member.name)
        if path is None:
            raise TreeError(f"entry {member.name[:200]!r} in layer {layer} leaves the root")
        if path == "/":
            return
        parent_path, base = posixpath.split(path)
        parent = self._dir(parent_path, layer)
        assert parent.children is not None
        if base == OPAQUE:
            self._hide_lower(parent, layer)
            return
        if base.startswith(WHITEOUT):
            # A whiteout deletes what *lower* layers made; entries of its own layer stay,
            # whatever their order in the tar (OCI image spec, "Whiteouts").
            name = base[len(WHITEOUT):]
            gone = parent.children.get(name)
            if gone is None:
                return
            if gone.kind == "d" and (gone.layer >= layer or self._has_layer(gone, layer)):
                self._hide_lower(gone, layer)
            elif gone.layer < layer:
                del parent.children[name]
            return
        old = parent.children.get(base)
        if member.isdir():
            if old is not None and old.kind == "d":
                old.layer = layer
                return
            self._charge(base, directory=True)
            parent.children[base] = Node("d", layer, children={})
        elif member.issym():
            self._charge(base, member.linkname)
            parent.children[base] = Node("l", layer, link=member.linkname)
        elif member.islnk():
            self._charge(base)
            target = _normal(member.linkname)
            src = self._lookup(target, follow=False) if target else None
            if src is None or src.kind != "f":
                parent.children[base] = Node("o", layer)
            else:
                parent.children[base] = Node("f", layer, size=src.size, text=src.text,
                                             dynamic=src.dynamic, strings=src.strings)
        elif member.isreg():
            self._charge(base)
            node = Node("f", layer, size=member.size)
            kept = wanted(path)
            if kept is not None and data is not None:
                self._keep(node, path, kept, data)
            elif kept is not None and getattr(member, "sparse", False):
                self.note(f"{path}: a sparse file in the layer; its contents are not read")
            parent.children[base] = node
        else:
            self._charge(base)
            parent.children[base] = Node("o", layer)
        if old is None:
            self._count()

    def _keep(self, node: Node, path: str, kept: Kept, data: IO[bytes]) -> None:
        if kept.text and kept.whole:
            # Read as probe/requirement.py reads an SGLang source: whole, or not at all.
            if node.size > kept.whole:
                self.note(f"{path}: {node.size} bytes, over {kept.whole}: not read, as the "
                          "probe does not read it")
                return
            whole = data.read(kept.whole).decode("utf-8", "replace")
            if self._budget(sys.getsizeof(whole), path):
                node.text = whole
            return
        if kept.text:
            if node.size > TEXT_BYTES:
                # The probe reads the first TEXT_BYTES of any file (probe/files.py): so
                # does the scan, and both judge the same bytes.
                self.note(f"{path}: {node.size} bytes; only the first {TEXT_BYTES} read, "
                          "as the probe reads it")
            text = data.read(TEXT_BYTES).decode("utf-8", "replace")
            if self._budget(sys.getsizeof(text), path):
                node.text = text
            return
        try:
            if node.size <= WHOLE_ELF_BYTES:
                raw = data.read(WHOLE_ELF_BYTES)
                node.dynamic = elf.read_dynamic_file(_Bytes(raw), path)
                found = files.identifier_strings(raw) if kept.strings else None
                if found is None and kept.strings:
                    self.note(f"{path}: more than {files.MAX_IDENTIFIERS} identifiers: "
                              "the names it defines are not read")
                elif found is not None:
                    names = frozenset(found)
                    if self._budget(sum(len(n) + 90 for n in names), path):
                        node.strings = names
            else:
                node.dynamic = elf.read_dynamic_file(_Window(data, ELF_PREFIX_BYTES), path)
                if node.dynamic is None:
                    self.note(f"{path}: dynamic section not readable in one pass")
        except (OverflowError, MemoryError, IndexError, KeyError, TypeError, ValueError,
                UnicodeError, struct.error) as exc:
            # The probe's ELF reader gave up on this file in a way it does not expect:
            # bad input, said as such (exit 2), never a traceback or a guess.
            raise TreeError(f"{path}: its ELF headers cannot be read "
                            f"({type(exc).__name__}: {str(exc)[:200]})") from None
        if node.dynamic is not None:
            d = node.dynamic
            if not self._budget(sum(len(s) + 50 for s in d.needed + d.rpath + d.runpath),
                                path):
                node.dynamic = None

    def _budget(self, n: int, path: str) -> bool:
        if self.kept_bytes + n > MAX_KEPT_BYTES:
            self.note(f"{path}: not read, over the {MAX_KEPT_BYTES >> 20} MiB kept")
            return False
        self.kept_bytes += n
        return True

    def _hide_lower(self, directory: Node, layer: int) -> None:
        """An opaque whiteout: what lower layers put in ``directory`` is gone; what this
        layer already added (tar order is free) stays. Iterative: a directory 2,000
        levels deep costs no recursion."""
        todo = [directory]
        while todo:
            d = todo.pop()
            assert d.children is not None
            self._visit(len(d.children) + 1)
            for name, child in list(d.children.items()):
                if child.layer >= layer:
                    if child.kind == "d" and child.children is not None:
                        todo.append(child)
                    continue
                if child.kind == "d" and child.children and self._has_layer(child, layer):
                    child.layer = layer
                    todo.append(child)
                else:
                    del d.children[name]

    def _has_layer(self, node: Node, layer: int) -> bool:
        """Whether anything under ``node`` comes from ``layer`` or above (iterative)."""
        todo = [node]
        while todo:
            n = todo.pop()
            children = n.children or {}
            self._visit(len(children) + 1)
            for child in children.values():
                if child.layer >= layer:
                    return True
                if child.kind == "d":
                    todo.append(child)
        return False

    # --- lookups ----------------------------------------------------------------------

    def _lookup(self, path: str | None, follow: bool = True) -> Node | None:
        resolved = self._resolve(path, follow) if path else None
        return resolved[1] if resolved else None

    def _resolve(self, path: str, follow: bool) -> tuple[str, Node] | None:
        """(canonical path, node) of ``path``, symlinks followed inside the image root
        (an absolute link target is the image's path, never this machine's). Linear in
        the components met (at most MAX_SYMLINKS targets of MAX_PATH bytes each), and
        remembered: the diagnosis asks for the same paths many times."""
        key = (path, follow)
        if key in self._cache:
            return self._cache[key]
        found = self._walk_path(path, follow)
        if len(self._cache) < 100_000:
            self._cache[key] = found
        return found

    def _walk_path(self, path: str, follow: bool) -> tuple[str, Node] | None:
        hops = 0
        todo = deque(p for p in path.split("/") if p)
        nodes: list[Node] = [self.root]
        parts: list[str] = []
        while todo:
            self._visit()
            part = todo.popleft()
            if part == ".":
                continue
            if part == "..":
                if parts:
                    parts.pop()
                    nodes.pop()
                continue
            node = nodes[-1]
            if node.kind != "d" or node.children is None:
                return None
            child = node.children.get(part)
            if child is None:
                return None
            if child.kind == "l" and (follow or todo):
                hops += 1
                if hops > MAX_SYMLINKS:
                    return None
                target = child.link or ""
                if target.startswith("/"):
                    nodes, parts = [self.root], []
                todo.extendleft(reversed([p for p in target.split("/") if p]))
                continue
            parts.append(part)
            nodes.append(child)
        return "/" + "/".join(parts), nodes[-1]

    def listdir(self, path: str) -> list[str]:
        node = self._lookup(path)
        if node is None or node.children is None:
            raise FileNotFoundError(path)
        return list(node.children)

    def isdir(self, path: str) -> bool:
        node = self._lookup(path)
        return node is not None and node.kind == "d"

    def isfile(self, path: str) -> bool:
        node = self._lookup(path)
        return node is not None and node.kind == "f"

    def exists(self, path: str) -> bool:
        return self._lookup(path) is not None

    def realpath(self, path: str) -> str:
        resolved = self._resolve(path, True)
        return resolved[0] if resolved else posixpath.normpath(path)

    def read_text(self, path: str, limit: int = TEXT_BYTES) -> str | None:
        node = self._lookup(path)
        return None if node is None or node.text is None else node.text[:limit]

    def dynamic(self, path: str) -> Any:
        node = self._lookup(path)
        return None if node is None else node.dynamic

    def strings(self, path: str) -> set[str] | None:
        node = self._lookup(path)
        return None if node is None or node.strings is None else set(node.strings)

    def glob(self, pattern: str) -> list[str]:
        result: list[str] = files.glob_with(self, pattern)
        return result
