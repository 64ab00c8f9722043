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
import os
import re

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


def _metadata_version(dist):
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    try:
        return metadata.version(dist)
    except Exception:  # noqa: BLE001 - PackageNotFoundError or a broken dist-info
        return None


def _module_of(node_module, alias_name):
    """Module named by ``from <node_module> import <alias_name>`` if it is ep/pg."""
    if node_module in MODULES:
        return node_module
    if node_module == "mooncake" and "mooncake." + alias_name in MODULES:
        return "mooncake." + alias_name
    return None


def scan_source(text):
    """{module: set(names)} of mooncake.ep / mooncake.pg use in one source file."""
    found = {}
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return _scan_regex(text)
    aliases = {}  # local name -> module
    for node in ast.walk(tree):
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
                    if a.asname:
                        aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in aliases:
            found[aliases[value.id]].add(node.attr)
        elif (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
              and value.value.id == "mooncake" and "mooncake." + value.attr in found):
            found["mooncake." + value.attr].add(node.attr)
    return found


def _scan_regex(text):
    # For sources this interpreter cannot parse (newer syntax than it knows).
    found = {}
    for m in re.finditer(r"from\s+mooncake\.(ep|pg)\s+import\s+\(?([\w\s,]+)\)?", text):
        names = {n.strip().split()[0] for n in m.group(2).split(",") if n.strip()}
        found.setdefault("mooncake." + m.group(1), set()).update(names)
    for m in re.finditer(r"from\s+mooncake\s+import\s+(ep|pg)(?:\s+as\s+(\w+))?", text):
        mod = "mooncake." + m.group(1)
        alias = m.group(2) or m.group(1)
        names = set(re.findall(rf"\b{re.escape(alias)}\.(\w+)", text))
        found.setdefault(mod, set()).update(names)
    return found


def requirement():
    version = _metadata_version("sglang")
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return Requirement(None, list(MODULES), {}, "no SGLang installed: either module", True)
    if version is None:
        version = "unknown"
    roots = list(spec.submodule_search_locations or [])
    found = {}
    read = 0
    for root in roots:
        for rel in SOURCES:
            path = os.path.join(root, rel)
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
            except OSError:
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
