"""The diagnosis from an image's files alone: nothing is imported or executed.

Used twice: ``epguard scan`` reads an image archive through its own view of the
merged layers, and the init-container probe reads its own root first, so that a
cause the files prove ends the probe before the slow ``import torch``.

How it stays one implementation with the probe's: what the files say is turned into
the step reports the child *would* have sent (torch's version from torch/version.py,
the error mooncake's loader raises when ``pg_<torch>`` is absent, the loader's
complaint about the first library ld.so cannot find, the names a module lacks), and
:func:`diagnosis.diagnose` words each one. Those reports carry ``static: true`` so
the evidence says they were read from files, not observed.

What files prove beyond doubt (``Finding.proven``): no torch or no mooncake, a loader
module missing, no ``pg_<torch>`` / ``ep_<torch>`` for the installed torch (mooncake's
loaders build the module name from torch's version and nothing else), no compiled
extension at all (the -non-cuda wheel), an extension needing ``libcudart.so.N`` of
another CUDA major than torch's, and names SGLang imports that no module the loader
merges defines. A library missing from the image's search path is an image cause
too, but the loader's search at run time (LD_LIBRARY_PATH, what torch preloads) may
differ, so only the import confirms it in a pod.

Standard library only; Python 3.8 syntax.
"""

import bisect
import posixpath
import re

try:
    from . import diagnosis, files, inventory
    from . import elf as elf_mod
    from . import requirement as requirement_mod
except ImportError:  # run as `python3 probe`: the directory itself is on sys.path
    import diagnosis
    import elf as elf_mod
    import files
    import inventory
    import requirement as requirement_mod

# Mounted into the container by the NVIDIA runtime on a GPU node, never in an image.
DRIVER_LIBS = frozenset({"libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1"})
# What only a GPU node can check; the scan lists these rather than guess.
GPU_ONLY = (
    "driver: libcuda.so.1, which the NVIDIA container runtime mounts on a GPU node",
    "a visible GPU (torch.cuda.is_available)",
    "that the import registers the mooncake and mooncake-cpu torch backends",
    "the one-rank process-group smoke test (--level smoke)",
)
# cuda-mismatch counts only when the event itself was proven (a libcudart of another
# major is what is missing), which _module_events decides.
PROVEN = frozenset({"torch-not-installed", "mooncake-not-installed", "module-missing",
                    "no-extension-for-torch", "non-cuda-wheel", "missing-names",
                    "cuda-mismatch"})

_LOADER_RE = re.compile(
    r"import_module\(\s*[\"']mooncake\.([A-Za-z_]\w*)[\"']\s*(\+\s*version_suffix)?\s*\)")
_RAISE_RE = re.compile(r"raise\s+ImportError\(\s*f?[\"']([^\"'\\\n]*)")
_DEFINED_RE = re.compile(r"^(?:def|class)\s+([A-Za-z_]\w*)|^([A-Za-z_]\w*)\s*=", re.M)
_CPP_NAME_RE = re.compile(r"\"([A-Za-z_]\w*)\"")
# A value never spans lines (an unclosed quote must not swallow the next lines).
_TORCH_VERSION_RE = re.compile(
    r"^__version__[ \t]*(?::[^=\n]*)?=[ \t]*[\"']([^\"'\n]+)[\"']", re.M)
_TORCH_CUDA_RE = re.compile(
    r"^cuda[ \t]*(?::[^=\n]*)?=[ \t]*(?:[\"']([^\"'\n]*)[\"']|None)", re.M)
_CUDART_RE = re.compile(r"libcudart\.so\.(\d+)$")
# Limits with their reasons. sys.path entries: a real interpreter has ~10, and every
# lookup walks all of them; past this many the files decide nothing (a package in an
# entry not read could be the one imported).
MAX_PATH_ENTRIES = 1024
# Compiled modules one loader names: real ones name one or two.
MAX_LOADER_TARGETS = 64
# Entries looked at under MOONCAKE_PG_JIT_DIR for a prebuilt adapter.
MAX_JIT_DIR_ENTRIES = 4096
# Libraries torch's folders (torch/lib, the nvidia-* wheels) provide: a CUDA torch has
# ~150; past this, what the importing process has mapped is unknown.
MAX_PROVIDED = 20000


