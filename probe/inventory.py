"""What is installed, read from files only (no import of torch or mooncake here).

Mooncake ships as several distributions that all install the same ``mooncake``
package (``mooncake-transfer-engine`` for CUDA 12, ``-cuda13``, ``-non-cuda``, and
whatever a source build calls itself), so every ``mooncake*`` dist-info on sys.path
is listed. The package directory tells which compiled ``pg_<torch>`` / ``ep_<torch>``
extensions exist for this interpreter, or whether it is 0.3.14's JIT loader.
"""

import importlib.machinery
import importlib.util
import os
import posixpath
import re
import stat
import sys

try:
    from . import elf, files
except ImportError:  # run as `python3 probe`: the directory itself is on sys.path
    import elf
    import files

_EXT_RE = re.compile(r"^(pg|ep)_(\d+(?:_\d+)*)(\..*)$")


def _read_metadata(path, fs=None):
    name = version = None
    # Read whole (a regular file of at most files.MAX_TEXT_BYTES, as the scan reads
    # it); the headers come first.
    text = (fs or files.LIVE).read_text(path)
    for line in (text or "").splitlines():
        if not line.strip():
            break
        if line.startswith("Name:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Version:"):
            version = line.split(":", 1)[1].strip()
    return name, version


def _canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def mooncake_distributions(path=None, fs=None):
    """[(dist name, version)] for every mooncake* distribution, first on sys.path wins."""
    fs = fs or files.LIVE
    out, seen = [], set()
    for entry in path if path is not None else sys.path:
        try:
            names = fs.listdir(entry or ".")
        except OSError:
            continue
        for n in sorted(names):
            low = n.lower()
            if not low.startswith("mooncake"):
                continue
            if low.endswith(".dist-info"):
                meta = posixpath.join(entry or ".", n, "METADATA")
            elif low.endswith(".egg-info"):
                meta = posixpath.join(entry or ".", n)
                if fs.isdir(meta):
                    meta = posixpath.join(meta, "PKG-INFO")
            else:
                continue
            name, version = _read_metadata(meta, fs)
            if name and _canonical(name) not in seen:
                seen.add(_canonical(name))
                out.append((_canonical(name), version or "unknown"))
    return out


class Package:
    """The ``mooncake`` package directory as this interpreter would load it."""

    def __init__(self):
        self.dirs = []
        self.extensions = {"pg": [], "ep": []}  # torch versions, e.g. "2.13.0"
        self.other_abi = {"pg": [], "ep": []}  # built for another Python
        self.files = {}  # "pg_2_13_0" -> path
        self.jit = False  # 0.3.14: mooncake/_pg_jit sources, no pg_* modules
        self.ep_core = []  # 0.3.13+: paths of the torch-independent mooncake._ep
        self.libs = []  # libmooncake_pg.so and friends

    @property
    def found(self):
        return bool(self.dirs)


def _torch_key(version):
    return tuple(int(p) for p in version.split("."))


def package_dirs(name, path, fs):
    """Where ``import name`` would find the package on ``path``: the first entry with a
    regular package wins; namespace portions count only when there is none. A regular
    package whose ``__init__`` calls ``pkgutil.extend_path`` (mooncake's does) also
    takes the ``name`` folders of every later entry, as that call does: a module in one
    of them is found (read from the first folder alone, "has no mooncake.pg", scope
    image, was said of an image that works: found by a review helper)."""
    portions = []
    for i, entry in enumerate(path):
        d = posixpath.join(entry or ".", name)
        if not fs.isdir(d):
            continue
        init = posixpath.join(d, "__init__.py")
        if fs.isfile(init):
            try:
                text = fs.read_text(init)
            except (OSError, ValueError):
                text = None
            if text is None or "extend_path" not in text:
                return [d]
            # extend_path adds every other folder of that name on sys.path, in order:
            # the namespace portions before it too.
            later = (posixpath.join(e or ".", name) for e in path[i + 1:])
            return [d] + portions + [x for x in later if x != d and fs.isdir(x)]
        portions.append(d)
    return portions


