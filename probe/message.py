"""The termination message and the JSON report: the probe's output contract.

The kubelet keeps at most 4096 bytes of a container's termination message and
12 KiB for the whole pod, so the verdict is the first line, the fix the last, and
evidence lines in between are dropped from the end first when the budget is
tight. Error texts come from third-party code and may quote the environment, so
no environment variable's value may leave the probe: any that appears is
replaced by ``$NAME`` (the image's variables) or ``$POD_VARIABLE`` (the pod's).
"""

import os
import re

try:
    from . import catalog
except ImportError:  # run as `python3 probe`: the directory itself is on sys.path
    import catalog

PREFIX = "epguard: "
UNUSABLE = PREFIX + "mooncake elastic EP is unusable in this image: "
# A cause that lives in the pod or the node (no driver, no GPU, a crash, a timeout, a
# failed smoke test), not in the image's files: never a verdict about the image.
UNUSABLE_HERE = PREFIX + "mooncake elastic EP is unusable in this pod: "
SCOPE = "scope: "
IMAGE, ENVIRONMENT = "image", "environment"
USABLE = PREFIX + "mooncake elastic EP is usable: "
# Usable only with the pod's own variables (the image's environment fails): this pod
# starts, but it is no verdict about the image (webhook/engine/outcome.py learns nothing).
USABLE_HERE = PREFIX + "mooncake elastic EP is usable in this pod: "
NOTHING = PREFIX + "nothing to check: "
# --files-only (a preflight pod in the worker's image, on a node without a GPU): the
# image's files prove no cause. Not a pass: the import, the driver, the GPU and the
# backends are left for the probe on the GPU node, so webhook/engine/outcome.py learns
# nothing about the image from it.
FILES_CLEAR = PREFIX + "no image cause in this image's files: "

# The pod's own variables reach the probe under this prefix (webhook/engine/injection.py
# renames every ``env`` entry and prefixes every ``envFrom``; probe/sandbox.py reads them).
POD_PREFIX = "EPGUARD_POD_"
# What a pod variable's value is replaced by: never its name, which the tenant chose (any
# printable text since Kubernetes 1.32) and which would otherwise be written into an
# ImageVerdict every tenant reads (found by a review helper).
POD_VALUE = "$POD_VARIABLE"

# Words the probe writes itself (the backend it checks, the packages and modules it
# names): never a secret. Masking them made every message of a pod with
# ``EP_BACKEND=mooncake`` in its env unreadable and unlearnable ("epguard: $EP_BACKEND
# elastic EP is …", found by a review helper's case).
_PUBLIC = frozenset(("mooncake", "mooncake.pg", "mooncake.ep", catalog.CUDA12, catalog.CUDA13,
                     catalog.CUDA12 + "-non-cuda", "sglang", "sglang.launch_server",
                     "elastic-ep-backend", "--elastic-ep-backend"))
# The heads a message starts with: fixed text, read back by webhook/engine/outcome.py.
_HEADS = (UNUSABLE, UNUSABLE_HERE, USABLE, USABLE_HERE, NOTHING, FILES_CLEAR)

# Values shorter than this are words like "1", "true", "cuda" that occur everywhere;
# they cannot carry a secret, and masking them would garble the message.
_MIN_SECRET = 6
# A version (2.9.1, 12.8, 0.3.13.post1, 2.13.0+cu130): not a secret. (Any value that
# merely started with a digit was taken for one, a UUID-like token included: review
# helper.)
_VERSIONISH = re.compile(r"^[0-9]+(?:\.[0-9]+)+(?:[.+_-]?[A-Za-z0-9]+)*$")


def scrub(text, environ=None):
    environ = os.environ if environ is None else environ
    pairs = []
    for name, value in environ.items():
        value = value.strip()
        if len(value) < _MIN_SECRET or _VERSIONISH.match(value) or value.lower() in _PUBLIC:
            continue
        pairs.append((value, 0, name))
        # Path lists: also each entry, since paths in error texts hold single entries.
        if ":" in value:
            for part in value.split(":"):
                if len(part) >= _MIN_SECRET and not _VERSIONISH.match(part):
                    pairs.append((part, 1, name))
    # Longest first; on a tie a whole value names it better than a path-list entry.
    for value, _, name in sorted(pairs, key=lambda p: (-len(p[0]), p[1], p[2])):
        if value in text:
            text = text.replace(value, POD_VALUE if name.startswith(POD_PREFIX) else "$" + name)
    return text


def _clip(line, limit):
    data = line.encode("utf-8")
    if len(data) <= limit:
        return line
    return data[: max(0, limit - 3)].decode("utf-8", "ignore") + "..."


def _clip_words(line, limit):
    # key=value pairs are parsed by others: drop whole pairs rather than cut one.
    words = line.split(" ")
    while len(words) > 2 and len(" ".join(words).encode("utf-8")) > limit:
        words.pop()
    return " ".join(words)


def _size(line):
    return len(line.encode("utf-8")) + 1


def render(first, evidence, fix, max_bytes):
    """Lines joined, within ``max_bytes``.

    The first line (verdict, and for a failure its scope: "in this image" or "in this
    pod"), a ``versions:`` line and the fix are kept whatever the budget (clipped if need
    be): they are what webhook/engine/outcome.py reads back. Other evidence is kept in order
    while it fits.
    """
    head = next((h for h in _HEADS if first.startswith(h)), "")
    first = (head + scrub(first[len(head):])).replace("\n", " ")
    fix = "fix: " + scrub(fix).replace("\n", " ")
    # (A versions: line holds the image's distributions and versions, read back too.)
    evidence = [(e if e.startswith("versions: ") else scrub(e)).replace("\n", " ")
                for e in evidence]
    budget = max(0, max_bytes)
    pinned = [e for e in evidence if e.startswith("versions: ")][:1]
    evidence = [e for e in evidence if e not in pinned]
    pinned = [_clip_words(e, budget // 2) for e in pinned]
    reserved = sum(_size(e) for e in pinned)
    head = _clip(first, max(40, (budget - reserved) * 3 // 5))
    tail = _clip(fix, max(20, budget - reserved - _size(head) - 1))
    lines = [head] + pinned
    used = _size(head) + reserved + len(tail.encode("utf-8"))
    for e in evidence:
        cost = len(e.encode("utf-8")) + 1
        if used + cost > budget:
            remaining = budget - used - 1
            if remaining > 60:
                lines.append(_clip(e, remaining))
            break
        lines.append(e)
        used += cost
    lines.append(tail)
    out = "\n".join(lines)
    data = out.encode("utf-8")
    if len(data) > budget:
        out = data[:budget].decode("utf-8", "ignore")
    return out


def report(verdict, required_modules, checks, versions, cause, fix, **extra):
    """The ``--json`` document."""
    doc = {
        "verdict": verdict,
        "required_modules": list(required_modules),
        "checks": [{"name": c["name"], "ok": c["ok"], "detail": scrub(str(c["detail"]))}
                   for c in checks],
        "versions": dict(versions),
        "cause": scrub(cause),
        "fix": scrub(fix),
    }
    for k, val in extra.items():
        doc[k] = scrub(val) if isinstance(val, str) else val
    return doc
