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

from probe import cmdline, diagnosis, inventory, static
from probe.cli import MAX_CONFIG_BYTES  # SGLang's --config, read as the probe reads it
from webhook.scan import layers
from webhook.scan.sources import Source, SourceError, open_source
from webhook.scan.tree import Tree, TreeError

# What the scan judges when neither --argv nor the image's own command asks for
# mooncake: any SGLang launch with the flag (the image is meant for such workers).
ANY_LAUNCH = ("python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "mooncake")
_ARCH = {"amd64": "x86_64", "arm64": "aarch64", "ppc64le": "powerpc64le", "s390x": "s390x"}
_PY_RE = re.compile(r"^python3\.(\d+)$")
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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
    layers: list[str] = field(default_factory=list)  # compression of each, bottom first
    entries: int = 0
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return 1 if self.causes else 0


def build_tree(source: Source) -> tuple[Tree, list[str]]:
    tree = Tree()
    kinds = []
    try:
        if source.rootfs is not None:
            layers.walk_rootfs(tree, source.rootfs)
            kinds.append("directory")
        for layer in source.layers:
            kinds.append(layers.apply_layer(tree, layer))
    except (TreeError, SourceError) as exc:
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


def python_site(tree: Tree, env: dict[str, str]) -> tuple[str | None, list[str]]:
    """The worker's Python (``3.N``) and its ``sys.path`` entries that hold packages.

    Searched where interpreters live: the prefixes of the image's PATH (a venv's bin
    first if the image puts it first), then /usr/local, /usr and /opt/conda. The
    version chosen is the first whose site directory holds torch, SGLang or mooncake.
    """
    prefixes: list[str] = []
    for d in env.get("PATH", _DEFAULT_PATH).split(":"):
        if d.startswith("/"):
            p = posixpath.dirname(posixpath.normpath(d))
            if p not in prefixes:
                prefixes.append(p)
    for p in ("/usr/local", "/usr", "/opt/conda"):
        if p not in prefixes:
            prefixes.append(p)
    candidates: list[tuple[str, str]] = []  # (version, dir)
    for prefix in prefixes[:32]:
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
    extra = [p for p in env.get("PYTHONPATH", "").split(":") if p.startswith("/")]
    return version, extra + site


def suffixes(version: str | None, config: dict[str, Any]) -> list[str]:
    arch = _ARCH.get(str(config.get("architecture") or "amd64"), "x86_64")
    tag = (version or "3").replace(".", "")
    return [f".cpython-{tag}-{arch}-linux-gnu.so", ".abi3.so", ".so"]


def scan(image: str, argv: list[str] | None = None, ref: str | None = None,
         platform: str = "linux/amd64") -> Result:
    started = time.monotonic()
    try:
        source = open_source(image, ref, platform)
    except SourceError as exc:
        raise ScanError(str(exc)) from None
    tree, kinds = build_tree(source)
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
    notes = list(tree.notes)
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
        img = static.Image(tree, site, suffixes(version, source.config), env,
                           driver_mounted=True)
        facts = static.read(img, request)
        notes += facts.notes
        gpu_only = list(facts.gpu_only)
        if facts.outcome is not None:
            versions = dict(diagnosis.versions(facts.outcome))
        for f in facts.findings:
            v = f.verdict
            causes.append(Cause(f.module, v.classification, v.cause, v.fix, f.proven,
                                list(v.missing_libraries), list(v.evidence)))
    return Result(
        image=image, kind=source.kind, ref=source.ref, digest=source.digest,
        config_digest=source.config_digest, argv=chosen,
        argv_from=said, request=request.describe() if request.requested else "not requested",
        python=version, site=site, versions=versions, causes=causes, gpu_only=gpu_only,
        notes=notes, layers=kinds, entries=tree.entries,
        seconds=round(time.monotonic() - started, 3))
