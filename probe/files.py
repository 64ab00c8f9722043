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

try:
    from . import elf
except ImportError:  # run as `python3 probe`: the directory itself is on sys.path
    import elf

# pybind11 registers every Python-visible name with a string literal, so a name a
# compiled module exports is a NUL-terminated identifier somewhere in its file.
_IDENT_RE = re.compile(rb"(?<![\x21-\x7e])([A-Za-z_][A-Za-z0-9_]{1,63})(?=\x00)")
# The compiled modules searched for names are a few MB; anything far larger is not one.
MAX_STRINGS_BYTES = 64 << 20
MAX_TEXT_BYTES = 1 << 20


def identifier_strings(data):
    """Every NUL-terminated identifier in ``data`` (bytes), as a set of str."""
    return {m.decode("ascii") for m in _IDENT_RE.findall(data)}


class Live:
    """The filesystem this process sees, from ``/``."""

    def listdir(self, path):
        return os.listdir(path)

    def isdir(self, path):
        return os.path.isdir(path)

    def isfile(self, path):
        return os.path.isfile(path)

    def exists(self, path):
        return os.path.exists(path)

    def realpath(self, path):
        return os.path.realpath(path)

    def read_text(self, path, limit=MAX_TEXT_BYTES):
        """The file's text, at most ``limit`` bytes; None if it cannot be read."""
        try:
            with open(path, "rb") as f:
                return f.read(limit).decode("utf-8", "replace")
        except OSError:
            return None

    def dynamic(self, path):
        return elf.read_dynamic(path)

    def strings(self, path):
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_STRINGS_BYTES)
        except OSError:
            return None
        return identifier_strings(data)

    def glob(self, pattern):
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
