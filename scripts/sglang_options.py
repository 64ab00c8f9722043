#!/usr/bin/env python3
"""Extract SGLang's real option table from every cached SGLang release.

    .venv/bin/python scripts/sglang_options.py            # refresh probe/sglang_options.json
    .venv/bin/python scripts/sglang_options.py --check    # exit 1 if the file is stale

For each overlay ``sglang-*`` under $EPGUARD_CACHE/realpkgs/overlays (written by
scripts/tools.d/30-realpkgs.sh), this runs the cached torch environment's Python with
that release (and the few pure-Python packages its import chain needs) on PYTHONPATH,
builds the parser exactly as SGLang's ``prepare_server_args`` does
(``ServerArgs.add_cli_args(argparse.ArgumentParser())``) and records, for every option,
its names and aliases and how many values it takes (argparse's own ``nargs``: 0 for
``store_true`` and the like, null for one value), plus the choices of
``--elastic-ep-backend``. Releases already in the file and not cached here are kept, so
the table only grows.

probe/cmdline.py reads the file (the probe ships it into images), so the reader's truth
is SGLang's parser, never a hand-kept list of flags.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "probe" / "sglang_options.json"
CACHE = Path(os.environ.get("EPGUARD_CACHE", Path.home() / ".cache" / "epguard")) / "realpkgs"
TORCH_PYTHON = CACHE / "torch-2.13.0" / "bin" / "python"
DEPS = CACHE / "overlays" / "sglang-parser-deps"

# Runs inside the real-package environment, one release at a time: SGLang's parser,
# built as prepare_server_args builds it.
BUILD = r"""
import argparse, importlib.metadata, json, logging, sys
logging.disable(logging.CRITICAL)
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(parser)
"""
TABLE = BUILD + r"""
options, choices = [], []
for action in parser._actions:
    if not action.option_strings:
        continue
    options.append([action.nargs] + list(action.option_strings))
    if "--elastic-ep-backend" in action.option_strings:
        choices = [str(c) for c in (action.choices or [])]
table = {"version": importlib.metadata.version("sglang"), "options": options,
         "backend_choices": choices}
"""
DUMP = TABLE + r"""
json.dump(table, sys.stdout)
"""
# First line: {"ready": <version>, "table": <what DUMP prints>}; then one JSON argv per
# input line -> {"ok": true, "backend": ...} or {"ok": false, "error": ...}: SGLang's own
# verdict on a command line, for tests/probe/test_sglang_parser.py (which checks the
# shipped table with the same process: one import of each release, not two).
SERVE = TABLE + r"""
class Refused(Exception):
    pass
def error(message):
    raise Refused(message)
parser.error = error
answers = sys.stdout
sys.stdout = sys.stderr  # SGLang's actions may print (deprecations): keep the pipe clean
print(json.dumps({"ready": table["version"], "table": table}), file=answers, flush=True)
for line in sys.stdin:
    try:
        ns = parser.parse_args(json.loads(line))
        out = {"ok": True, "backend": ns.elastic_ep_backend}
    except (Refused, SystemExit, ValueError, TypeError) as exc:
        out = {"ok": False, "error": str(exc)}
    print(json.dumps(out), file=answers, flush=True)
"""


def sglang_overlays() -> list[Path]:
    root = CACHE / "overlays"
    return sorted(p for p in root.glob("sglang-[0-9]*") if (p / ".done").exists())


def parser_path(overlay: Path) -> list[Path]:
    """PYTHONPATH that lets this SGLang release build its parser: the release, the
    transformers version it pins, then the shared dependencies."""
    pins = [
        line.split("==", 1)[1].strip()
        for meta in overlay.glob("sglang-*.dist-info/METADATA")
        for line in meta.read_text().splitlines()
        if line.startswith("Requires-Dist: transformers==")
    ]
    extra = [CACHE / "overlays" / f"transformers-{pins[0]}"] if pins else []
    return [overlay, *extra, DEPS]


def parser_env(overlay: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in parser_path(overlay))
    return env


def dump(overlay: Path) -> dict[str, object]:
    proc = subprocess.run([str(TORCH_PYTHON), "-c", DUMP], env=parser_env(overlay),
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"sglang_options: {overlay.name}: SGLang's parser did not load:\n"
                         f"{proc.stderr[-3000:]}")
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def table(existing: dict[str, object]) -> dict[str, object]:
    releases: dict[str, object] = dict(existing.get("releases", {}))  # type: ignore[call-overload]
    for overlay in sglang_overlays():
        d = dump(overlay)
        releases[str(d["version"])] = {"options": d["options"],
                                       "backend_choices": d["backend_choices"]}
    return {
        "comment": "SGLang's option table per release: [nargs, name, aliases...]. "
                   "Generated by scripts/sglang_options.py; do not edit.",
        "releases": dict(sorted(releases.items())),
    }


def render(doc: dict[str, object]) -> str:
    # One option per line: diffs between releases stay readable.
    releases = doc["releases"]
    assert isinstance(releases, dict)
    lines = ["{", f'  "comment": {json.dumps(doc["comment"])},', '  "releases": {']
    for n, (version, entry) in enumerate(releases.items()):
        lines.append(f"    {json.dumps(version)}: {{")
        lines.append(f'      "backend_choices": {json.dumps(entry["backend_choices"])},')
        lines.append('      "options": [')
        opts = entry["options"]
        for i, o in enumerate(opts):
            lines.append("        " + json.dumps(o) + ("," if i < len(opts) - 1 else ""))
        lines.append("      ]")
        lines.append("    }" + ("," if n < len(releases) - 1 else ""))
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the shipped table differs from the cached releases")
    opts = ap.parse_args()
    if not TORCH_PYTHON.exists() or not sglang_overlays():
        print("sglang_options: no cached SGLang releases; run `make tools` first",
              file=sys.stderr)
        return 2
    existing = json.loads(OUT.read_text()) if OUT.exists() else {}
    text = render(table(existing))
    if opts.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"sglang_options: {OUT.relative_to(ROOT)} is stale; rerun "
                  "scripts/sglang_options.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"sglang_options: {len(json.loads(text)['releases'])} releases -> "
          f"{OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
