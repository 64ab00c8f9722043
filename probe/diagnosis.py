"""Turn what the probe saw into a verdict, a cause and a fix.

The import error the engine would die with is often a poor guide: the loader
names the first missing library only, mooncake's loaders say "not built against
torch==X" both for a torch skew and for the -non-cuda wheel that ships no
extension at all, and SGLang re-raises both as "upgrade to 0.3.11". The
classification here uses the error together with the wheel's contents, the ELF
dependencies of the extension and torch's CUDA version.
"""

import re

try:
    from . import catalog, elf, inventory, message
except ImportError:  # run as `python3 probe`: the directory itself is on sys.path
    import catalog
    import elf
    import inventory
    import message

USABLE, UNUSABLE = "usable", "unusable"

# Where each failure lives. "image": a fact about the files in the image, the same on
# every node and in every pod (only these become cluster-wide ImageVerdicts).
# "environment": the pod or the node (driver, GPU, a crash or a hang on one node, the
# network in a smoke test, a torch that fails to import, which a variable can cause).
# An unknown import error is not proven to be the image's, so it is environment too.
IMAGE_CAUSES = frozenset({
    "cuda-mismatch", "missing-libraries", "non-cuda-wheel", "no-extension-for-torch",
    "jit-prerequisites", "module-missing", "missing-names", "abi-mismatch",
    "mooncake-not-installed", "backends-missing", "half-registration", "backend-devices",
    "torch-not-installed",
})
_SCOPE_WORDS = {
    message.IMAGE: "image (in the image's files: the same on every node)",
    message.ENVIRONMENT: "environment (this pod or its node; the image may be fine)",
}

_RDMA = ("libibverbs.so.1", "libmlx5.so.1", "librdmacm.so.1", "libnuma.so.1")
_MISSING_LIB_RE = re.compile(r"(lib[\w.+-]*?\.so(?:\.\d+)*): cannot open shared object file")
# A symbol of the driver API (libcuda's cu*, libnvidia-ml's nvml*; the runtime's are
# cuda*), which the node's driver provides.
_DRIVER_SYMBOL_RE = re.compile(r"undefined symbol: ((?:cu[A-Z]|nvml)\w*)")
# The loader found the library and this user may not open it: not missing from the image.
_DENIED_LIB = "cannot open shared object file: Permission denied"


class Outcome:
    """Everything observed, filled in by cli.py; read by :func:`diagnose`."""

    def __init__(self):
        self.request = None
        self.requirement = None
        self.dists = []
        self.package = None
        self.torch = None  # child's "torch" event, or {"ok": False, "crash"/"timeout": ...}
        self.torch_metadata = None
        self.imports = {}  # module -> child's "import" event, or a crash/timeout record
        self.alternates = {}  # module -> bool
        self.backends = None
        self.cuda = None
        self.smoke = []
        self.level = "import"
        self.timeout = None
        self.output_tail = ""
        # Set by static.py for an outcome read from files: the root they are in, and
        # the environment the worker would start with there.
        self.fs = None
        self.environ = None
        # Why the image's files did not decide (out of time, unreadable), said in the
        # evidence: the probe's fast path failed and the import decided instead.
        self.static_note = None


class Verdict:
    def __init__(self):
        self.verdict = UNUSABLE
        self.classification = None
        self.cause = ""
        self.fix = ""
        self.evidence = []  # lines between the first and the fix line
        self.checks = []
        self.missing_libraries = []
        self.versions = {}
        self.scope = None  # "image" | "environment" for a failure, None when usable

    def check(self, name, ok, detail):
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})


def _first_error(event):
    chain = event.get("error") or []
    if not chain:
        return ""
    first = chain[0]
    return "{}: {}".format(first.get("type"), first.get("message", "").strip())


def _all_error_text(event):
    return "\n".join(e.get("message", "") for e in event.get("error") or [])


def _one_line(text, limit=240):
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _torch_version(o):
    if o.torch and o.torch.get("ok"):
        return o.torch.get("version")
    return o.torch_metadata


def _torch_cuda(o):
    if o.torch and o.torch.get("ok"):
        return o.torch.get("cuda")
    return None


def versions(o):
    out = {"torch": _torch_version(o) or "none",
           "sglang": (o.requirement.version if o.requirement else None) or "none"}
    if o.dists:
        for name, version in o.dists:
            out[name] = version
    else:
        out["mooncake"] = "none"
    return out