class Image:
    """Where an interpreter in some root would look: its files, ``sys.path``, the
    suffixes of its compiled modules and the environment the worker starts with."""

    def __init__(self, fs, path, suffixes, environ, driver_mounted, workdir=None):
        self.fs = fs
        self.path = list(path)
        self.suffixes = list(suffixes)
        self.environ = dict(environ)
        # The worker's working directory: ``python -m`` puts it first on sys.path.
        self.workdir = workdir
        # An image read by `epguard scan`: libcuda.so.1 comes from the node, so its
        # absence in the files is no finding (it is one of the GPU_ONLY checks).
        self.driver_mounted = driver_mounted


class Finding:
    def __init__(self, module, verdict, proven):
        self.module = module  # None for torch / mooncake not installed
        self.verdict = verdict  # diagnosis.Verdict, worded as the probe words it
        self.proven = proven


class Facts:
    def __init__(self):
        self.outcome = None  # diagnosis.Outcome, filled from files
        self.findings = []
        self.gpu_only = list(GPU_ONLY)
        self.notes = []  # what could not be read, said rather than guessed


def torch_facts(image):
    """(``__version__``, CUDA version or None, installed) from torch/version.py."""
    dirs = inventory.package_dirs("torch", image.path, image.fs)
    meta = inventory.dist_version("torch", image.path, image.fs)
    for d in dirs:
        text = image.fs.read_text(posixpath.join(d, "version.py"))
        if text is None:
            continue
        v = _TORCH_VERSION_RE.search(text)
        c = _TORCH_CUDA_RE.search(text)
        return (v.group(1) if v else meta), (c.group(1) if c and c.group(1) else None), True
    return meta, None, bool(dirs or meta)


def torch_provided(image, cuda_major):
    """Libraries a process has mapped once ``import torch`` is done: torch/lib and the
    nvidia-* wheels it preloads, one path per name (ld.so matches later DT_NEEDED names
    against their basenames). A libcudart of another CUDA major is not torch's, so it
    never counts. Each folder is read once, however many ``sys.path`` entries lead to
    it; None past MAX_PROVIDED names (then what is mapped is unknown): 100,000 files in
    torch/lib behind 50 linked entries took 603 MB as paths (found by a review helper)."""
    out = {}
    seen = set()
    fs = image.fs
    for entry in image.path:
        dirs = [posixpath.join(entry, "torch", "lib")]
        nvidia = posixpath.join(entry, "nvidia")
        try:
            subs = sorted(fs.listdir(nvidia))
        except OSError:
            subs = []
        dirs += [posixpath.join(nvidia, s, "lib") for s in subs[:64]]
        for d in dirs:
            real = fs.realpath(d)
            if real in seen:
                continue
            seen.add(real)
            try:
                names = fs.listdir(d)
            except OSError:
                continue
            for n in names:
                m = _CUDART_RE.match(n)
                if m and cuda_major is not None and int(m.group(1)) != cuda_major:
                    continue
                if ".so" in n and n not in out:
                    out[n] = posixpath.join(d, n)
                    if len(out) > MAX_PROVIDED:
                        return None
    paths = list(out.values())
    if image.driver_mounted:
        paths += ["/run/nvidia-driver/" + n for n in sorted(DRIVER_LIBS)]
    return paths


class Loader:
    """What ``mooncake/<leaf>.py`` imports: the compiled modules it merges, each with
    the ImportError text it raises when one is absent."""

    def __init__(self, path, text):
        self.path = path
        self.text = text or ""
        self.targets = []  # [(module leaf name, raise text or None)]
        # Too many to be a real loader: read as unreadable (the import decides).
        self.unreadable = False
        # The raise after each import_module: every raise found once, then a bisect
        # (a search from each import would be quadratic in a hostile loader).
        raises = [(r.start(), r.group(1)) for r in _RAISE_RE.finditer(self.text)]
        starts = [at for at, _ in raises]
        for m in _LOADER_RE.finditer(self.text):
            if len(self.targets) >= MAX_LOADER_TARGETS:
                self.targets, self.unreadable = [], True
                break
            leaf = m.group(1) + ("{suffix}" if m.group(2) else "")
            i = bisect.bisect_left(starts, m.end())
            self.targets.append((leaf, raises[i][1] if i < len(raises) else None))

    def defined(self):
        return {a or b for a, b in _DEFINED_RE.findall(self.text)}


def _compiled(image, pkg, leaf):
    """Path of ``mooncake.<leaf>`` as a compiled module, or None."""
    for d in pkg.dirs:
        for suffix in image.suffixes:
            p = posixpath.join(d, leaf + suffix)
            if image.fs.isfile(p):
                return p
    return None


