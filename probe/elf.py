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

import os
import posixpath
import struct

_DT_NEEDED = 1
_DT_STRTAB = 5
_DT_STRSZ = 10
_DT_RPATH = 15
_DT_RUNPATH = 29
_PT_LOAD = 1
_PT_DYNAMIC = 2

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
    """
    try:
        with open(path, "rb") as f:
            return _read_dynamic(f, path)
    except (OSError, struct.error):
        return None


def read_dynamic_file(f, path):
    """:func:`read_dynamic` of an open binary file (any object with seek and read)."""
    try:
        return _read_dynamic(f, path)
    except (OSError, struct.error, ValueError):
        return None


def _read_at(f, offset, size):
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
    table = _read_at(f, phoff, phentsize * phnum)
    loads, dynamic = [], None
    for i in range(phnum):
        off = i * phentsize
        if off + struct.calcsize(ph_fmt) > len(table):
            break
        fields = struct.unpack_from(ph_fmt, table, off)
        if elf_class == 2:
            p_type, p_offset, p_vaddr, p_filesz = fields[0], fields[2], fields[3], fields[5]
        else:
            p_type, p_offset, p_vaddr, p_filesz = fields[0], fields[1], fields[2], fields[4]
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return Dynamic(path, [], [], [], elf_class)

    raw = _read_at(f, dynamic[0], dynamic[1])
    entries = []
    size = struct.calcsize(dyn_fmt)
    off = 0
    while off + size <= len(raw):
        tag, val = struct.unpack_from(dyn_fmt, raw, off)
        if tag == 0:
            break
        entries.append((tag, val))
        off += size

    strtab = strsz = None
    for tag, val in entries:
        if tag == _DT_STRTAB:
            # DT_STRTAB is a virtual address; map it back to a file offset.
            for vaddr, foff, fsz in loads:
                if vaddr <= val < vaddr + fsz:
                    strtab = val - vaddr + foff
        elif tag == _DT_STRSZ:
            strsz = val
    if strtab is None:
        return Dynamic(path, [], [], [], elf_class)
    strings = _read_at(f, strtab, strsz if strsz else 1 << 20)

    def string(at):
        stop = strings.find(b"\x00", at)
        return strings[at:stop if stop >= 0 else None].decode("utf-8", "replace")

    needed, rpath, runpath = [], [], []
    for tag, val in entries:
        if tag == _DT_NEEDED:
            needed.append(string(val))
        elif tag == _DT_RPATH:
            rpath.extend(p for p in string(val).split(":") if p)
        elif tag == _DT_RUNPATH:
            runpath.extend(p for p in string(val).split(":") if p)
    return Dynamic(path, needed, rpath, runpath, elf_class)


def _expand(entry, origin):
    return entry.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)


def _ld_so_conf_dirs(fs, conf="/etc/ld.so.conf", seen=None):
    """Directories listed in ld.so.conf (with its includes): what ld.so.cache covers."""
    seen = set() if seen is None else seen
    if conf in seen or len(seen) > 64:
        return []
    seen.add(conf)
    dirs = []
    text = fs.read_text(conf)
    if text is None:
        return dirs
    lines = text.splitlines()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("include"):
            pattern = line.split(None, 1)[1] if len(line.split(None, 1)) > 1 else ""
            if not posixpath.isabs(pattern):
                pattern = posixpath.join(posixpath.dirname(conf), pattern)
            for inc in fs.glob(pattern):
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


def system_dirs(fs=None, environ=None):
    """Search path after RPATH/RUNPATH: LD_LIBRARY_PATH, ld.so.conf dirs, defaults."""
    fs = fs or _live()
    environ = os.environ if environ is None else environ
    env = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    out = []
    for d in env + _ld_so_conf_dirs(fs) + list(_DEFAULT_DIRS):
        if d not in out:
            out.append(d)
    return out


def missing_libraries(roots, loaded=(), search=None, max_files=200, fs=None):
    """Every DT_NEEDED name reachable from ``roots`` that the loader could not find.

    ``loaded`` are paths already mapped in the importing process (their basenames
    satisfy a DT_NEEDED of the same name, as ld.so matches on soname). Returns
    ``[(library, needed_by_basename)]`` in first-seen order.
    """
    fs = fs or _live()
    search = system_dirs(fs) if search is None else search
    loaded_names = {posixpath.basename(p) for p in loaded}
    missing = []
    seen_missing = set()
    visited = set()
    # (path, inherited DT_RPATH dirs of the objects that loaded it)
    queue = [(fs.realpath(r), []) for r in roots]
    while queue and len(visited) < max_files:
        path, inherited = queue.pop(0)
        if path in visited:
            continue
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
            passed_down = first
            after_env = []
        for name in dyn.needed:
            if name in loaded_names:
                continue
            if "/" in name:
                found = name if fs.exists(name) else None
            else:
                found = None
                for d in first + after_env + search:
                    cand = posixpath.join(d, name)
                    if fs.exists(cand):
                        found = cand
                        break
            if found is None:
                if name not in seen_missing:
                    seen_missing.add(name)
                    missing.append((name, posixpath.basename(path)))
                continue
            queue.append((fs.realpath(found), passed_down))
    return missing