def versions_line(v):
    return "versions: " + " ".join(f"{k}={val}" for k, val in v.items())


def _mooncake_label(o):
    if not o.dists:
        return "mooncake"
    return ", ".join("{} {}".format(*d) for d in o.dists)


def _primary_dist(o):
    return o.dists[0] if o.dists else (None, None)


def _ext_roots(o, module):
    """Compiled files the import of ``module`` loads, for the dependency walk."""
    pkg = o.package
    tag = inventory.torch_tag(_torch_version(o))
    roots = []
    if tag:
        key = tag.replace(".", "_")
        if module == "mooncake.ep":
            roots.append(pkg.files.get("ep_" + key))
        roots.append(pkg.files.get("pg_" + key))
    roots = [r for r in roots if r]
    if module == "mooncake.ep":
        roots += pkg.ep_core
    return roots + list(pkg.libs)


def _lib_meaning(lib, torch_cuda_major):
    m = re.match(r"libcudart\.so\.(\d+)$", lib)
    if m:
        return "cuda-mismatch" if int(m.group(1)) != torch_cuda_major else "cuda-runtime"
    if lib == "libcuda.so.1":
        return "no-driver"
    if lib in _RDMA:
        return "rdma"
    return "other"


_LIB_WORDS = {
    "no-driver": "NVIDIA driver not mounted in this container",
    "rdma": "rdma-core userspace not in the image",
    "cuda-runtime": "CUDA runtime not found",
    "other": "not in the image",
}


def _missing_libs(o, module, event):
    if event.get("missing_libraries") is not None:  # static.py walked them already
        return list(event["missing_libraries"])
    text = _all_error_text(event)
    if _DENIED_LIB in text:
        # The loader found the library and this user may not open it: no fact about
        # the image, left to the unknown import error (environment).
        return []
    loaded = event.get("mapped") or []
    search = elf.system_dirs(o.fs, o.environ) if o.fs is not None else None
    found = elf.missing_libraries(_ext_roots(o, module), loaded=loaded, search=search, fs=o.fs)
    names = [n for n, _ in found]
    # The loader's own complaint first, even if our walk could not see it; but not a
    # library the walk found as a file in the image: one this pod's user may not open
    # (the loader says "No such file" of a file it may not read) is not missing.
    m = _MISSING_LIB_RE.search(text)
    if m and m.group(1) not in names:
        if m.group(1) in found.found:
            return names
        names.insert(0, m.group(1))
    elif m:
        names.remove(m.group(1))
        names.insert(0, m.group(1))
    return names


def _fix_for_libs(o, kinds, cuda_major, need_ste):
    fixes = []
    if "cuda-mismatch" in kinds:
        tv = inventory.torch_tag(_torch_version(o))
        wheel = catalog.wheel_for(tv, cuda_major, need_ste) or catalog.dist_for_cuda(cuda_major)
        dist = _primary_dist(o)[0] or "the CUDA {} mooncake wheel".format("?")
        fixes.append(f"install {wheel} (built for CUDA {cuda_major} like torch) instead of {dist}")
    if "rdma" in kinds:
        fixes.append("add RDMA userspace to the image (Debian/Ubuntu: apt-get install "
                     "libibverbs1 ibverbs-providers libnuma1)")
    if "other" in kinds or "cuda-runtime" in kinds:
        fixes.append("install the packages that provide the missing libraries in the image")
    if "no-driver" in kinds:
        fixes.append("give this init container the worker's GPU request (nvidia.com/gpu) so "
                     "the NVIDIA runtime mounts libcuda.so.1")
    return "; ".join(fixes)