def mooncake_package(fs=None, path=None, suffixes=None):
    """The package as ``import mooncake`` would find it: by importlib for this process,
    or, with ``fs``/``path``, in another root (an image's files)."""
    pkg = Package()
    if fs is None:
        try:
            spec = importlib.util.find_spec("mooncake")
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return pkg
        pkg.dirs = list(spec.submodule_search_locations or [])
        fs = files.LIVE
    else:
        pkg.dirs = package_dirs("mooncake", path, fs)
    if suffixes is None:
        suffixes = importlib.machinery.EXTENSION_SUFFIXES
    for d in pkg.dirs:
        try:
            names = sorted(fs.listdir(d))
        except OSError:
            continue
        for n in names:
            m = _EXT_RE.match(n)
            if m:
                kind, ver = m.group(1), m.group(2).replace("_", ".")
                bucket = pkg.extensions if m.group(3) in suffixes else pkg.other_abi
                if ver not in bucket[kind]:
                    bucket[kind].append(ver)
                if m.group(3) in suffixes:
                    pkg.files.setdefault(f"{kind}_{m.group(2)}", posixpath.join(d, n))
            elif n == "_pg_jit" and fs.isdir(posixpath.join(d, n)):
                pkg.jit = True
            elif n.startswith("_ep.") and n.endswith(".so"):
                pkg.ep_core.append(posixpath.join(d, n))
            elif n.startswith("libmooncake") and n.endswith(".so"):
                pkg.libs.append(posixpath.join(d, n))
    for kind in ("pg", "ep"):
        for bucket in (pkg.extensions, pkg.other_abi):
            bucket[kind].sort(key=_torch_key)
    return pkg


def torch_tag(version):
    """``2.13.0+cu130`` -> ``2.13.0`` (what mooncake's loaders do with the version)."""
    m = re.match(r"\d+(?:\.\d+)*", version or "")
    return m.group(0) if m else None


def cuda_major(cuda_version):
    m = re.match(r"(\d+)", cuda_version or "")
    return int(m.group(1)) if m else None


def dist_version(dist, path=None, fs=None):
    """Version of an installed distribution, from its dist-info, first on sys.path.

    The same answer as importlib.metadata.version for ordinary installs, without
    importing importlib.metadata (tens of ms, spent while torch loads in the child).
    """
    fs = fs or files.LIVE
    want = _canonical(dist)
    for entry in path if path is not None else sys.path:
        try:
            names = fs.listdir(entry or ".")
        except OSError:
            continue
        for n in names:
            if not n.endswith((".dist-info", ".egg-info")):
                continue
            stem = n.rsplit(".", 1)[0]
            if _canonical(stem.split("-", 1)[0]) != want:
                continue
            meta = posixpath.join(entry or ".", n)
            if n.endswith(".dist-info"):
                meta = posixpath.join(meta, "METADATA")
            elif fs.isdir(meta):
                meta = posixpath.join(meta, "PKG-INFO")
            name, version = _read_metadata(meta, fs)
            if name and _canonical(name) == want and version:
                return version
    return None


def which(name, fs, environ):
    """``shutil.which`` in another root: the first PATH entry holding ``name``.

    Repeated entries are looked at once, and at most elf.MAX_SEARCH_DIRS of them: what
    this answers (ninja, nvcc for the JIT build) never proves a cause on its own."""
    value = environ.get("PATH") or os.defpath
    dirs, _ = elf.search_list(":".join(d or "." for d in value.split(":")))
    for d in dirs:
        cand = posixpath.join(d, name)
        if fs.isfile(cand):
            return cand
    return None


# What the JIT build needs from the image's files (the rest, a GPU or an architecture
# list, is the node's or the pod's).
JIT_NINJA = "ninja"
JIT_NVCC = "nvcc (CUDA toolkit)"
JIT_GPU = "a visible GPU or TORCH_CUDA_ARCH_LIST"
JIT_FILES = (JIT_NINJA, JIT_NVCC)


