"""Shared-library dependencies of an ELF file, read with the standard library.

The dynamic loader stops at the first library it cannot open, so its error names
one of possibly several missing libraries (on a node without rdma-core and without
the NVIDIA driver, the cuda13 wheel fails on ``libibverbs.so.1`` although
``libcuda.so.1`` is missing too). To name every missing one we walk DT_NEEDED
ourselves and resolve each name the way ld.so does, closely enough: the object's
DT_RPATH/DT_RUNPATH (``$ORIGIN`` expanded), LD_LIBRARY_PATH, the directories
ld.so.cache is built from, and the libraries already mapped into a process that
imported torch (torch preloads its nvidia-* libraries by full path, so
``libcudart.so.13`` resolves there and nowhere on disk).
"""

import collections
import os
import posixpath
import stat
import struct

_DT_NEEDED = 1
_DT_STRTAB = 5
_DT_STRSZ = 10
_DT_RPATH = 15
_DT_RUNPATH = 29
_PT_LOAD = 1
_PT_DYNAMIC = 2

# Limits on what one ELF file may make the reader do, each with its reason. Anything
# past one makes the file unreadable (None): an unreadable file proves nothing, so the
# import decides, and no limit can turn into a false "missing" (a truncated RUNPATH
# could). Every step below is linear in these.
# The dynamic section: real ones are under 1 KiB (libtorch_cpu.so: ~600 bytes).
MAX_DYNAMIC_BYTES = 64 << 10
# DT_NEEDED / DT_RPATH / DT_RUNPATH entries: real libraries have a few dozen.
MAX_DEPENDENCIES = 1024
# One name or path list: PATH_MAX, the longest name open() accepts.
MAX_NAME_BYTES = 4096
# The stretch of the string table the names lie in (read once, forward, so a stream
# works): libtorch_cpu.so's needed names lie 5 MB into a 5 MB table, close together.
MAX_STRINGS_SPAN = 16 << 20
# ld.so.conf and its includes: a real one lists a few dozen directories.
MAX_CONF_FILES = 64
MAX_SEARCH_DIRS = 1024
# Existence checks in one dependency walk (each a stat): the real walk of the cuda13
# 0.3.13.post1 wheel's pg_2_13_0 + libmooncake_pg.so does 561. Past it the walk stops,
# incomplete.
MAX_LOOKUPS = 100000

_DEFAULT_DIRS = (
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
)


class Malformed(ValueError):
    """An ELF file past one of the limits above, or inconsistent with itself."""


def open_regular(path):
    """A binary file object for ``path`` if it is a regular file; else None.

    Opened non-blocking (a FIFO or a device in an image must not hang the probe:
    open() of a FIFO with no writer waits forever) and checked with fstat on the
    descriptor itself, so what is read is what was checked.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    flags |= getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except (OSError, ValueError):  # ValueError: a NUL in the name
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return os.fdopen(fd, "rb")
    except OSError:
        os.close(fd)
        return None


class Dynamic:
    """The parts of one ELF file's dynamic section that name its dependencies."""

    def __init__(self, path, needed, rpath, runpath, elf_class):
        self.path = path
        self.needed = needed
        self.rpath = rpath
        self.runpath = runpath
        self.elf_class = elf_class


def read_dynamic(path):
    """Parse DT_NEEDED / DT_RPATH / DT_RUNPATH of ``path``; None if not a readable ELF.

    Reads only the headers, the dynamic section and the strings it points at:
    libmooncake_pg.so is 160 MB, and a cold node would read all of it otherwise.
    Only a regular file is opened (see :func:`open_regular`).
    """
    f = open_regular(path)
    if f is None:
        return None
    with f:
        return read_dynamic_file(f, path)


def read_dynamic_file(f, path):
    """:func:`read_dynamic` of an open binary file (any object with seek and read)."""
    try:
        return _read_dynamic(f, path)
    except (OSError, struct.error, ValueError, OverflowError, MemoryError):
        return None


def _read_at(f, offset, size):
    if offset < 0 or size < 0:
        raise Malformed("negative offset or size")
    f.seek(offset)
    return f.read(size)