def _classify_import_failure(o, module, event, v):
    """Set classification/cause/fix on ``v`` for a failed import of ``module``."""
    req = o.requirement
    pkg = o.package
    text = _all_error_text(event)
    first = _first_error(event)
    tv = _torch_version(o)
    tag = inventory.torch_tag(tv)
    cuda_major = inventory.cuda_major(_torch_cuda(o))
    dist, dist_v = _primary_dist(o)
    need_ste = "set_transfer_engine" in (req.names.get(module, []) if req else [])
    recommended = catalog.wheel_for(tag, cuda_major, need_ste) if cuda_major else None
    label = _mooncake_label(o)

    if event.get("crash"):
        v.classification = "crash"
        v.cause = "crashed with {} while importing {}".format(event["crash"], module)
        other = recommended or "a mooncake build for this torch"
        v.fix = f"the native import itself dies: try {other}, or another build of {label}"
        return
    if event.get("timeout"):
        v.classification = "timeout"
        v.cause = "timed out after {} s while importing {}".format(event["timeout"], module)
        if pkg.jit:
            v.cause += " (0.3.14 builds its torch adapter by JIT on first import)"
            v.fix = ("bake the adapter into the image: run `python -m mooncake.pg --prebuild` "
                     "at build time with MOONCAKE_PG_JIT_DIR set to a directory in the image")
        else:
            v.fix = f"find what {module} waits for on import (network, a lock, a device)"
        return

    libs = _missing_libs(o, module, event) if "cannot open shared object file" in text else []
    if libs:
        v.missing_libraries = libs
        kinds = [_lib_meaning(lib, cuda_major) for lib in libs]
        # One phrase per kind, libraries of a kind together, in the order first seen.
        groups = []
        for lib, kind in zip(libs, kinds):
            for g in groups:
                if g[0] == kind:
                    g[1].append(lib)
                    break
            else:
                groups.append((kind, [lib]))
        described = ["{} ({})".format(", ".join(ls), _LIB_WORDS[k])
                     for k, ls in groups if k != "cuda-mismatch"]
        if "cuda-mismatch" in kinds:
            cu = [lib for lib, k in zip(libs, kinds) if k == "cuda-mismatch"][0]
            v.classification = "cuda-mismatch"
            built = cu.rsplit(".", 1)[-1]
            v.cause = (f"{label} is built for CUDA {built} (needs {cu}) "
                       f"but torch {tv} uses CUDA {cuda_major}")
            if described:
                v.cause += "; also missing: " + ", ".join(described)
        else:
            v.classification = "no-driver" if set(kinds) == {"no-driver"} else "missing-libraries"
            v.cause = "{} cannot load: missing {}".format(module, ", ".join(described))
        v.fix = _fix_for_libs(o, set(kinds), cuda_major, need_ste)
        return

    no_ext = not pkg.extensions["pg"] and not pkg.extensions["ep"] and not pkg.jit
    if ("Mooncake EP was not built." in text or "was not built against torch" in text) and (
            no_ext or (dist or "").endswith("non-cuda")):
        v.classification = "non-cuda-wheel"
        said = first.splitlines()[0] if first else "import failed"
        v.cause = f"{label} ships mooncake's loaders but no compiled PG extension ({said})"
        v.fix = "install {} instead of {}".format(
            recommended or catalog.dist_for_cuda(cuda_major), dist or "the -non-cuda wheel")
        return
    if "was not built against torch" in text:
        shipped = pkg.extensions["pg"] or pkg.extensions["ep"]
        v.classification = "no-extension-for-torch"
        v.cause = (f"{label} has no PG extension for torch {tag} "
                   f"(it ships pg_* for torch {', '.join(shipped) or 'none'})")
        if pkg.other_abi["pg"] and not shipped:
            v.cause += "; pg_* exist only for another Python version"
        alt = (f"install {recommended}") if recommended else (
            "install {}=={} (JIT, needs ninja + nvcc at image build)".format(*catalog.JIT_WHEEL))
        v.fix = f"{alt}, or use torch {' / '.join(shipped) if shipped else 'it was built for'}"
        return
    if "JIT compilation failed" in text:
        # Read from files (o.cuda is None): whether a GPU is visible is for the node to say.
        cuda = None if o.cuda is None and o.fs is not None else bool(
            (o.cuda or {}).get("available"))
        need = inventory.jit_prerequisites(cuda, o.fs, o.environ)
        inner = _one_line(first.split("JIT compilation failed:", 1)[-1], 200)
        fallback = catalog.wheel_for(tag, cuda_major, need_ste) if cuda_major else None
        prebuild = ("prebuild the adapter into the image (`python -m mooncake.pg --prebuild` "
                    "with ninja, nvcc and a GPU or TORCH_CUDA_ARCH_LIST, MOONCAKE_PG_JIT_DIR in "
                    "the image)")
        if any(n in inventory.JIT_FILES for n in need):
            # ninja or nvcc is not in the image's files: no pod can build it.
            v.classification = "jit-prerequisites"
            v.cause = (f"{label} builds its PG torch adapter by JIT on import and cannot here: "
                       f"{inner} (missing: {', '.join(need)})")
            v.fix = prebuild + (f", or install {fallback}" if fallback else "")
            return
        # The image has what the build needs: a failure is this pod's or its node's (no
        # GPU and no TORCH_CUDA_ARCH_LIST, a cache folder it cannot write under its
        # user or a read-only root, the compiler out of memory), never the image's.
        v.classification = "jit-failed"
        v.cause = (f"{label} builds its PG torch adapter by JIT on import, and the build "
                   f"failed here although the image has ninja and nvcc: {inner}")
        if need:
            v.cause += " (missing: {})".format(", ".join(need))
        v.fix = (prebuild + " so that no pod builds it; or let this pod build it: a visible "
                 "GPU or TORCH_CUDA_ARCH_LIST, a writable HOME or MOONCAKE_PG_JIT_DIR, "
                 "memory for the compiler")
        return
    if "No module named" in text:
        v.classification = "module-missing"
        other = [m for m, ok in o.alternates.items() if ok]
        v.cause = "{} has no {}{}".format(
            label, module, f" (SGLang {req.version} imports it)" if req and req.version else "")
        if other:
            v.cause += f"; {other[0]} imports, which suits another SGLang"
        v.fix = "install %s" % (recommended or "mooncake >= 0.3.11 built for this torch")
        return
    driver = _DRIVER_SYMBOL_RE.search(text)
    if driver:
        # The driver API (cu*, nvml*) comes from the node's libcuda / libnvidia-ml, not
        # from the image: an old driver on one node pool is no fact about the image.
        v.classification = "driver-too-old"
        v.cause = (f"{module} needs {driver.group(1)} from the NVIDIA driver, which this "
                   "node's driver does not have")
        v.fix = ("run the pod on nodes with a newer NVIDIA driver (the one this CUDA "
                 "build needs)")
        return
    if "undefined symbol" in text:
        v.classification = "abi-mismatch"
        v.cause = f"{module} does not link against this torch: {_one_line(first, 200)}"
        v.fix = "install %s" % (recommended or f"a mooncake build made for torch {tv}")
        return
    v.classification = "import-error"
    v.cause = f"importing {module} fails: {_one_line(first, 200)}"
    v.fix = "install %s" % (recommended or f"a mooncake build made for torch {tv}")