# Where 0.3.14 keeps (and first looks for) the adapter it built: MOONCAKE_PG_JIT_DIR,
# else ``$HOME/.cache/mooncake/pg_jit``; a build is ``<root>/<key>/_mooncake_pg_jit_*.so``.
JIT_CACHE_UNDER_HOME = (".cache", "mooncake", "pg_jit")
JIT_ADAPTER_PREFIX = "_mooncake_pg_jit_"
# /etc/passwd read for the users' HOMEs: its first MAX_PASSWD_BYTES, MAX_HOMES homes.
MAX_PASSWD_BYTES = 1 << 20
MAX_HOMES = 256
# Entries of a cache folder looked at (keys, then files in each): one per torch build.
MAX_CACHE_ENTRIES = 256


def user_homes(environs, fs=None):
    """(every HOME a user of the image may have, the environments' first; why that list
    may be incomplete, or None): each environment's HOME, ``/`` (a uid /etc/passwd does
    not name: the runtime's HOME then), root's and every HOME ``/etc/passwd`` names, up
    to MAX_HOMES users. A pod runs as a user of its choice (``runAsUser``), and its HOME
    follows. Relative HOMEs are left out (and make the list undecided)."""
    fs = fs or files.Live()  # its own: ``denied`` says what this call was refused
    homes = [e.get("HOME") for e in environs] + ["/", "/root"]
    text = fs.read_text("/etc/passwd", MAX_PASSWD_BYTES)
    lines = (text or "").splitlines()
    undecided = None
    # There, or refused on the way (a link through a folder this user may not search).
    if text is None and (fs.exists("/etc/passwd") or getattr(fs, "denied", None)):
        undecided = "/etc/passwd could not be read whole"
    elif len(lines) > MAX_HOMES:
        undecided = f"more than {MAX_HOMES} users in /etc/passwd"
    homes += [home for _, home in _passwd_entries(lines[:MAX_HOMES])]
    for home in homes:
        if home and not posixpath.isabs(home):
            undecided = undecided or f"HOME {home!r} is relative"
    out = []
    for home in homes:
        if home and posixpath.isabs(home) and home not in out:
            out.append(home)
    return out, undecided


def passwd_home(uid, fs=None):
    """The HOME /etc/passwd gives ``uid`` (None: it names no such user, or cannot be
    read whole)."""
    fs = fs or files.Live()
    text = fs.read_text("/etc/passwd", MAX_PASSWD_BYTES)
    return next((home or None for u, home in _passwd_entries((text or "").splitlines())
                 if u == str(uid)), None)


def _passwd_entries(lines):
    """(uid, HOME) of each well-formed /etc/passwd line."""
    for line in lines:
        fields = line.split(":")
        if len(fields) >= 7:
            yield fields[2], fields[5]


def jit_cache_roots(environs, fs=None):
    """(every folder 0.3.14 would look for a prebuilt adapter in, for any user of the
    image; why no list of folders can say it, or None).

    The folders: ``MOONCAKE_PG_JIT_DIR`` of each environment given (the image's first),
    and the default cache under each environment's HOME, ``/`` (a uid /etc/passwd does
    not name), root's and every HOME ``/etc/passwd`` names. A pod runs as a user of its
    choice (``runAsUser``), and its HOME follows: an adapter one user's mooncake finds is
    no absence in the image for another's. mooncake expands ``~`` in the variable
    (``Path.expanduser``), so ``~/x`` is looked for under every HOME. Undecided: a
    relative value or HOME (the pod's ``workingDir`` decides), ``~name``, and a list cut
    at MAX_HOMES (a place past it may hold the adapter)."""
    homes, undecided = user_homes(environs, fs)
    roots = []
    for value in (e.get("MOONCAKE_PG_JIT_DIR") for e in environs):
        if not value:
            continue
        if value == "~" or value.startswith("~/"):
            # As expanduser: HOME, then the rest after every leading slash.
            roots += [posixpath.join(h, value[1:].lstrip("/")) for h in homes]
        elif posixpath.isabs(value):
            roots.append(value)
        else:
            undecided = undecided or f"MOONCAKE_PG_JIT_DIR {value!r} is relative or ~name"
    roots += [posixpath.join(h, *JIT_CACHE_UNDER_HOME) for h in homes]
    out, seen = [], set()
    for root in map(posixpath.normpath, roots):
        if root not in seen:
            seen.add(root)
            out.append(root)
    if len(out) > MAX_HOMES:
        undecided = undecided or f"more than {MAX_HOMES} places to look"
    return out[:MAX_HOMES], undecided