def _loader(image, pkg, leaf):
    """The loader of ``mooncake.<leaf>``: (.py path or None, compiled path or None)."""
    for d in pkg.dirs:
        for rel in (leaf + ".py", posixpath.join(leaf, "__init__.py")):
            p = posixpath.join(d, rel)
            if image.fs.isfile(p):
                return p, None
    return None, _compiled(image, pkg, leaf)


def _error(*chain):
    return [{"type": t, "message": m} for t, m in chain]


def _outcome_with(base, imports, requirement=None, alternates=None):
    """``base`` with these import reports (and requirement, alternates) in place."""
    o = diagnosis.Outcome()
    o.__dict__.update(base.__dict__)
    o.imports = imports
    o.requirement = requirement or base.requirement
    o.alternates = dict(alternates or {})
    return o


def _one_module(base, module, event, alternates):
    """Worded as if ``module`` were the one that failed, with ``event`` its report."""
    req = base.requirement
    only = requirement_mod.Requirement(
        req.version, [module], {module: req.names.get(module, [])} if req.names else {},
        req.source, either=False)
    return _outcome_with(base, {module: event}, only, alternates)


def _absent(module, events):
    """Whether the first thing importing ``module`` meets is that it does not exist."""
    if not events:
        return False
    chain = events[0][0].get("error") or []
    return bool(chain) and chain[0]["message"] == f"No module named '{module}'"


def _module_events(image, o, module, tag, cuda_major, mapped):
    """[(event, proven)] for ``module``: what importing it would report, in the order
    the import meets them."""
    pkg = o.package
    fs = image.fs
    leaf = module.split(".", 1)[1]
    py, so = _loader(image, pkg, leaf)
    if py is None and so is None:
        return [({"ok": False, "static": True, "error": _error(
            ("ModuleNotFoundError", f"No module named '{module}'"))}, True)]
    loader = Loader(py, fs.read_text(py) if py else None)
    if loader.unreadable:
        return []
    key = (tag or "").replace(".", "_")
    targets, known = [], bool(loader.targets)
    for name, said in loader.targets:
        name = name.replace("{suffix}", "_" + key)
        path = _compiled(image, pkg, name)
        if path is None:
            text = (said or f"{module} cannot import mooncake.{name}").replace(
                "{torch_version}", tag or "?")
            absent = ("ModuleNotFoundError", f"No module named 'mooncake.{name}'")
            return [({"ok": False, "static": True,
                      "error": _error(("ImportError", text), absent)},
                     bool(said and "not built" in said))]
        targets.append(path)
    if so:
        targets.append(so)
    events = []
    jit = pkg.jit and leaf == "pg" and not known
    if jit:
        need = _jit_missing(image)
        if need:
            events.append(({"ok": False, "static": True, "error": _error((
                "ImportError", "Mooncake PG Torch adapter JIT compilation failed: "
                "cannot build the adapter in this image"))}, False))
    roots = list(targets) + (list(pkg.ep_core) if leaf == "ep" and not known else [])
    roots += list(pkg.libs)
    walk = elf_mod.missing_libraries(
        roots, loaded=mapped, search=elf_mod.system_dirs(fs, image.environ), fs=fs)
    missing = [n for n, _ in walk]
    if missing:
        cudart = [n for n in missing if _CUDART_RE.match(n)
                  and cuda_major is not None and int(_CUDART_RE.match(n).group(1)) != cuda_major]
        first = (cudart or missing)[0]
        # A walk a limit cut short proves no absence: the library may be where it
        # did not look.
        events.append(({"ok": False, "static": True, "missing_libraries": missing, "error": _error(
            ("ImportError", f"{first}: cannot open shared object file: No such file or "
                            "directory"))}, bool(cudart) and walk.complete))
    names = (o.requirement.names or {}).get(module, [])
    if names and (known or jit or so):
        have = set(loader.defined())
        for path in targets:
            found = fs.strings(path)
            if found is None:
                # Unreadable (or over MAX_STRINGS_BYTES): what it defines is unknown,
                # so no name can be said to be missing.
                return events
            have |= found
        if jit:
            for d in pkg.dirs:
                cpp = fs.read_text(posixpath.join(d, "_pg_jit", "pg_py.cpp"))
                have |= set(_CPP_NAME_RE.findall(cpp or ""))
        lacking = [n for n in names if n not in have]
        if lacking:
            events.append(({"ok": True, "static": True, "file": py or so,
                            "missing_names": lacking}, not jit))
    return events


