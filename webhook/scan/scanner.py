"""``epguard scan``: judge an image from its files, with no GPU, root or runtime.

The image's layers are merged into a :class:`~webhook.scan.tree.Tree`, the Python
installation the worker would run is found in it, and the probe's own static
diagnosis (``probe/static.py``) reads that tree. The outcome is every image cause
the files show, each worded as the init-container probe words it, and the list of
checks only a GPU node can make.
"""

from __future__ import annotations

import posixpath
import re
import time
from dataclasses import dataclass, field
from typing import Any

from epguard.probe import cmdline, diagnosis, inventory, static
from epguard.probe.cli import MAX_CONFIG_BYTES  # SGLang's --config, read as the probe reads it
from epguard.webhook.engine.text import cut
from epguard.webhook.scan import layers
from epguard.webhook.scan.sources import Source, SourceError, open_source
from epguard.webhook.scan.tarstream import Budget, BudgetError
from epguard.webhook.scan.tree import MAX_NOTE_CHARS, MAX_NOTES, Tree, TreeError

# What the scan judges when neither --argv nor the image's own command asks for
# mooncake: any SGLang launch with the flag (the image is meant for such workers).
ANY_LAUNCH = ("python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "mooncake")
_ARCH = {"amd64": "x86_64", "arm64": "aarch64", "ppc64le": "powerpc64le", "s390x": "s390x"}
_PY_RE = re.compile(r"^python3\.(\d+)$")
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Directories of PATH / LD_LIBRARY_PATH / PYTHONPATH searched: those that exist in the
# image, each once, in order (what the search finds is unchanged: a directory that
# is not there holds nothing), then at most 64 of them, with a note. A real image
# names fewer than ten; an image config of 100,000 entries would make every library
# lookup of the diagnosis walk all of them.
MAX_SEARCH_DIRS = 64
# Interpreter prefixes tried (a PATH entry's parent, then /usr/local, /usr, /opt/conda).
MAX_PREFIXES = 32
# What the report repeats of the command line, the versions and each cause: a 8 MiB
# image config or a METADATA claiming a 1 MB version cannot make a huge report.
MAX_ARGV_CHARS = 64 * 1024
MAX_ARG_CHARS = 1024
MAX_FIELD_CHARS = 4096
MAX_VERSION_CHARS = 128
MAX_LIBRARIES = 100


class ScanError(Exception):
    """Bad input: not an image, unreadable or truncated. Exit status 2."""


@dataclass
class Cause:
    module: str | None
    classification: str
    cause: str
    fix: str
    proven: bool
    missing_libraries: list[str]
    evidence: list[str]


@dataclass
class Result:
    image: str
    kind: str
    ref: str | None
    digest: str | None  # the manifest's: a registry's and a pulled image's digest
    config_digest: str | None  # the image ID: what the kubelet shows for imported images
    argv: list[str]
    argv_from: str  # "--argv" | "image config" | "any SGLang launch"
    request: str
    python: str | None
    site: list[str]
    versions: dict[str, str]
    causes: list[Cause]
    gpu_only: list[str]
    notes: list[str] = field(default_factory=list)
    # A multi-platform image: the platform's manifest inside the index (``digest``).
    platform_digest: str | None = None
    layers: list[str] = field(default_factory=list)  # compression of each, bottom first
    entries: int = 0
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return 1 if self.causes else 0


def build_tree(source: Source, budget: Budget | None = None) -> tuple[Tree, list[str]]:
    tree = Tree(budget=budget) if budget is not None else Tree()
    kinds = []
    try:
        if source.rootfs is not None:
            layers.walk_rootfs(tree, source.rootfs, tree.budget)
            kinds.append("directory")
        for layer in source.layers:
            kinds.append(layers.apply_layer(tree, layer, tree.budget))
    except (TreeError, SourceError, BudgetError) as exc:
        raise ScanError(str(exc)) from None
    return tree, kinds


def _section(config: dict[str, Any]) -> dict[str, Any]:
    c = config.get("config")
    return c if isinstance(c, dict) else {}


def _env(config: dict[str, Any]) -> dict[str, str]:
    c = _section(config)
    out: dict[str, str] = {}
    for item in c.get("Env") or []:
        if isinstance(item, str) and "=" in item:
            k, _, v = item.partition("=")
            out[k] = v
    out.setdefault("PATH", _DEFAULT_PATH)
    return out


def _command(config: dict[str, Any]) -> list[str]:
    c = _section(config)
    argv: list[str] = []
    for key in ("Entrypoint", "Cmd"):
        part = c.get(key)
        if isinstance(part, list):
            argv += [str(a) for a in part]
        elif isinstance(part, str):
            argv += ["/bin/sh", "-c", part]
    return argv


def _dirs(value: str) -> list[str]:
    """The absolute entries of a ``:`` list, each once, in order (linear)."""
    seen: set[str] = set()
    out = []
    for d in value.split(":"):
        if d.startswith("/") and d not in seen:
            seen.add(d)
            out.append(d)
    return out


def search_env(env: dict[str, str], tree: Tree) -> tuple[dict[str, str], list[str]]:
    """``env`` as the diagnosis searches it: PATH and LD_LIBRARY_PATH reduced to the
    directories that exist in the image, each once (what a search finds is the same),
    at most MAX_SEARCH_DIRS of them; and notes on what was cut."""
    out, notes = dict(env), []
    for key in ("PATH", "LD_LIBRARY_PATH"):
        if key not in env:
            continue
        dirs = [d for d in _dirs(env[key]) if tree.isdir(d)]
        if len(dirs) > MAX_SEARCH_DIRS:
            notes.append(f"{key} names {len(dirs)} directories of the image; the first "
                         f"{MAX_SEARCH_DIRS} are searched")
            dirs = dirs[:MAX_SEARCH_DIRS]
        out[key] = ":".join(dirs)
    return out, notes


def python_site(tree: Tree, env: dict[str, str]) -> tuple[str | None, list[str]]:
    """The worker's Python (``3.N``) and its ``sys.path`` entries that hold packages.

    Searched where interpreters live: the prefixes of the image's PATH (a venv's bin
    first if the image puts it first), then /usr/local, /usr and /opt/conda. The
    version chosen is the first whose site directory holds torch, SGLang or mooncake.
    """
    prefixes: list[str] = []
    seen: set[str] = set()
    for d in [*_dirs(env.get("PATH", _DEFAULT_PATH)), "/usr/local/bin", "/usr/bin",
              "/opt/conda/bin"]:
        p = posixpath.dirname(posixpath.normpath(d))
        if p not in seen:
            seen.add(p)
            prefixes.append(p)
    if len(prefixes) > MAX_PREFIXES:
        prefixes = [*prefixes[:MAX_PREFIXES - 3], "/usr/local", "/usr", "/opt/conda"]
    candidates: list[tuple[str, str]] = []  # (version, dir)
    for prefix in prefixes:
        lib = posixpath.join(prefix, "lib")
        try:
            names = sorted(tree.listdir(lib))
        except OSError:
            continue
        for n in names:
            m = _PY_RE.match(n)
            if not m:
                continue
            for sub in ("site-packages", "dist-packages"):
                d = posixpath.join(lib, n, sub)
                if tree.isdir(d) and (n, d) not in candidates:
                    candidates.append((n[len("python"):], d))
    version = None
    for v, d in candidates:
        if any(tree.exists(posixpath.join(d, pkg)) for pkg in ("torch", "sglang", "mooncake")):
            version = v
            break
    if version is None and candidates:
        version = candidates[0][0]
    site = [d for v, d in candidates if v == version]
    if version and tree.isdir(f"/usr/lib/python{version}") and tree.isdir(
            "/usr/lib/python3/dist-packages"):
        site.append("/usr/lib/python3/dist-packages")  # Debian's python3
    extra = [p for p in _dirs(env.get("PYTHONPATH", "")) if tree.isdir(p)][:MAX_SEARCH_DIRS]
    return version, extra + site


def suffixes(version: str | None, config: dict[str, Any]) -> list[str]:
    arch = _ARCH.get(str(config.get("architecture") or "amd64"), "x86_64")
    tag = (version or "3").replace(".", "")
    return [f".cpython-{tag}-{arch}-linux-gnu.so", ".abi3.so", ".so"]


def _shown_argv(argv: list[str]) -> tuple[list[str], str | None]:
    """The command line as the report repeats it: each argument and the whole cut."""
    out: list[str] = []
    total = 0
    for a in argv:
        a = cut(a, MAX_ARG_CHARS)
        total += len(a)
        if total > MAX_ARGV_CHARS:
            return out, (f"the command line has {len(argv)} arguments; the report shows "
                         f"the first {len(out)}")
        out.append(a)
    return out, None


def cap_notes(notes: list[str], dropped: int = 0) -> list[str]:
    """At most MAX_NOTES notes of MAX_NOTE_CHARS each, then one that counts the rest
    (``dropped``: those the tree already only counted)."""
    kept = [cut(n, MAX_NOTE_CHARS) for n in notes[:MAX_NOTES]]
    more = max(0, len(notes) - MAX_NOTES) + dropped
    if more:
        kept.append(f"{more} more notes not shown")
    return kept


def scan(image: str, argv: list[str] | None = None, ref: str | None = None,
         platform: str = "linux/amd64", budget: Budget | None = None) -> Result:
    """Judge ``image``; ScanError (exit 2) for bad input or a spent budget."""
    started = time.monotonic()
    budget = budget or Budget()
    try:
        source = open_source(image, ref, platform, budget)
    except (SourceError, BudgetError) as exc:
        raise ScanError(str(exc)) from None
    tree, kinds = build_tree(source, budget)
    try:
        return _judge(image, source, tree, kinds, argv, started)
    except (TreeError, BudgetError) as exc:
        raise ScanError(str(exc)) from None


def _judge(image: str, source: Source, tree: Tree, kinds: list[str],
           argv: list[str] | None, started: float) -> Result:
    env = _env(source.config)
    version, site = python_site(tree, env)
    release = inventory.dist_version("sglang", site, tree) if site else None
    if argv:
        chosen, said = list(argv), "--argv"
    else:
        chosen, said = _command(source.config), "image config"
    request = cmdline.read(chosen, env=env, release=release,
                           read_config=lambda p: tree.read_text(p, MAX_CONFIG_BYTES))
    if not request.requested and said != "--argv":
        chosen, said = list(ANY_LAUNCH), "any SGLang launch"
        request = cmdline.read(chosen, env=env, release=release)
    tree.budget.check()
    notes: list[str] = []  # the scan's own first, then the diagnosis', then the tree's
    causes: list[Cause] = []
    versions: dict[str, str] = {}
    gpu_only = list(static.GPU_ONLY)
    if not request.requested:
        notes.append("the command line given with --argv does not request "
                     "--elastic-ep-backend mooncake: nothing to check")
    elif not site:
        causes.append(Cause(None, "python-not-found", "no Python site-packages directory in "
                            "the image (looked under the PATH prefixes, /usr/local, /usr, "
                            "/opt/conda)", "install SGLang's Python environment in the image",
                            True, [], []))
    else:
        searched, left_out = search_env(env, tree)
        notes += left_out
        workdir = _section(source.config).get("WorkingDir")
        img = static.Image(tree, site, suffixes(version, source.config), searched,
                           driver_mounted=True,
                           workdir=workdir if isinstance(workdir, str) and workdir else None)
        facts = static.read(img, request)
        tree.budget.check()
        notes += facts.notes
        gpu_only = [cut(g, MAX_FIELD_CHARS) for g in facts.gpu_only[:MAX_LIBRARIES]]
        if facts.outcome is not None:
            versions = {cut(k, MAX_VERSION_CHARS): cut(v, MAX_VERSION_CHARS)
                        for k, v in list(dict(diagnosis.versions(facts.outcome)).items())[:16]}
        for f in facts.findings[:MAX_LIBRARIES]:
            v = f.verdict
            libs = [cut(x, MAX_ARG_CHARS) for x in list(v.missing_libraries)[:MAX_LIBRARIES]]
            evidence = [cut(x, MAX_FIELD_CHARS) for x in list(v.evidence)[:MAX_LIBRARIES]]
            causes.append(Cause(f.module, v.classification, cut(v.cause, MAX_FIELD_CHARS),
                                cut(v.fix, MAX_FIELD_CHARS), f.proven, libs, evidence))
    shown, cut_argv = _shown_argv(chosen)
    if cut_argv:
        notes.insert(0, cut_argv)
    notes += tree.notes
    return Result(
        image=image, kind=source.kind, digest=source.digest,
        ref=cut(source.ref, MAX_FIELD_CHARS) if source.ref else None,
        config_digest=source.config_digest, argv=shown,
        argv_from=said, request=cut(request.describe(), MAX_FIELD_CHARS)
        if request.requested else "not requested",
        python=version, site=site, versions=versions, causes=causes, gpu_only=gpu_only,
        notes=cap_notes(notes, tree.dropped_notes), layers=kinds, entries=tree.entries,
        seconds=round(time.monotonic() - started, 3), platform_digest=source.platform_digest)
