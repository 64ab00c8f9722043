"""A read-only view of a root filesystem, so that one diagnosis reads either one.

The probe reads the live filesystem of the pod it runs in (:class:`Live`);
``epguard scan`` reads an image's merged layers without unpacking them
(``webhook/scan/tree.py`` implements the same methods). Everything the static
diagnosis needs goes through these few calls: names in a directory, the text of a
small file, whether a path exists, and two facts about an ELF file (its dynamic
section, and the identifier strings in it).

Standard library only; Python 3.8 syntax (the probe runs in images we do not build).
"""

import fnmatch
import os
import posixpath
import re
import stat
import time

try:
    from . import elf
except ImportError:  # run as `python3 probe`: the directory itself is on sys.path
    import elf

# pybind11 registers every Python-visible name with a string literal, so a name a
# compiled module exports is a NUL-terminated identifier somewhere in its file.
_IDENT_RE = re.compile(rb"(?<![\x21-\x7e])([A-Za-z_][A-Za-z0-9_]{1,63})(?=\x00)")
# What the diagnosis reads of an image, each file whole or not at all (a cut file
# could hide a definition and make a name look missing). ``epguard scan`` reads the
# same files with these same limits (import them from here):
# - a text file (mooncake's loaders, METADATA, torch/version.py, ld.so.conf, _pg_jit
#   sources): the largest real one is ~100 KB;
MAX_TEXT_BYTES = 1 << 20
# - a compiled module searched for the names it defines: real pg_*/ep_* are a few MB.
MAX_STRINGS_BYTES = 64 << 20


class OutOfTime(Exception):
    """The reading of an image's files ran past its deadline (see :class:`Live`)."""


# - the distinct identifiers kept of one compiled module: a real pg_* has ~1,500 (0.9 MB);
#   64 MiB of distinct 4-letter ones took 2.2 GB as a set (found by a review helper),
#   and a MemoryError there turned a proven cause into none. Past it: unknown.
MAX_IDENTIFIERS = 200000


def identifier_strings(data):
    """Every NUL-terminated identifier in ``data`` (bytes), as a set of str; None past
    MAX_IDENTIFIERS distinct ones (what the module defines is then unknown)."""
    out = set()
    for m in _IDENT_RE.finditer(data):
        out.add(m.group(1).decode("ascii"))
        if len(out) > MAX_IDENTIFIERS:
            return None
    return out


def read_regular(path, limit):
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes; else
    None. Never blocks on a FIFO or a device (:func:`elf.open_regular`), never reads
    more than ``limit + 1`` bytes (a file may grow, or lie about its size, as /proc
    files do)."""
    f = elf.open_regular(path)
    if f is None:
        return None
    try:
        with f:
            if os.fstat(f.fileno()).st_size > limit:
                return None
            data = f.read(limit + 1)
    except OSError:
        return None
    return data if len(data) <= limit else None


class Live:
    """The filesystem this process sees, from ``/``.

    With ``deadline`` (a ``time.monotonic()`` value) every call after it raises
    :class:`OutOfTime`: the probe's reading of its own root ends with --timeout.
    """

    def __init__(self, deadline=None):
        self.deadline = deadline
        # The first path this user was refused (EACCES, EPERM): what it holds is unknown,
        # not absent, so the files prove nothing (static.decide). A pod chooses its user;
        # a folder the image keeps root-only must not make a package look empty.
        self.denied = None

    def _refused(self, path):
        if self.denied is None:
            self.denied = path

    def _stat(self, path):
        try:
            return os.stat(path)
        except PermissionError:
            self._refused(path)
        except (OSError, ValueError):
            pass
        return None

    def _unread(self, path):
        """After a read that gave nothing: was it refused to this user?"""
        if self._stat(path) is not None and not os.access(path, os.R_OK):
            self._refused(path)

    def _tick(self):
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise OutOfTime("the image's files were not read within the deadline")

    def listdir(self, path):
        self._tick()
        try:
            return os.listdir(path)
        except PermissionError:
            self._refused(path)
            raise

    def isdir(self, path):
        self._tick()
        st = self._stat(path)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def isfile(self, path):
        self._tick()
        st = self._stat(path)
        return st is not None and stat.S_ISREG(st.st_mode)

    def exists(self, path):
        self._tick()
        return self._stat(path) is not None

    def realpath(self, path):
        self._tick()
        return os.path.realpath(path)

    def read_text(self, path, limit=MAX_TEXT_BYTES):
        """The text of a regular file of at most ``limit`` bytes; None otherwise."""
        self._tick()
        data = read_regular(path, limit)
        if data is None:
            self._unread(path)
            return None
        return data.decode("utf-8", "replace")

    def dynamic(self, path):
        self._tick()
        found = elf.read_dynamic(path)
        if found is None:
            self._unread(path)
        return found

    def strings(self, path):
        """The identifiers in a regular file of at most MAX_STRINGS_BYTES; else None."""
        self._tick()
        data = read_regular(path, MAX_STRINGS_BYTES)
        if data is None:
            self._unread(path)
            return None
        return identifier_strings(data)

    def glob(self, pattern):
        self._tick()
        return glob_with(self, pattern)


def glob_with(fs, pattern):
    """``pattern`` with wildcards in its last component only (what ld.so.conf uses)."""
    head, tail = posixpath.split(pattern)
    if not any(c in tail for c in "*?["):
        return [pattern] if fs.exists(pattern) else []
    try:
        names = fs.listdir(head or "/")
    except OSError:
        return []
    return sorted(posixpath.join(head, n) for n in names if fnmatch.fnmatchcase(n, tail))


LIVE = Live()