def prebuilt_adapter(roots):
    """(the first adapter 0.3.14 built under ``roots``, the first place there this user
    may not list or read, or whose entries were not all looked at): an adapter is
    ``<root>/<key>/_mooncake_pg_jit_*.so``, an ELF file as mooncake checks it. Either is
    None when there is none. A folder or an adapter hidden from this user (an image built
    with a tight umask) hides it from this pod's mooncake too, not from another user's.
    Looks at MAX_CACHE_ENTRIES entries of each folder (past them: hidden) and reads 4
    bytes of a candidate, non-blocking."""
    hidden = None

    def names(folder):
        nonlocal hidden
        out = []
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if len(out) == MAX_CACHE_ENTRIES:
                        hidden = hidden or folder  # not all looked at
                        break
                    out.append(entry.name)
        except PermissionError:
            hidden = hidden or folder
        except (OSError, ValueError):
            if out:  # failed part-way: what was not listed may hold it
                hidden = hidden or folder
        return sorted(out)

    def kind(path):
        """os.stat's mode of ``path`` (through links); None when it is not there; a
        folder this user may not search on the way makes it hidden."""
        nonlocal hidden
        try:
            return os.stat(path).st_mode
        except PermissionError:
            hidden = hidden or path
        except (OSError, ValueError):
            pass
        return None

    for root in roots:
        for key in names(root):
            folder = posixpath.join(root, key)
            mode = kind(folder)
            if mode is None or not stat.S_ISDIR(mode):
                continue
            if not os.access(folder, os.R_OK | os.X_OK):
                hidden = hidden or folder  # listed, not searched: its files are hidden
                continue
            for name in names(folder):
                if not (name.startswith(JIT_ADAPTER_PREFIX) and name.endswith(".so")):
                    continue
                path = posixpath.join(folder, name)
                f = elf.open_regular(path)
                if f is None:
                    mode = kind(path)
                    if mode is not None and stat.S_ISREG(mode) and not os.access(path, os.R_OK):
                        hidden = hidden or path
                    continue
                with f:
                    if f.read(4) == b"\x7fELF":
                        return path, hidden
    return None, hidden


def jit_prerequisites(cuda_available, fs=None, environ=None):
    """What 0.3.14's JIT loader needs to build its torch adapter, without building it.

    Mirrors mooncake/pg.py 0.3.14: ninja on PATH, ``CUDA_HOME/bin/nvcc`` (torch
    looks at CUDA_HOME, CUDA_PATH, then nvcc on PATH, then /usr/local/cuda), and a
    visible GPU or TORCH_CUDA_ARCH_LIST. Only whether variables are set is read.
    ``cuda_available=None`` (an image read from its files) leaves the GPU out: only a
    GPU node can say.
    """
    fs = fs or files.LIVE
    environ = os.environ if environ is None else environ
    missing = []
    if which("ninja", fs, environ) is None:
        missing.append(JIT_NINJA)
    home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if not home:
        nvcc = which("nvcc", fs, environ)
        home = posixpath.dirname(posixpath.dirname(nvcc)) if nvcc else "/usr/local/cuda"
    if not fs.isfile(posixpath.join(home, "bin", "nvcc")):
        missing.append(JIT_NVCC)
    if cuda_available is False and not environ.get("TORCH_CUDA_ARCH_LIST"):
        missing.append(JIT_GPU)
    return missing