def _read_dynamic(f, path):
    ident = f.read(64)
    if len(ident) < 52 or ident[:4] != b"\x7fELF":
        return None
    elf_class = ident[4]
    end = "<" if ident[5] == 1 else ">"
    if elf_class == 2:
        phoff, = struct.unpack_from(end + "Q", ident, 32)
        phentsize, phnum = struct.unpack_from(end + "HH", ident, 54)
        ph_fmt, dyn_fmt = end + "IIQQQQQQ", end + "qQ"
    elif elf_class == 1:
        phoff, = struct.unpack_from(end + "I", ident, 28)
        phentsize, phnum = struct.unpack_from(end + "HH", ident, 42)
        ph_fmt, dyn_fmt = end + "IIIIIIII", end + "iI"
    else:
        return None
    # ld.so refuses any other e_phentsize; with it the table is at most 64 Ki x 56 bytes.
    if phentsize != struct.calcsize(ph_fmt):
        return None
    table = _read_at(f, phoff, phentsize * phnum)
    loads, dynamic = [], None
    for off in range(0, min(phnum * phentsize, len(table) - phentsize + 1), phentsize):
        fields = struct.unpack_from(ph_fmt, table, off)
        if elf_class == 2:
            p_type, p_offset, p_vaddr, p_filesz = fields[0], fields[2], fields[3], fields[5]
        else:
            p_type, p_offset, p_vaddr, p_filesz = fields[0], fields[1], fields[2], fields[4]
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC and dynamic is None:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return Dynamic(path, [], [], [], elf_class)
    if dynamic[1] > MAX_DYNAMIC_BYTES:
        return None

    raw = _read_at(f, dynamic[0], dynamic[1])
    size = struct.calcsize(dyn_fmt)
    strtab_addr = strsz = None
    refs = []  # (tag, offset into the string table), in order
    for off in range(0, len(raw) - size + 1, size):
        tag, val = struct.unpack_from(dyn_fmt, raw, off)
        if tag == 0:
            break
        if tag == _DT_STRTAB and strtab_addr is None:
            strtab_addr = val
        elif tag == _DT_STRSZ and strsz is None:
            strsz = val
        elif tag in (_DT_NEEDED, _DT_RPATH, _DT_RUNPATH):
            refs.append((tag, val))
            if len(refs) > MAX_DEPENDENCIES:
                return None
    if strtab_addr is None or not refs:
        return Dynamic(path, [], [], [], elf_class)
    # DT_STRTAB is a virtual address; map it back to a file offset (first load wins).
    strtab = None
    for vaddr, foff, fsz in loads:
        if vaddr <= strtab_addr < vaddr + fsz:
            strtab = strtab_addr - vaddr + foff
            break
    if strtab is None:
        return Dynamic(path, [], [], [], elf_class)
    # One forward read of the stretch that holds every name, each cut at its NUL.
    first = min(v for _, v in refs)
    stop = max(v for _, v in refs) + MAX_NAME_BYTES + 1
    if strsz:
        if max(v for _, v in refs) >= strsz:
            return None
        stop = min(stop, strsz)
    if stop - first > MAX_STRINGS_SPAN:
        return None
    strings = _read_at(f, strtab + first, stop - first)

    def string(at):
        at -= first
        nul = strings.find(b"\x00", at, at + MAX_NAME_BYTES + 1)
        if nul < 0:
            raise Malformed(f"a name without its NUL within {MAX_NAME_BYTES} bytes")
        return strings[at:nul].decode("utf-8", "replace")

    needed, rpath, runpath = [], [], []
    for tag, val in refs:
        if tag == _DT_NEEDED:
            needed.append(string(val))
        elif tag == _DT_RPATH:
            rpath.extend(p for p in string(val).split(":") if p)
        else:
            runpath.extend(p for p in string(val).split(":") if p)
    return Dynamic(path, needed, rpath, runpath, elf_class)


def search_list(value, limit=MAX_SEARCH_DIRS):
    """The entries of a ``:``-separated search path, empty ones and repeats dropped
    (the first occurrence is the one a search meets), in one pass; and whether more
    than ``limit`` distinct entries were cut."""
    out, seen = [], set()
    for d in (value or "").split(":"):
        if d and d not in seen:
            if len(out) >= limit:
                return out, True
            seen.add(d)
            out.append(d)
    return out, False


def _expand(entry, origin):
    return entry.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)


def _ld_so_conf_dirs(fs, conf="/etc/ld.so.conf", seen=None):
    """Directories listed in ld.so.conf (with its includes): what ld.so.cache covers.

    At most MAX_CONF_FILES files, each read whole only up to files.MAX_TEXT_BYTES."""
    seen = set() if seen is None else seen
    if conf in seen or len(seen) >= MAX_CONF_FILES:
        return []
    seen.add(conf)
    dirs = []
    text = fs.read_text(conf)
    if text is None:
        return dirs
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("include"):
            pattern = line.split(None, 1)[1] if len(line.split(None, 1)) > 1 else ""
            if not posixpath.isabs(pattern):
                pattern = posixpath.join(posixpath.dirname(conf), pattern)
            for inc in fs.glob(pattern)[:MAX_CONF_FILES]:
                dirs.extend(_ld_so_conf_dirs(fs, inc, seen))
        else:
            dirs.append(line)
    return dirs