def _module_ok(o, module):
    ev = o.imports.get(module)
    return bool(ev and ev.get("ok") and not ev.get("missing_names"))


def diagnose(o):
    v = Verdict()
    v.versions = versions(o)
    req = o.requirement
    pkg = o.package
    v.check("request", True, o.request.describe())
    v.check("sglang", True, req.source)
    v.check("mooncake-installed", bool(o.dists or pkg.found),
            _mooncake_label(o) if o.dists else ("package only" if pkg.found else "none"))
    if pkg.jit:
        ext = "JIT adapter sources (0.3.14), no prebuilt pg_*"
    else:
        ext = " ".join("{}_{}".format(k, t.replace(".", "_"))
                       for k in ("pg", "ep") for t in pkg.extensions[k]) or "none"
    has_ext = bool(pkg.extensions["pg"] or pkg.extensions["ep"] or pkg.jit)

    torch_ok = bool(o.torch and o.torch.get("ok"))
    if o.torch is None:
        tdetail = "the check process ended without a report"
    elif torch_ok:
        tdetail = "{} (CUDA {}){}".format(o.torch.get("version"), o.torch.get("cuda") or "none",
                                          " read from torch/version.py" if o.torch.get("static")
                                          else "")
    elif o.torch.get("crash"):
        tdetail = "crashed with {} while importing torch".format(o.torch["crash"])
    elif o.torch.get("timeout"):
        tdetail = "timed out after {} s while importing torch".format(o.torch["timeout"])
    else:
        tdetail = _one_line(_first_error(o.torch), 200)
    v.check("torch", torch_ok, tdetail)
    if o.cuda is not None:
        v.check("cuda", True, "available={} devices={}".format(
            "yes" if o.cuda.get("available") else "no", o.cuda.get("devices", 0)))

    evidence = [versions_line(v.versions)]
    if torch_ok:
        if o.torch.get("static"):
            seen = "not checked (read from files, before import torch)"
        elif o.cuda and o.cuda.get("available"):
            seen = "yes, {} device(s)".format(o.cuda.get("devices"))
        else:
            seen = "no"
        evidence.append("torch: built for CUDA {}; GPU visible: {}".format(
            o.torch.get("cuda") or "none (CPU build)", seen))
    evidence.append("needs: {}{}".format(
        " or ".join(req.modules) if req.either else " and ".join(req.modules),
        "" if req.either else " ({}; names: {})".format(
            req.source, ", ".join(n for m in req.modules for n in req.names.get(m, [])))))
    if o.dists or pkg.found:
        evidence.append("extensions: " + ext)

    def finish():
        if v.verdict != USABLE:
            v.scope = message.IMAGE if v.classification in IMAGE_CAUSES else message.ENVIRONMENT
            evidence.insert(1, message.SCOPE + _SCOPE_WORDS[v.scope])
        for mod, ev in o.imports.items():
            if ev.get("ok") is False and v.classification not in (None,):
                evidence.append("{} ({}): {}".format(
                    "from files, the import would raise" if ev.get("static") else "error",
                    mod, _one_line(_first_error(ev) or v.cause, 300)))
                break
        evidence.append("request: " + o.request.describe())
        if getattr(o, "static_note", None):
            evidence.append("files: " + o.static_note)
        v.evidence = evidence
        return v

    if not torch_ok:
        missing = (o.torch is not None and not o.torch_metadata
                   and "No module named 'torch'" in _all_error_text(o.torch))
        # Not installed at all is a fact about the image; any other failure to import
        # may come from the pod (a variable, a node's library), so it proves nothing.
        v.classification = "torch-not-installed" if missing else "torch-unusable"
        v.cause = ("torch is not installed" if missing else "torch does not import") + (
            ": " + tdetail)
        v.fix = ("install torch in the image (the worker imports it first)" if missing
                 else "repair torch in this pod (the worker imports it first)")
        return finish()
    if not o.dists and not pkg.found:
        tag = inventory.torch_tag(_torch_version(o))
        major = inventory.cuda_major(_torch_cuda(o))
        need = any("set_transfer_engine" in n for n in req.names.values())
        v.classification = "mooncake-not-installed"
        v.cause = f"no mooncake distribution is installed ({req.source})"
        v.check("import", False, "nothing to import")
        wheel = catalog.wheel_for(tag, major, need) if major else None
        pg = "pg_" + (tag or "?").replace(".", "_")
        v.fix = "install " + (wheel or f"a mooncake build whose wheel ships {pg}")
        return finish()

    # Imports and names.
    for mod in req.modules:
        ev = o.imports.get(mod)
        if ev is None:
            v.check("import " + mod, False, "not attempted")
            continue
        if ev.get("ok"):
            v.check("import " + mod, True, ev.get("file") or "ok")
            names = req.names.get(mod, [])
            if names:
                miss = ev.get("missing_names") or []
                v.check("names " + mod, not miss,
                        ("missing: " + ", ".join(miss)) if miss else ", ".join(names))
        elif ev.get("crash"):
            v.check("import " + mod, False, "crashed with {}".format(ev["crash"]))
        elif ev.get("timeout"):
            v.check("import " + mod, False, "timed out after {} s".format(ev["timeout"]))
        else:
            v.check("import " + mod, False, _one_line(_first_error(ev), 300))

    passing = [m for m in req.modules if _module_ok(o, m)]
    # A source build may name its extension differently; what matters is the import.
    v.check("extensions", has_ext or bool(passing), ext)
    if (req.either and not passing) or (not req.either and len(passing) < len(req.modules)):
        failing = [m for m in req.modules if not _module_ok(o, m)]
        mod = failing[0]
        ev = o.imports.get(mod) or {}
        if ev.get("ok"):
            miss = ev.get("missing_names") or []
            v.classification = "missing-names"
            v.cause = "{} lacks {}, which {}".format(
                mod, ", ".join(miss), f"SGLang {req.version} imports")
            tag = inventory.torch_tag(_torch_version(o))
            major = inventory.cuda_major(_torch_cuda(o))
            if "set_transfer_engine" in miss:
                wheel = catalog.wheel_for(tag, major, True) if major else None
                v.fix = "install {} (set_transfer_engine exists from mooncake {})".format(
                    wheel or f"mooncake >= {catalog.SET_TRANSFER_ENGINE_SINCE}",
                    catalog.SET_TRANSFER_ENGINE_SINCE)
            elif pkg.jit and mod == "mooncake.ep":
                v.fix = ("mooncake 0.3.14 no longer exposes the PG through mooncake.ep: pin "
                         "mooncake <= 0.3.13.post1 for SGLang <= 0.5.16, or use SGLang >= 0.5.17")
            else:
                v.fix = "install a mooncake build whose {} exports {}".format(mod, ", ".join(miss))
        elif not ev:
            v.classification = "import-error"
            v.cause = f"{mod} was not imported (an earlier step failed)"
            v.fix = "see the evidence lines"
        else:
            _classify_import_failure(o, mod, ev, v)
        if pkg.jit and "mooncake.ep" in req.modules and not req.either and (
                v.classification != "missing-names"):
            # F10: whatever else is wrong, 0.3.14's mooncake.ep is only the MoE buffer.
            v.fix += ("; also pin mooncake <= 0.3.13.post1: 0.3.14's mooncake.ep no longer "
                      "carries the PG backend that SGLang <= 0.5.16 uses")
        if o.alternates:
            evidence.append("other module: " + ", ".join(
                "{} {}".format(m, "imports" if ok else "fails") for m, ok in o.alternates.items()))
        return finish()

    # Backends: SGLang builds a "mooncake" device group and a "mooncake-cpu" CPU group.
    b = o.backends or {}
    if not b.get("readable"):
        v.check("backends", True, "skipped: Backend.backend_capability unreadable")
    else:
        caps = b.get("capability", {})
        gpu = caps.get("mooncake")
        cpu = caps.get("mooncake-cpu")
        detail = "mooncake={} mooncake-cpu={}".format(
            ",".join(gpu) if gpu is not None else "absent",
            ",".join(cpu) if cpu is not None else "absent")
        ok = bool(gpu) and "cpu" not in gpu and bool(cpu) and "cpu" in cpu
        v.check("backends", ok, detail)
        evidence.append("backends: " + detail)
        if not ok:
            if gpu is None and cpu is None:
                v.classification = "backends-missing"
                v.cause = f"{passing[0]} imports but registers no mooncake torch backend"
            elif gpu is None or cpu is None:
                v.classification = "half-registration"
                v.cause = ("{} registers only {}; SGLang needs both mooncake (device) and "
                           "mooncake-cpu (cpu) process groups".format(
                               passing[0], "mooncake" if gpu is not None else "mooncake-cpu"))
            else:
                v.classification = "backend-devices"
                v.cause = "mooncake backends registered for the wrong devices: " + detail
            v.fix = f"install {_mooncake_label(o)} built for torch {_torch_version(o)}"
            return finish()

    if o.level == "smoke":
        bad = [s for s in o.smoke if not s.get("ok")]
        for s in o.smoke:
            v.check("smoke " + str(s.get("backend")), s.get("ok"),
                    _one_line(_first_error(s), 200) if not s.get("ok") else "all_reduce + barrier")
        if not o.smoke or bad:
            s = bad[0] if bad else {}
            v.classification = "smoke-failed"
            if s.get("crash") or s.get("timeout"):
                v.cause = ("one-rank process group %s" % (
                    "crashed with {}".format(s["crash"]) if s.get("crash")
                    else "timed out after {} s".format(s["timeout"])))
            else:
                v.cause = "one-rank process group on {} failed: {}".format(
                    s.get("backend", "mooncake"), _one_line(_first_error(s), 200) or "no result")
            v.fix = "check the mooncake transport (RDMA devices, MC_FORCE_TCP) in this pod"
            return finish()

    v.verdict = USABLE
    v.classification = "usable"
    v.cause = "{} imports with torch {}{}".format(
        " and ".join(passing), _torch_version(o),
        "; backends mooncake and mooncake-cpu registered" if b.get("readable") else "")
    if o.level == "smoke":
        v.cause += "; one-rank smoke test passed"
    v.fix = "nothing to fix"
    return finish()