def _jit_missing(image):
    """What 0.3.14's JIT build needs and the image lacks; [] when a prebuilt adapter is
    in MOONCAKE_PG_JIT_DIR (the documented way to ship one)."""
    cache = image.environ.get("MOONCAKE_PG_JIT_DIR")
    if cache and _has_compiled(image.fs, cache, 3):
        return []
    return inventory.jit_prerequisites(None, image.fs, image.environ)


def _has_compiled(fs, d, depth, budget=None):
    """Whether a ``.so`` lies within ``depth`` levels under ``d``; at most
    MAX_JIT_DIR_ENTRIES entries looked at in all (256 per directory)."""
    budget = [MAX_JIT_DIR_ENTRIES] if budget is None else budget
    try:
        names = fs.listdir(d)
    except OSError:
        return False
    for n in names[:256]:
        if budget[0] <= 0:
            return False
        budget[0] -= 1
        p = posixpath.join(d, n)
        if n.endswith(".so") and fs.isfile(p):
            return True
        if depth > 0 and fs.isdir(p) and _has_compiled(fs, p, depth - 1, budget):
            return True
    return False


# Packages whose absence the files may prove; what finds them elsewhere is checked first.
_OWN = ("torch", "mooncake", "sglang")
# Bytes of an editable install's .pth read for its import line (setuptools writes one).
MAX_HOOK_BYTES = 4096


def _import_hook(fs, entry, names):
    """A ``.pth`` in ``entry`` that runs an import and names torch, mooncake or SGLang (an
    editable install's finder: setuptools' ``__editable__.*.pth``, hatchling's, scikit-
    build-core's, meson-python's; the package is found by a hook, not on sys.path), in
    words; None when there is none. A package found that way looks absent to this
    reading (found by a review helper: "has no mooncake.pg", scope image, for an
    editable mooncake). A hook for another package (setuptools' own
    distutils-precedence.pth) changes nothing here."""
    for name in names:
        if not name.endswith(".pth"):
            continue
        try:
            text = fs.read_text(posixpath.join(entry or ".", name), limit=MAX_HOOK_BYTES)
        except (OSError, ValueError):
            text = None
        if text is None:
            if any(own in name.lower() for own in _OWN):
                return (f"{name[:200]!r} in {entry[:200]!r}: this user cannot read it as a "
                        ".pth file")
            continue
        hooks = [ln for ln in text.splitlines() if ln.startswith(("import ", "import\t"))]
        if hooks and any(own in (name + "\n".join(hooks)).lower() for own in _OWN):
            return (f"{name[:200]!r} in {entry[:200]!r} installs an import hook (an editable "
                    "install) this reading does not follow")
    return None


def _unfollowed(image, path):
    """Where the worker's python finds packages that this reading of ``path`` does not
    see, in words; None when there is nothing such. The image's PYTHONHOME (the probe runs
    with -I, which ignores it; the worker does not), and a working directory holding one
    of _OWN as a regular package or module (``python -m`` imports from it first; a folder
    without ``__init__.py``, such as the SGLang checkout in /sgl-workspace, is a namespace
    portion, which a regular package anywhere on sys.path wins over): found by a review
    helper, each made "torch is not installed", scope image, of an image that works."""
    if image.environ.get("PYTHONHOME"):
        return "the image sets PYTHONHOME, whose packages this reading does not follow"
    workdir = image.workdir
    if workdir and workdir not in path:
        for name in _OWN:
            at = posixpath.join(workdir, name)
            if image.fs.isfile(posixpath.join(at, "__init__.py")) or image.fs.isfile(at + ".py"):
                return (f"the working directory {workdir[:200]!r} holds {name}, which "
                        "python -m imports before sys.path")
    return None