def _live():
    try:
        from . import files
    except ImportError:  # run as `python3 probe`
        import files
    return files.LIVE


class SearchPath(list):
    """Directories in search order; ``cut`` when the limit left some out (then a
    library "not found" may be in one of those: the walk proves no absence)."""

    cut = False


def system_dirs(fs=None, environ=None):
    """Search path after RPATH/RUNPATH: LD_LIBRARY_PATH, ld.so.conf dirs, defaults.

    Linear in their length; at most MAX_SEARCH_DIRS distinct directories."""
    fs = fs or _live()
    environ = os.environ if environ is None else environ
    joined = ":".join([environ.get("LD_LIBRARY_PATH", "")] + _ld_so_conf_dirs(fs)
                      + list(_DEFAULT_DIRS))
    dirs, cut = search_list(joined)
    out = SearchPath(dirs)
    out.cut = cut
    return out


class Walk(list):
    """``[(library, needed_by_basename)]``; ``complete`` is False when a limit (files,
    lookups, a cut search path) stopped the walk early: absent names are then not
    proven absent. ``found``: the names it found a file for (name -> path)."""

    complete = True

    def __init__(self):
        super().__init__()
        self.found = {}


def missing_libraries(roots, loaded=(), search=None, max_files=200, fs=None):
    """Every DT_NEEDED name reachable from ``roots`` that the loader could not find.

    ``loaded`` are paths already mapped in the importing process (their basenames
    satisfy a DT_NEEDED of the same name, as ld.so matches on soname). Returns a
    :class:`Walk`, ``[(library, needed_by_basename)]`` in first-seen order.

    Bounded: at most ``max_files`` objects and MAX_LOOKUPS existence checks; a name is
    looked up in the shared search path once per walk, whoever needs it.
    """
    fs = fs or _live()
    search = system_dirs(fs) if search is None else search
    out = Walk()
    if getattr(search, "cut", False):
        out.complete = False
    loaded_names = {posixpath.basename(p) for p in loaded}
    seen_missing = set()
    visited = set()
    in_search = {}  # name -> path found in ``search``, or None
    lookups = [0]

    def exists(cand):
        lookups[0] += 1
        return fs.exists(cand)

    def find(name, dirs):
        for d in dirs:
            if lookups[0] >= MAX_LOOKUPS:
                raise _Exhausted()
            cand = posixpath.join(d, name)
            if exists(cand):
                return cand
        return None

    # (path, inherited DT_RPATH dirs of the objects that loaded it)
    queue = collections.deque((fs.realpath(r), []) for r in roots)
    try:
        while queue:
            path, inherited = queue.popleft()
            if path in visited:
                continue
            if len(visited) >= max_files:
                out.complete = False
                break
            visited.add(path)
            dyn = fs.dynamic(path)
            if dyn is None:
                continue
            origin = posixpath.dirname(path)
            own_rpath = [_expand(e, origin) for e in dyn.rpath]
            own_runpath = [_expand(e, origin) for e in dyn.runpath]
            # ld.so ignores DT_RPATH when the object has DT_RUNPATH, and RUNPATH does
            # not propagate to the object's dependencies.
            if own_runpath:
                first, passed_down = [], []
                after_env = own_runpath
            else:
                first = own_rpath + inherited
                if len(first) > MAX_SEARCH_DIRS:
                    first = first[:MAX_SEARCH_DIRS]
                    out.complete = False
                passed_down = first
                after_env = own_runpath
            for name in dyn.needed:
                if name in loaded_names:
                    continue
                if "/" in name:
                    found = name if exists(name) else None
                else:
                    # The object's own RPATH (or RUNPATH) first, then the shared
                    # search path, looked up once per name for the whole walk.
                    own = first + after_env
                    if len(own) > MAX_SEARCH_DIRS:
                        own = own[:MAX_SEARCH_DIRS]
                        out.complete = False
                    found = find(name, own)
                    if found is None:
                        if name not in in_search:
                            in_search[name] = find(name, search)
                        found = in_search[name]
                if found is None:
                    if name not in seen_missing:
                        seen_missing.add(name)
                        out.append((name, posixpath.basename(path)))
                    continue
                out.found.setdefault(name, found)
                queue.append((fs.realpath(found), passed_down))
    except _Exhausted:
        out.complete = False
    return out


class _Exhausted(Exception):
    pass
