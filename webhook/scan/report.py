"""The scan's three outputs: the probe's message format, JSON, GitHub annotations.

Text: the first line is the probe's (``epguard: mooncake elastic EP is unusable in
this image: <cause>``) for the first cause, then its evidence, every other cause
with its fix, the checks left to a GPU node, and the fix line last, so that a CI log
reads like the termination message a pod would have shown.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from epguard.probe import diagnosis, message
from epguard.webhook.scan.scanner import Result

NO_IMAGE_CAUSE = message.PREFIX + "no image cause for mooncake elastic EP: "
# A terminal or CI log has room; the kubelet's 4 KiB limit does not apply here.
TEXT_BYTES = 64 * 1024


def _where(r: Result) -> str:
    name = r.ref or r.image
    return f"{name} ({r.kind}{', ' + r.digest if r.digest else ''})"


def text(r: Result) -> str:
    head = [f"image: {_where(r)}",
            f"request: {r.request} (argv from {r.argv_from})",
            f"python: {r.python or 'none'} site: {':'.join(r.site) or 'none'}"]
    gpu = "checked only on a GPU node: " + "; ".join(r.gpu_only)
    notes = ["note: " + n for n in r.notes]
    if not r.causes:
        first = NO_IMAGE_CAUSE + (
            "the image's files show none" if r.request != "not requested"
            else "the command line does not request mooncake")
        if r.versions:
            head.insert(0, diagnosis.versions_line(r.versions))
        return str(message.render(first, [*head, gpu, *notes],
                                  "nothing to fix in the image", TEXT_BYTES))
    primary, others = r.causes[0], r.causes[1:]
    evidence = list(primary.evidence) + head
    for c in others:
        evidence.append(f"also ({c.classification}, {c.module or 'image'}): {c.cause}; "
                        f"fix: {c.fix}")
    evidence += [gpu, *notes]
    fixes = []
    for c in r.causes:
        if c.fix not in fixes:
            fixes.append(c.fix)
    return str(message.render(message.UNUSABLE + primary.cause, evidence, "; ".join(fixes),
                              TEXT_BYTES))


def document(r: Result) -> dict[str, Any]:
    doc = asdict(r)
    for c in doc["causes"]:
        c.pop("evidence", None)
    doc["verdict"] = "unusable" if r.causes else "no-image-cause"
    doc["exit"] = r.exit_code
    doc["message"] = text(r)
    return doc


def as_json(r: Result) -> str:
    return json.dumps(document(r), indent=2) + "\n"


def _escape_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(s: str) -> str:
    return _escape_data(s).replace(":", "%3A").replace(",", "%2C")


def annotation(level: str, title: str, body: str) -> str:
    return f"::{level} title={_escape_property(title)}::{_escape_data(body)}\n"


def github(r: Result) -> str:
    """GitHub Actions workflow commands: an error per cause, a notice for the rest."""
    out = []
    name = r.ref or r.image
    for c in r.causes:
        out.append(annotation("error", f"epguard scan: {c.classification} in {name}",
                              f"{c.cause}. Fix: {c.fix}"))
    if not r.causes:
        out.append(annotation("notice", f"epguard scan: {name}",
                              "no image cause for mooncake elastic EP"))
    out.append(annotation("notice", "epguard scan: left to a GPU node", "; ".join(r.gpu_only)))
    for n in r.notes:
        out.append(annotation("warning", "epguard scan", n))
    return "".join(out)


def bad_input(error: str, fmt: str) -> str:
    said = f"epguard: cannot scan: {error}"
    if fmt == "github":
        return annotation("error", "epguard scan: bad input", said)
    if fmt == "json":
        return json.dumps({"verdict": "error", "exit": 2, "error": error}, indent=2) + "\n"
    return said + "\n"