def read(image, request, requirement=None):
    """Every image cause the files show for ``request`` (a cmdline.Request)."""
    facts = Facts()
    fs = image.fs
    path, seen = [], set()
    for entry in image.path:
        if entry not in seen:
            seen.add(entry)
            path.append(entry)
    if len(path) > MAX_PATH_ENTRIES:
        facts.notes.append(f"more than {MAX_PATH_ENTRIES} sys.path entries: the files "
                           "decide nothing, the import does")
        return facts
    image.path = path
    for entry in path:
        # A directory this user may not list hides what it holds: nothing it lacks is
        # proven (a pod's runAsUser must not make an image look as if torch were absent).
        try:
            names = fs.listdir(entry or ".")
        except PermissionError:
            facts.notes.append(f"the sys.path entry {entry[:200]!r} cannot be listed as this "
                               "user: the files decide nothing, the import does")
            return facts
        except OSError:
            continue
        hook = _import_hook(fs, entry, names)
        if hook is not None:
            facts.notes.append(hook + ": the files decide nothing, the import does")
            return facts
    unfollowed = _unfollowed(image, path)
    if unfollowed is not None:
        facts.notes.append(unfollowed + ": the files decide nothing, the import does")
        return facts
    o = diagnosis.Outcome()
    o.request = request
    o.fs = fs
    o.environ = image.environ
    o.requirement = requirement or requirement_mod.requirement(fs, image.path)
    o.dists = inventory.mooncake_distributions(image.path, fs)
    o.package = inventory.mooncake_package(fs, image.path, image.suffixes)
    o.torch_metadata = inventory.dist_version("torch", image.path, fs)
    version, cuda, installed = torch_facts(image)
    facts.outcome = o
    if not installed:
        o.torch = {"ok": False, "static": True, "error": _error(
            ("ModuleNotFoundError", "No module named 'torch'"))}
        facts.findings.append(Finding(None, diagnosis.diagnose(o), True))
        return facts
    if version is None:
        facts.notes.append("torch is installed but its version.py is unreadable: "
                           "torch's version and CUDA build are checked in a pod")
        return facts
    o.torch = {"ok": True, "static": True, "version": version, "cuda": cuda}
    if not o.dists and not o.package.found:
        facts.findings.append(Finding(None, diagnosis.diagnose(o), True))
        return facts
    tag = inventory.torch_tag(version)
    major = inventory.cuda_major(cuda)
    mapped = torch_provided(image, major)
    if mapped is None:
        facts.notes.append(f"torch's library folders hold more than {MAX_PROVIDED} "
                           "libraries: the files decide nothing, the import does")
        return facts
    per_module = []
    events = {m: _module_events(image, o, m, tag, major, mapped) for m in o.requirement.modules}
    alternates = {}
    if not o.requirement.either and any(_absent(m, e) for m, e in events.items()):
        # As the probe says after a failed import: whether the other module would load
        # (for another SGLang), here judged from its files.
        for m in requirement_mod.MODULES:
            if m not in events:
                alternates[m] = not _module_events(image, o, m, tag, major, mapped)
    for module in o.requirement.modules:
        found = []
        for event, proven in events[module]:
            v = diagnosis.diagnose(_one_module(o, module, event, alternates))
            if v.verdict == diagnosis.USABLE or v.scope != diagnosis.message.IMAGE:
                continue
            found.append(Finding(module, v, proven and v.classification in PROVEN))
        per_module.append(found)
    req = o.requirement
    # Any one module is enough when SGLang's needs are unknown: a cause only if all fail,
    # worded over both as the probe words it after trying both.
    if req.either:
        if any(not f for f in per_module):
            return facts
        both = _outcome_with(o, {m: events[m][0][0] for m in req.modules})
        facts.findings.append(Finding(None, diagnosis.diagnose(both),
                                      all(f[0].proven for f in per_module)))
        return facts
    for found in per_module:
        facts.findings.extend(found)
    return facts


def first_proven(facts):
    """The finding that ends a probe early, if the files prove it; else None.

    Only the first finding, the one the import would meet first: a proven cause behind
    an unproven one (a missing name behind a missing library) is still true, but the
    probe would then report a different cause than the import does.
    """
    if facts.findings and facts.findings[0].proven:
        return facts.findings[0]
    return None


def decide(image, request, until):
    """(facts, the proven finding or None, a note or None) for the probe's own root,
    read by ``until`` (a ``time.monotonic()`` value; files.Live checks it on every call).

    The files may only decide a proven cause; nothing that goes wrong here may decide
    anything. Past the deadline, or on any error (a file this code cannot parse, a
    MemoryError, a bug), the answer is "no finding" with a note saying why, and the
    import decides, as with --no-static.
    """
    if image.fs is files.LIVE:
        image.fs = files.Live(until)
    try:
        facts = read(image, request)
        denied = getattr(image.fs, "denied", None)
        if denied is not None:
            # A file or folder this user may not read hides what it holds: nothing it
            # seems to lack is proven (a pod's runAsUser must not make a package look
            # empty, and so steer the image's verdict for everyone).
            facts.findings = []
            facts.notes.append(f"{denied[:200]!r} cannot be read as this user: the files "
                               "decide nothing, the import does")
        return facts, first_proven(facts), None
    except files.OutOfTime:
        note = "the image's files were not read within --timeout"
    except Exception as exc:  # noqa: BLE001 - decided by the import instead
        note = f"reading the image's files failed ({type(exc).__name__}: {str(exc)[:200]})"
    return None, None, note + ": decided by the import"
