"""What the installed SGLang will import from mooncake for elastic EP.

SGLang is never imported (slow, and possibly the broken part): its version comes
from distribution metadata and its needs from its source files read as text.
Up to 0.5.16 it imports ``mooncake.ep`` (as ``from mooncake import ep as
mooncake_ep`` and ``from mooncake.ep import ...``); from 0.5.17 ``mooncake.pg``
with ``set_transfer_engine``. Both spellings are recognised, and for a module
imported under an alias the attributes used through the alias count as names.
"""

import ast
import importlib.util
import posixpath
import re

try:
    from . import files, inventory
except ImportError:  # run as `python3 probe`: the directory itself is on sys.path
    import files
    import inventory

MODULES = ("mooncake.pg", "mooncake.ep")

# Files that hold the elastic-EP mooncake imports in SGLang 0.5.9 .. 0.5.23.
SOURCES = (
    "srt/distributed/parallel_state.py",
    "srt/elastic_ep/elastic_ep.py",
    "srt/distributed/bootstrap.py",
    "srt/model_executor/model_runner.py",
    "srt/distributed/device_communicators/mooncake_transfer_engine.py",
)


class Requirement:
    def __init__(self, version, modules, names, source, either=False):
        self.version = version  # None when SGLang is not installed
        self.modules = modules  # in import order
        self.names = names  # {module: [names]}
        self.source = source  # human-readable: where the requirement came from
        self.either = either  # any one of ``modules`` is enough


def _module_of(node_module, alias_name):
    """Module named by ``from <node_module> import <alias_name>`` if it is ep/pg."""
    if node_module in MODULES:
        return node_module
    if node_module == "mooncake" and "mooncake." + alias_name in MODULES:
        return "mooncake." + alias_name
    return None


# Import statements that can name mooncake.ep / mooncake.pg, at any indentation
# (SGLang imports them lazily inside functions).
_IMPORT_RE = re.compile(
    r"^[ \t]*(?:from[ \t]+mooncake(?:\.(?:ep|pg))?[ \t]+import\b|import[ \t]+mooncake\.(?:ep|pg)\b)"
    r"[^\n]*", re.M)


# One import statement, its lines joined: real ones are under 300 bytes. A longer one
# is skipped (a parenthesis that never closes must not join the rest of the file).
MAX_STATEMENT_BYTES = 4096
# ``name.attr`` and ``name.sub.attr``: every use of a module alias, in one pass.
_ATTR_RE = re.compile(r"(?<![\w.])([^\W\d]\w*)\.(\w+)(?:\.(\w+))?")


def _statements(text):
    """Each matching import statement, with parenthesised or continued lines joined.

    Linear in ``text``: each line is joined to at most one statement, and a match
    inside lines already joined is not read again."""
    after = 0
    for m in _IMPORT_RE.finditer(text):
        if m.start() < after:
            continue
        last = m.group(0).strip()
        parts, end, size = [last], m.end(), len(last)
        depth = last.count("(") - last.count(")")
        whole = True
        while last.endswith("\\") or depth > 0:
            nl = text.find("\n", end + 1)
            if nl < 0:
                break
            last = text[end + 1:nl].strip()
            end = nl
            size += len(last) + 1
            if size > MAX_STATEMENT_BYTES:
                whole = False
                break
            parts[-1] = parts[-1].rstrip("\\")
            parts.append(last)
            depth += last.count("(") - last.count(")")
        after = end
        if whole:
            yield " ".join(parts)


def scan_source(text):
    """{module: set(names)} of mooncake.ep / mooncake.pg use in one source file.

    Only the import statements are parsed (with ast), not the whole file: a full
    parse of SGLang's parallel_state.py costs more than the rest of the probe's
    own work, and that time competes with the torch import in the child.
    """
    found = {}
    aliases = {}  # local name -> module
    for stmt in _statements(text):
        try:
            node = ast.parse(stmt).body[0]
        except (SyntaxError, ValueError, IndexError):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if node.module in MODULES:
                    found.setdefault(node.module, set()).add(a.name)
                else:
                    mod = _module_of(node.module, a.name)
                    if mod:
                        found.setdefault(mod, set())
                        aliases[a.asname or a.name] = mod
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    found.setdefault(a.name, set())
                    aliases[a.asname or a.name] = a.name
    # Names used through a module alias: `mooncake_ep.set_host_ip(...)`, or
    # `mooncake.ep.set_host_ip(...)` after `import mooncake.ep`. One pass over the
    # text whatever the number of aliases.
    if aliases:
        for head, name, sub in _ATTR_RE.findall(text):
            if head in aliases:
                found[aliases[head]].add(name)
            elif sub and head + "." + name in aliases:
                found[aliases[head + "." + name]].add(sub)
    return found


def _sglang_roots(fs, path):
    if fs is None:
        try:
            spec = importlib.util.find_spec("sglang")
        except (ImportError, ValueError):
            spec = None
        return list(spec.submodule_search_locations or []) if spec else None
    roots = inventory.package_dirs("sglang", path, fs)
    return roots or None


# SGLang's largest source that names mooncake (parallel_state.py) is ~100 KB.
MAX_SOURCE_BYTES = 4 << 20


def requirement(fs=None, path=None):
    """What the installed SGLang imports; with ``fs``/``path``, the SGLang in another
    root (an image's files) instead of this interpreter's."""
    version = inventory.dist_version("sglang", path, fs)
    roots = _sglang_roots(fs, path)
    fs = fs or files.LIVE
    if roots is None:
        return Requirement(None, list(MODULES), {}, "no SGLang installed: either module", True)
    if version is None:
        version = "unknown"
    found = {}
    read = 0
    for root in roots:
        for rel in SOURCES:
            text = fs.read_text(posixpath.join(root, rel), MAX_SOURCE_BYTES)
            if text is None:
                continue
            read += 1
            for mod, names in scan_source(text).items():
                found.setdefault(mod, set()).update(names)
    if not found:
        why = "SGLang {} sources {}".format(
            version, "name no mooncake module" if read else "unreadable")
        return Requirement(version, list(MODULES), {}, why + ": either module", True)
    modules = [m for m in MODULES if m in found]
    return Requirement(
        version, modules, {m: sorted(found[m]) for m in modules},
        "SGLang {} imports {}".format(version, " and ".join(modules)))
