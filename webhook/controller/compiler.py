"""The outage backstop: what of epguard's judgement a ValidatingAdmissionPolicy can hold.

With ``failurePolicy: Ignore`` (the chart's default: epguard must never block a
cluster), a webhook outage means no protection at all. The API server evaluates a
ValidatingAdmissionPolicy itself, with no network hop, so the controller compiles the
part of the judgement CEL can express exactly into one (``controller/backstop.py``
keeps it in the cluster); the webhook stays the judge of everything else.

**Never stricter than the webhook.** Whatever the policy refuses, the webhook refuses
too, with the same reason, remedy and id. Everything here leans that way: when a form
cannot be read exactly in CEL, the policy leaves it to the webhook.

* Images. The policy normalizes the image *as written* the way ``webhook/engine/imageref.py``
  does (``lmsysorg/sglang:v1`` is ``docker.io/lmsysorg/sglang:v1``, ``ubuntu`` is
  ``docker.io/library/ubuntu:latest``), only for images the reference grammar accepts.
  A deny rule's glob becomes a regular expression over that normalized ``name:tag``,
  compiled into the policy (a constant pattern: the API server compiles it once); a
  glob using ``[...]`` and a rule pinning a digest beside a glob stay with the webhook.
* Verdicts. An Unusable verdict is a map key in the parameters: a digest verdict by the
  first 128 bits of its sha256 (hex), a tag verdict by repository then tag, so a lookup
  costs the same with one verdict or 100,000. A tag verdict refuses only an image not
  pinned by digest, and leaves the parameters a minute before the webhook stops trusting
  it (CEL has no clock: the controller removes it).
* Command lines. Only two forms: an argv ``python[3] -m sglang.launch_server …`` or
  ``sglang serve …`` of plain words, and an ``sh -c`` script line of that shape made of
  plain words (no quotes, no ``$(…)``, no redirection, no comment). In both, the flag
  is ``--elastic-ep-backend mooncake`` or ``--elastic-ep-backend=mooncake`` and nothing
  after it starts with ``--el`` (argparse's last value wins, and abbreviations count).
* Only CREATE: the webhook lets an UPDATE keep a problem that was already there; the
  policy cannot compare with the old object as the engine does, and every pod is created.
* Kinds: Pods, and every workload kind described by fixed or ``[]``/``*`` template paths.
  Dynamo and RoleBasedGroup objects (whose templates the engine merges from patches)
  stay with the webhook.

**The parameters** are RefusedImageLists (a cluster-scoped epguard.io kind), sharded: the
bindings' ``paramRef.selector`` selects every shard, and the API server evaluates the
policy once per shard, each with its own CEL cost budget; a refusal by any shard refuses
(k8s.io/apiserver, policy/validating/dispatcher.go: one ``Validate`` per selected param,
every Deny decision collected). An entry's shard is a hash of its key, so an entry stays
in its shard while the others change. Each shard holds a reason table (``r``: each
distinct denial text once) and maps whose values are an index into it, plus the verdict's
object name where the name is not ``sha256-<digest>``/``scan-sha256-<digest>`` (of a
probe's verdict by tag, ``sha256-<digest>-<hash of the tag>``, only ``-<hash>``). The
webhook's message also says where and when the verdict was seen; the backstop's says
"seen failing in this cluster" (per-verdict times would not fit 100,000 verdicts).

**Cost per create.** One policy and three bindings (one per mode; a namespace's mode is
its binding's namespaceSelector), so an object is evaluated once per shard, not once per
mode. The whole judgement is one matchCondition: an object with no container that
mentions ``mooncake`` is let go after a substring test, and an admitted elastic-EP pod
never reaches the validation or its message (the API server evaluates a
messageExpression for every object that reaches the validations, refused or not).
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from epguard.webhook.engine.imageref import HUB_NAMES
from epguard.webhook.engine.namespaces import MODE_LABEL, MODES, Mode
from epguard.webhook.engine.policy import SKIP_ANNOTATION, rule_denial, verdict_denial
from epguard.webhook.engine.rules import Rule, RuleSet
from epguard.webhook.engine.verdicts import (
    TAG_HASH_CHARS,
    Verdict,
    VerdictHit,
    VerdictStore,
    observed,
    rank,
    verdict_keys,
)
from epguard.webhook.engine.workloads import KindSpec, TemplatePath

FLAG = "--elastic-ep-backend"
# The parameters' kind (the chart's CRD): cluster-scoped. Not a ConfigMap: a policy's
# paramKind must be readable cluster-wide by whoever creates the policy, the controller
# must not read every ConfigMap, and the API server converts a typed ConfigMap to CEL by
# reflection on every evaluation, where a custom resource is handed over as it is.
PARAMS_GROUP, PARAMS_VERSION = "epguard.io", "v1alpha1"
PARAMS_KIND, PARAMS_PLURAL = "RefusedImageList", "refusedimagelists"
# Every shard carries this label (value: the backstop's name); the bindings select by it.
SHARD_LABEL = "epguard.io/backstop"
ACTIONS: dict[Mode, str] = {"enforce": "Deny", "warn": "Warn", "audit": "Audit"}

# --- limits, each with its reason ------------------------------------------------------
# A shard's ``data`` as JSON. etcd refuses a request over 1.5 MiB (its default
# --max-request-bytes); the object's metadata and managedFields come on top (the maps are
# ``x-kubernetes-map-type: atomic``, so managedFields name the map, not each key), well
# within the 256 KiB left. Fewer, larger shards: each is one more evaluation per create.
SHARD_BYTES = 1280 * 1024
# Shards the controller may write: each one is one more policy evaluation per create, so
# the count is bounded (64 MiB of parameters: 100,000 verdicts take about 12 MiB).
MAX_SHARDS = 64
# One denial text, as the webhook cuts it.
MAX_MESSAGE = 1024
# Deny rules compiled into the policy (each one is a constant regex or comparison, all
# evaluated per requesting container): a rules ConfigMap beyond this leaves the rest to
# the webhook, counted in the controller's log.
MAX_POLICY_RULES = 200
# A sha256 digest's key: its first 128 bits. Finding another digest with the same first
# 128 bits as a refused one is a second-preimage search of 2^128 (per entry): never.
DIGEST_KEY = 32
# In a reason template, where the verdict's name (or its digest) goes. Removed from the
# texts it is put into, so only the compiler writes it.
NAME_SLOT = "\ue000"
# What a probe's verdict by tag adds to its digest name (verdicts.verdict_name).
_TAG_SUFFIX = re.compile(f"-[0-9a-f]{{{TAG_HASH_CHARS}}}")
# A tag verdict leaves the list this long before the webhook stops trusting it, so the
# policy is never the stricter of the two while the controller catches up.
TAG_MARGIN = dt.timedelta(minutes=1)

EntryKind = Literal["tag", "digest"]


@dataclass(frozen=True, slots=True)
class Entry:
    """One refused image: a digest verdict (``key``: 32 hex characters) or a tag
    verdict (``key``: the normalized repository, ``tag``). ``template`` is the denial
    text with NAME_SLOT where ``name`` (or, when None, the pod's own digest) goes."""

    kind: EntryKind
    key: str
    tag: str
    template: str
    name: str | None

    def shard_key(self) -> bytes:
        return f"{self.kind}\0{self.key}\0{self.tag}".encode()


@dataclass
class Shard:
    """One RefusedImageList's ``data``."""

    reasons: list[str] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)
    tags: dict[str, dict[str, str]] = field(default_factory=dict)
    _index: dict[str, int] = field(default_factory=dict, repr=False)

    def add(self, e: Entry) -> None:
        i = self._index.get(e.template)
        if i is None:
            i = self._index[e.template] = len(self.reasons)
            self.reasons.append(e.template)
        value = str(i) if e.name is None else f"{i} {e.name}"
        if e.kind == "digest":
            self.digests[e.key] = value
        else:
            self.tags.setdefault(e.key, {})[e.tag] = value

    def data(self) -> dict[str, Any]:
        return {"r": self.reasons, "d": self.digests, "t": self.tags}


@dataclass(frozen=True, slots=True)
class Params:
    shards: tuple[dict[str, Any], ...]  # each shard's ``data``, shard i at index i
    kept: int
    # Entries that did not fit in MAX_SHARDS shards (still refused by the webhook).
    dropped: int
    # When a tag verdict leaves the list: the controller recompiles then.
    next_change: dt.datetime | None


# --- images as written -------------------------------------------------------------

# The reference grammar (webhook/engine/imageref.py), as RE2: an image the webhook cannot parse
# is never refused by it, so the policy must not refuse it either.
_DOMAIN_C = r"[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?"
_PATH_C = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
VALID_IMAGE = (
    rf"^({_DOMAIN_C}(\.{_DOMAIN_C})*(:[0-9]+)?/)?{_PATH_C}(/{_PATH_C})*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$"
)
# imageref.MAX_NAME_LENGTH: a longer normalized name is not a reference.
MAX_NAME = 255
_SHA256 = re.compile(r"^sha256:[0-9a-f]{64}$")


def glob_regex(glob: str) -> str | None:
    """fnmatch's ``*`` and ``?`` over a normalized ``name:tag`` as an anchored RE2; None
    for a class (``[...]``), whose fnmatch reading RE2 does not share exactly."""
    out: list[str] = []
    for ch in glob:
        if ch == "*":
            out.append(".*")
        elif ch == "?":
            out.append(".")
        elif ch in "[]":
            return None
        else:
            out.append(re.escape(ch))
    return "^" + "".join(out) + "$"


def _one_line(text: str) -> str:
    return " ".join(text.split())[:MAX_MESSAGE]


@dataclass(frozen=True, slots=True)
class RuleCheck:
    """A deny rule as the policy tests it: ``regex`` over the normalized name:tag, or
    ``digest`` (64 hex) equal to the pinned one."""

    regex: str | None
    digest: str | None
    message: str


def rule_checks(rules: RuleSet) -> tuple[list[RuleCheck], int]:
    """The deny rules the policy can hold exactly, and how many it cannot."""
    out: list[RuleCheck] = []
    left = 0
    for rule in rules.rules:
        if rule.action != "deny":
            continue
        check = _rule_check(rule)
        if check is None or len(out) >= MAX_POLICY_RULES:
            left += 1
            continue
        out.append(check)
    return out, left


def _rule_check(rule: Rule) -> RuleCheck | None:
    message = _one_line(rule_denial(rule))
    if rule.digest is not None:
        # A digest beside a glob narrows the rule to both (the webhook's); alone, exact.
        if rule.image is not None or not _SHA256.match(rule.digest):
            return None
        return RuleCheck(None, rule.digest.removeprefix("sha256:"), message)
    regex = glob_regex(rule.image or "")
    return None if regex is None else RuleCheck(regex, None, message)


def _clean(text: str | None) -> str | None:
    return None if text is None else text.replace(NAME_SLOT, "?")


def _template(v: Verdict, by_digest: bool, derived: str | None) -> str:
    """The verdict's denial with NAME_SLOT for its name (after ``derived``, when the name
    is that prefix and the digest); no pod and no time (the webhook says them; they would
    make every text distinct)."""
    return _template_of(v.source, v.reason, v.fix, v.recorded_by, by_digest, derived)


@functools.lru_cache(maxsize=4096)
def _template_of(
    source: str,
    reason: str,
    fix: str,
    recorded_by: str | None,
    by_digest: bool,
    derived: str | None,
) -> str:
    bare = Verdict(
        object_name=(derived or "") + NAME_SLOT,
        image="",
        ref=None,
        digest=None,
        usable=False,
        reason=_clean(reason) or "",
        last_seen=None,
        pod=None,
        source=source,
        recorded_by=_clean(recorded_by),
        fix=_clean(fix) or "",
    )
    return " ".join(verdict_denial(VerdictHit(bare, "deny", by_digest)).split())[:MAX_MESSAGE]


def _derived_prefix(v: Verdict, digest: str) -> tuple[str | None, str | None]:
    """(``sha256-`` or ``scan-sha256-``, what to store of the name) when the verdict's
    name is that plus the digest's hex (the probe's and the scan's own names): nothing,
    or only the ``-<hash of the tag>`` a probe's verdict by tag ends in
    (verdicts.verdict_name). (None, the whole name) for any other name."""
    hexd = digest.removeprefix("sha256:")
    for prefix in ("sha256-", "scan-sha256-"):
        if v.object_name == prefix + hexd:
            return prefix, None
    rest = v.object_name.removeprefix("sha256-" + hexd)
    if rest != v.object_name and _TAG_SUFFIX.fullmatch(rest):
        return "sha256-", rest
    return None, v.object_name


def verdict_entries(
    store: VerdictStore, now: dt.datetime
) -> tuple[list[Entry], dt.datetime | None]:
    """The Unusable verdicts the webhook refuses by, and when the next tag one expires."""
    index = EntryIndex(store.tag_ttl, now)
    for kind, key, v in store.winners():
        index.answer(kind, key, v)
    return index.entries()


# One key's answer, compact: the newest verdict's time (a POSIX timestamp) and object
# name (for ties, as verdicts.rank orders them), its denial template (None when it
# refuses nothing the policy can read: Usable, no time, an unreadable tag), and the name
# to write beside the entry (None when the name is derived from the digest).
_Answer = tuple[float, str, str | None, str | None]


class EntryIndex:
    """The newest verdict per key, held as the entry it compiles to.

    Fed one verdict at a time (the controller feeds it a list page at a time), it keeps
    one small tuple per key, never the verdicts: about 0.5 KB per verdict (a digest key
    and a tag key), where the webhook's store holds whole verdicts (1.4 KB each) and stops
    at verdicts.MAX_VERDICTS. The newest verdict of a key answers for it, exactly as in
    the webhook's store (verdicts.rank). Digests are keyed by the 128 bits the policy
    reads; a digest the policy cannot read (not sha256) is never an entry, whoever wins."""

    def __init__(self, tag_ttl: dt.timedelta, now: dt.datetime) -> None:
        self.tag_ttl = tag_ttl
        self.now = now
        self.verdicts = 0
        self._digests: dict[bytes, _Answer] = {}
        self._tags: dict[str, _Answer] = {}

    def add(self, v: Verdict) -> None:
        """One verdict, as the webhook's store would hold it (its time no later than now)."""
        self.verdicts += 1
        v = observed(v, self.now)
        for kind, key in verdict_keys(v):
            self.answer(kind, key, v)

    def answer(self, kind: str, key: str, v: Verdict) -> None:
        at, _ = rank(v)
        seen = at.timestamp()
        if kind == "digest":
            if not _SHA256.match(key):
                return  # the policy reads sha256 digests only
            digest = bytes.fromhex(key[len("sha256:") : len("sha256:") + DIGEST_KEY])
            held = self._digests.get(digest)
            if held is not None and (held[0], held[1]) >= (seen, v.object_name):
                return
            prefix, named = _derived_prefix(v, key)
            template = None if v.usable else _template(v, True, prefix)
            self._digests[digest] = (seen, v.object_name, template, named)
            return
        held = self._tags.get(key)
        if held is not None and (held[0], held[1]) >= (seen, v.object_name):
            return
        repo, sep, tag = key.rpartition(":")
        readable = bool(sep) and "/" not in tag and len(repo) <= MAX_NAME
        refuses = readable and not v.usable and v.last_seen is not None
        template = _template(v, False, None) if refuses else None
        self._tags[key] = (seen, v.object_name, template, v.object_name)

    def entries(self) -> tuple[list[Entry], dt.datetime | None]:
        """The entries, and when the next tag entry leaves (the controller recompiles):
        a tag verdict leaves TAG_MARGIN before the webhook stops trusting it."""
        out = [
            Entry("digest", digest.hex(), "", template, named)
            for digest, (_, _, template, named) in self._digests.items()
            if template is not None
        ]
        now, stay = self.now.timestamp(), (self.tag_ttl - TAG_MARGIN).total_seconds()
        next_change: float | None = None
        for key, (seen, _, template, named) in self._tags.items():
            if template is None or seen + stay <= now:
                continue
            repo, _, tag = key.rpartition(":")
            out.append(Entry("tag", repo, tag, template, named))
            next_change = seen + stay if next_change is None else min(next_change, seen + stay)
        leaves = None if next_change is None else dt.datetime.fromtimestamp(next_change, dt.UTC)
        return out, leaves


def _hash(e: Entry) -> int:
    """64 bits of the entry's key: with ``count`` shards its shard is ``hash % count``."""
    return int.from_bytes(hashlib.blake2b(e.shard_key(), digest_size=8).digest(), "big")


# What the API server writes for these in a stored object (Go's encoding/json escapes
# them for HTML): 6 bytes each.
_GO_ESCAPED = ("<", ">", "&", "\u2028", "\u2029")


def _json_bytes(text: str) -> int:
    """The most bytes ``text`` takes as a JSON string, in the request (the client escapes
    every non-ASCII character: `é` is `\\u00e9`, 6 bytes; its separators' spaces come on
    top, ~2 bytes an entry, well within the API server's 3 MiB body limit) and as the API
    server stores it (`<` is `\\u003c`). Counted as UTF-8, a shard of 1.15 MB of `é` was a 3.4 MB
    request, past the API server's body limit, and the backstop stopped following the
    verdicts (review helper)."""
    if text.isascii() and text.isprintable() and not any(c in text for c in '"\\<>&'):
        return len(text) + 2
    return len(json.dumps(text)) + 5 * sum(text.count(c) for c in _GO_ESCAPED)


def shard_entries(entries: Sequence[Entry]) -> tuple[list[Shard], int]:
    """The fewest shards under SHARD_BYTES each (an entry's shard is a hash of its key
    modulo the count, so it stays in its shard while the count stays); entries past
    MAX_SHARDS are dropped and counted."""
    # What each entry and each shared part (a template, a repository) adds to a shard's
    # JSON, so a count is tried without serializing.
    shared: dict[str, int] = {}
    hashes = [_hash(e) for e in entries]
    costs: list[int] = []
    for e in entries:
        value = 4 + (len(e.name) + 1 if e.name is not None else 0)
        if e.kind == "digest":
            costs.append(len(e.key) + value + 6)
        else:
            costs.append(_json_bytes(e.tag) + value + 4)
            if e.key not in shared:
                shared[e.key] = _json_bytes(e.key) + 4
        if e.template not in shared:
            shared[e.template] = _json_bytes(e.template) + 1

    def place(count: int, keep: bool) -> tuple[bool, list[Shard], int]:
        load = [32] * count
        seen: list[set[str]] = [set() for _ in range(count)]
        shards = [Shard() for _ in range(count)] if keep else []
        dropped = 0
        for e, h, cost in zip(entries, hashes, costs, strict=True):
            i = h % count
            parts = [
                k for k in (e.template, e.key if e.kind == "tag" else "") if k and k not in seen[i]
            ]
            cost += sum(shared[k] for k in parts)
            if load[i] + cost > SHARD_BYTES:
                if not keep:
                    return False, [], 0
                dropped += 1
                continue
            load[i] += cost
            seen[i].update(parts)
            if keep:
                shards[i].add(e)
        return True, shards, dropped

    # A first guess from the total (shared parts once), then one more shard at a time.
    total = sum(costs) + sum(shared.values())
    count = min(MAX_SHARDS, max(1, -(-total // SHARD_BYTES)))
    while count < MAX_SHARDS and not place(count, keep=False)[0]:
        count += 1
    _, shards, dropped = place(count, keep=True)
    return shards, dropped


def compile_params(store: VerdictStore | EntryIndex, now: dt.datetime) -> Params:
    """The parameters: every Unusable verdict the policy can read, sharded."""
    if isinstance(store, EntryIndex):
        entries, next_change = store.entries()
    else:
        entries, next_change = verdict_entries(store, now)
    entries.sort(key=lambda e: (e.kind, e.key, e.tag))
    shards, dropped = shard_entries(entries)
    return Params(tuple(s.data() for s in shards), len(entries) - dropped, dropped, next_change)


# --- command lines -------------------------------------------------------------------

# A word the kubelet passes as is (no $(VAR)) and the regex can split on spaces.
_SAFE_TOKEN = r"^[A-Za-z0-9_./:=@,+%-]+$"
_LAUNCH = r"(python[0-9.]*( -[uBOsSEI]+)* -m sglang\.launch_server|sglang serve)"
DIRECT = rf"^([A-Za-z0-9_./-]*/)?{_LAUNCH}( [^ ]+)* {FLAG}(=| )mooncake( [^ ]+)*$"
# A plain script word: no quotes, backslashes, $(…), backticks, redirections or comments.
_WORD = r"[A-Za-z0-9_./:=@,+%${}-]+"
_LAUNCH_S = (
    r"(python[0-9.]*([ \t]+-[uBOsSEI]+)*[ \t]+-m[ \t]+sglang\.launch_server|sglang[ \t]+serve)"
)
SCRIPT = (
    rf"(^|[\n;&|])[ \t]*(exec[ \t]+)?([A-Za-z0-9_./-]*/)?{_LAUNCH_S}([ \t]+{_WORD})*"
    rf"[ \t]+{FLAG}(=|[ \t]+)mooncake([ \t]+{_WORD})*[ \t]*($|[\n;&|])"
)
LATER = rf"{FLAG}(=|[ \t]+)mooncake[\s\S]*--el"
SHELL = r"^(/usr)?(/bin/)?(ba|da)?sh$"


def _cel(text: str) -> str:
    """A CEL single-quoted string literal: every control character escaped (a raw
    carriage return in a rule's image pattern made the whole policy fail to compile, and
    the backstop froze: review helper)."""
    body = text.replace("\\", "\\\\").replace("'", "\\'")
    return "'" + _CONTROL_CHAR.sub(lambda m: f"\\x{ord(m.group()):02x}", body) + "'"


# CEL's \xHH is a code point below 256: every C0 control, DEL and the C1 controls.
_CONTROL_CHAR = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def requests_mooncake(c: str) -> str:
    """CEL: container expression ``c`` asks for mooncake in a form read exactly."""
    argv = (
        f"((has({c}.command) ? {c}.command : []) + (has({c}.args) ? {c}.args : []))"
        ".map(t, string(t))"
    )
    script = f"{argv}[2].replace('\\\\\\n', ' ')"
    direct = (
        f"({argv}.all(t, t.matches({_cel(_SAFE_TOKEN)})) && "
        f"{argv}.join(' ').matches({_cel(DIRECT)}) && "
        f"!{argv}.join(' ').matches({_cel(LATER)}))"
    )
    shell = (
        f"(size({argv}) >= 3 && {argv}[0].matches({_cel(SHELL)}) && "
        f"{argv}[1].matches('^-[a-zA-Z]*c[a-zA-Z]*$') && "
        f"{script}.matches({_cel(SCRIPT)}) && !{script}.matches({_cel(LATER)}))"
    )
    return f"({direct} || {shell})"


# --- where the containers are ------------------------------------------------------


def _skipped(t: str) -> str:
    return (
        f"(has({t}.metadata) && has({t}.metadata.annotations) && "
        f"{_cel(SKIP_ANNOTATION)} in {t}.metadata.annotations)"
    )


def _pod_spec_containers(specs: str) -> str:
    """CEL: list of pod-spec expressions → the list of their (init) containers."""
    return (
        f"{specs}.map(s, (has(s.initContainers) ? s.initContainers : []) + "
        "(has(s.containers) ? s.containers : [])).flatten()"
    )


def _walk(path: TemplatePath, allow_skip: bool) -> str:
    """CEL: the list of containers a template path reaches in ``object``.

    ``dyn(object)``: the kube-controller-manager type-checks the policy against each
    kind it matches (for the policy's status), and with ``object`` typed, every
    branch's fields are undefined on the other kinds; rendering those errors, each with
    the whole expression, took 98 of its CPU seconds per generation of the policy on
    the 2-core node, against 12 with ``dyn`` (bench/node_timings.py). It changes nothing
    in admission, where ``object`` is dynamic anyway."""
    values = "[dyn(object)]"
    for seg in path.path.split("."):
        if seg == "*":
            values = f"{values}.filter(x, type(x) == map).map(x, x.map(k, x[k])).flatten()"
        elif seg.endswith("[]"):
            f = seg[:-2]
            values = f"{values}.filter(x, has(x.{f})).map(x, x.{f}).flatten()"
        else:
            values = f"{values}.filter(x, has(x.{seg})).map(x, x.{seg})"
    if path.shape == "container":
        return values
    if path.shape == "template":
        kept = f"{values}.filter(t, !{_skipped('t')})" if allow_skip else values
        values = f"{kept}.filter(t, has(t.spec)).map(t, t.spec)"
    return _pod_spec_containers(values)


# Built-in kinds with fixed template paths. Dynamo and RoleBasedGroup are left out (the
# engine merges their templates from patches; CEL cannot do that exactly).
_FIXED: tuple[tuple[str, str, str, tuple[str, ...], str], ...] = (
    ("", "Pod", "pods", ("v1",), "spec"),
    ("", "PodTemplate", "podtemplates", ("v1",), "template"),
    ("", "ReplicationController", "replicationcontrollers", ("v1",), "spec.template"),
    ("apps", "Deployment", "deployments", ("v1",), "spec.template"),
    ("apps", "StatefulSet", "statefulsets", ("v1",), "spec.template"),
    ("apps", "DaemonSet", "daemonsets", ("v1",), "spec.template"),
    ("apps", "ReplicaSet", "replicasets", ("v1",), "spec.template"),
    ("batch", "Job", "jobs", ("v1",), "spec.template"),
    ("batch", "CronJob", "cronjobs", ("v1",), "spec.jobTemplate.spec.template"),
)
_LWS = ("leaderworkerset.x-k8s.io", "LeaderWorkerSet", "leaderworkersets", ("v1",))


@dataclass(frozen=True, slots=True)
class BackstopConfig:
    """What the chart tells the controller (its values, via flags or env)."""

    params_namespace: str
    name: str = "epguard-backstop"
    default_mode: Mode = "enforce"
    allow_skip: bool = True
    excluded_namespaces: tuple[str, ...] = ("kube-system",)
    kinds: tuple[KindSpec, ...] = ()  # path-described kinds (built-in PATH_KINDS + extra)
    # The webhooks' objectSelector (chart value webhook.objectSelector): an object the
    # webhook is never asked about must not be refused by the backstop either.
    object_selector: dict[str, Any] | None = None


def _kind_containers(config: BackstopConfig) -> tuple[list[dict[str, Any]], str]:
    """The VAP's resource rules, and a CEL expression: the object's containers."""
    rules: dict[tuple[str, str], set[str]] = {}
    branches: list[str] = []

    def add(group: str, kind: str, resource: str, versions: Sequence[str], expr: str) -> None:
        rules.setdefault((group, ",".join(versions)), set()).add(resource)
        branches.append(f"(object.kind == {_cel(kind)} ? {expr} : [])")

    for group, kind, resource, versions, path in _FIXED:
        tp = TemplatePath(path, "podSpec" if kind == "Pod" else "template")
        add(group, kind, resource, versions, _walk(tp, config.allow_skip))
    lws = [
        TemplatePath(f"spec.leaderWorkerTemplate.{side}", "template")
        for side in ("leaderTemplate", "workerTemplate")
    ]
    add(*_LWS, " + ".join(_walk(p, config.allow_skip) for p in lws))
    for spec in config.kinds:
        expr = " + ".join(_walk(p, config.allow_skip) for p in spec.paths) or "[]"
        add(spec.group, spec.kind, spec.resource, spec.versions, expr)
    resource_rules = [
        {
            "apiGroups": [group],
            "apiVersions": versions.split(","),
            "resources": sorted(resources),
            "operations": ["CREATE"],
            "scope": "*",
        }
        for (group, versions), resources in sorted(rules.items())
    ]
    # Group and kind both decide (two CRDs may share a kind name).
    return resource_rules, " + ".join(branches)


# --- the policy ------------------------------------------------------------------------


def _mentions(c: str) -> str:
    """CEL: container ``c`` has a word mentioning mooncake (the cheap test that lets
    every other pod go)."""
    return (
        f"((has({c}.command) && {c}.command.exists(t, string(t).contains('mooncake'))) || "
        f"(has({c}.args) && {c}.args.exists(t, string(t).contains('mooncake'))))"
    )


def _repo(name: str) -> str:
    """CEL: the normalized repository of ``name`` (a valid reference's name as written),
    as imageref._split_domain: the first component is a registry host only if it has a
    dot or a port, is ``localhost`` or has upper case; a host is compared without case
    or the port 443; Docker Hub's names are docker.io, whose one-component names are
    under ``library/``."""
    first = f"{name}.split('/')[0]"
    is_host = (
        f"({name}.contains('/') && ({first}.contains('.') || {first}.contains(':') || "
        f"{first} == 'localhost' || {first}.lowerAscii() != {first}))"
    )
    rest = f"{name}.substring(size({first}) + 1)"
    lower = f"{first}.lowerAscii()"
    host = f"({lower}.endsWith(':443') ? {lower}.substring(0, size({first}) - 4) : {lower})"

    def docker(path: str) -> str:
        return f"('docker.io/' + ({path}.contains('/') ? {path} : 'library/' + {path}))"

    return (
        f"({is_host} ? ({host} in [{', '.join(map(_cel, HUB_NAMES))}] ? "
        f"{docker(rest)} : {host} + '/' + {rest}) : {docker(name)})"
    )


def _expand(value: str, default: str) -> str:
    """CEL: an entry's value (``index``, ``index name`` or ``index -suffix``) → its denial
    text; a suffix follows ``default`` (the pod's digest), a name replaces it."""
    named = f"{value}.split(' ')[1]"
    return (
        f"params.data.r[int({value}.split(' ')[0])].replace({_cel(NAME_SLOT)}, "
        f"{value}.contains(' ') ? ({named}.startsWith('-') ? {default} + {named} : {named})"
        f" : {default})"
    )


def _verdict_hit(x: str) -> str:
    """CEL: the denial of the verdict in this shard for container ``x``, or ''."""
    key = f"{x}[2].substring(0, {DIGEST_KEY})"
    digest = (
        f"(has(params.data.d) && {key} in params.data.d ? "
        f"{_expand(f'params.data.d[{key}]', f'{x}[2]')} : '')"
    )
    empty = "''"
    tag = (
        f"(has(params.data.t) && {x}[3] in params.data.t && {x}[4] in params.data.t[{x}[3]] ? "
        f"{_expand(f'params.data.t[{x}[3]][{x}[4]]', empty)} : '')"
    )
    # Pinned by digest: the digest's verdict only (a tag's verdict may be about other
    # bytes; the webhook reads it only when the digests agree).
    return f"(!has(params.data) ? '' : {x}[2] != '' ? {digest} : {tag})"


def _rule_hits(x: str, checks: Sequence[RuleCheck]) -> str:
    """CEL: the denials of the deny rules container ``x`` matches (shard 0 only, so a
    rule costs one evaluation per create, not one per shard)."""
    if not checks:
        return "[]"
    tests = []
    for c in checks:
        cond = (
            f"{x}[5].matches({_cel(c.regex)})" if c.regex else f"{x}[2] == {_cel(c.digest or '')}"
        )
        tests.append(f"({cond} ? {_cel(c.message)} : '')")
    return f"({_RULES_HERE} ? [{', '.join(tests)}] : [])"


def _key_stages(first: str) -> list[dict[str, str]]:
    """From stage ``first`` ([name, image] per container, images valid) to the keys:
    ``s`` + name[:tag] as written and the digest hex; ``u`` [name, image, hex, name,
    tag]; ``k`` [name, image, hex, repository, tag, name:tag], normalized."""
    split = (
        f"variables.{first}.map(x, [x[0], x[1], x[1].contains('@') ? x[1].split('@')[0] : x[1], "
        "x[1].contains('@') ? x[1].split('@')[1].substring(7) : ''])"
    )
    tagged = "x[2].substring(x[2].lastIndexOf('/') + 1).contains(':')"
    name_tag = (
        f"variables.s.map(x, {tagged} ? "
        "[x[0], x[1], x[3], x[2].substring(0, x[2].lastIndexOf(':')), "
        "x[2].substring(x[2].lastIndexOf(':') + 1)] : "
        "[x[0], x[1], x[3], x[2], x[3] != '' ? '' : 'latest'])"
    )
    keys = (
        f"variables.u.map(x, [x[0], x[1], x[2], {_repo('x[3]')}, x[4]])"
        f".filter(x, size(x[3]) <= {MAX_NAME})"
        ".map(x, x + [x[4] != '' ? x[3] + ':' + x[4] : x[3]])"
    )
    return [
        {"name": "s", "expression": split},
        {"name": "u", "expression": name_tag},
        {"name": "k", "expression": keys},
    ]


def _candidates(containers: str, exact: bool) -> str:
    """CEL: [name, image] of the containers on a valid image that mention mooncake,
    and (``exact``) ask for it in a form read exactly."""
    test = f" && {requests_mooncake('c')}" if exact else ""
    return (
        f"({containers}).filter(c, has(c.image) && type(c.image) == string && "
        f"{_mentions('c')} && c.image.matches({_cel(VALID_IMAGE)}){test})"
        ".map(c, [has(c.name) ? string(c.name) : '', string(c.image)])"
    )


def _in_shard(x: str) -> str:
    """CEL: this shard holds a verdict for the keys of container ``x``."""
    return (
        f"(has(params.data) && ({x}[2] != '' ? "
        f"(has(params.data.d) && {x}[2].substring(0, {DIGEST_KEY}) in params.data.d) : "
        f"(has(params.data.t) && {x}[3] in params.data.t && {x}[4] in params.data.t[{x}[3]])))"
    )


_RULES_HERE = "(has(params.data) && has(params.data.rules) && params.data.rules)"


def _rule_match(x: str, checks: Sequence[RuleCheck]) -> str:
    """CEL: some deny rule matches container ``x`` (one combined regular expression and
    a list of digests: the cheap form of ``_rule_hits``, which says which)."""
    regexes = [c.regex for c in checks if c.regex]
    digests = [c.digest for c in checks if c.digest]
    tests = []
    if regexes:
        tests.append(f"{x}[5].matches({_cel('|'.join(f'(?:{r})' for r in regexes))})")
    if digests:
        tests.append(f"{x}[2] in [{', '.join(_cel(d) for d in digests)}]")
    return "(" + " || ".join(tests) + ")" if tests else "false"


def prefilter(containers: str, checks: Sequence[RuleCheck] = ()) -> str:
    """CEL: this shard may refuse the object: it holds a key of a container that
    mentions mooncake, or it is the rules' shard and a rule matches such a container.
    String work, map lookups and one rule pattern only (the command lines' regular
    expressions are left for the shard this is true in), so the other shards of a
    create, and every shard of a create on a good image, cost little."""
    stages = [{"name": "c", "expression": _candidates(containers, exact=False)}]
    stages += _key_stages("c")
    rules = f" || ({_RULES_HERE} && {_rule_match('x', checks)})" if checks else ""
    return f"{inline(stages)}.exists(x, {_in_shard('x')}{rules})"


def variables(containers: str, checks: Sequence[RuleCheck]) -> list[dict[str, str]]:
    """The policy's variables, each a list with one item per requesting container:
    ``c`` [name, image], then the key stages (``_key_stages``), then ``h`` the denials."""
    prefix = (
        "'epguard (backstop policy): container \"' + x[0] + '\" (image ' + x[1] + ') "
        f"requests {FLAG} mooncake, '"
    )
    hits = (
        f"variables.k.map(x, ({_rule_hits('x', checks)} + [{_verdict_hit('x')}])"
        f".filter(m, m != '').map(m, {prefix} + m)).flatten()"
    )
    return [
        {"name": "c", "expression": _candidates(containers, exact=True)},
        *_key_stages("c"),
        {"name": "h", "expression": hits},
    ]


def inline(stages: Sequence[dict[str, str]]) -> str:
    """The last stage with every ``variables.<name>`` replaced by its expression."""
    done: dict[str, str] = {}
    for v in stages:
        expr = v["expression"]
        for name, value in done.items():
            expr = expr.replace(f"variables.{name}.", f"({value}).")
        done[v["name"]] = expr
    return done[stages[-1]["name"]]


def _case_variants(word: str) -> list[str]:
    """Every upper/lower spelling of ``word`` (a label selector compares exactly; the
    webhook lower-cases the mode label)."""
    return sorted(
        {"".join(p) for p in itertools.product(*((ch.lower(), ch.upper()) for ch in word))}
    )


def policy_name(config: BackstopConfig) -> str:
    return config.name


def binding_name(config: BackstopConfig, mode: Mode) -> str:
    return f"{config.name}-{mode}"


def object_names(config: BackstopConfig) -> list[str]:
    """The policy's and the bindings' names (and so the names of the three policies an
    earlier release kept, one per mode, which the controller removes)."""
    return [policy_name(config), *(binding_name(config, m) for m in MODES)]


def shard_name(config: BackstopConfig, count: int, index: int) -> str:
    """A shard's name carries the shard count: a new count writes a new set beside the
    old one, which goes only once the new one is written (no entry is ever missing)."""
    return f"{config.name}-{count}-{index}"


def _labels() -> dict[str, str]:
    return {"app.kubernetes.io/part-of": "epguard"}


def policies(config: BackstopConfig, rules: RuleSet | None = None) -> list[dict[str, Any]]:
    """The ValidatingAdmissionPolicy and its three bindings (one per mode, each carrying
    its validation action; the namespace's mode chooses the binding)."""
    resource_rules, containers = _kind_containers(config)
    checks, _ = rule_checks(rules or RuleSet())
    exempt = _skipped("object") if config.allow_skip else "false"
    stages = variables(containers, checks)
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": policy_name(config), "labels": _labels()},
        "spec": {
            # An error in the backstop itself (an old API server, a hostile object) must
            # not block the cluster: the webhook still judges.
            "failurePolicy": "Ignore",
            "paramKind": {"apiVersion": f"{PARAMS_GROUP}/{PARAMS_VERSION}", "kind": PARAMS_KIND},
            "matchConstraints": {"resourceRules": resource_rules},
            # The message's: variables are not visible to matchConditions.
            "variables": stages,
            # The whole judgement, one expression (the stages inlined: each uses the one
            # before it once), so an object nothing in this shard refuses stops here and
            # never reaches the validation and its message, which the API server
            # evaluates for every object that gets that far, admitted or not.
            "matchConditions": [
                {
                    "name": "refused",
                    "expression": f"!{exempt} && {prefilter(containers, checks)} && "
                    f"size({inline(stages)}) > 0",
                }
            ],
            "validations": [
                {
                    "expression": "false",
                    "messageExpression": "string(variables.h[0])",
                    "reason": "Forbidden",
                }
            ],
        },
    }
    out: list[dict[str, Any]] = [policy]
    excluded = sorted({*config.excluded_namespaces, config.params_namespace})
    for mode in MODES:
        others = [v for m in MODES if m != mode for v in _case_variants(m)]
        if mode == config.default_mode:
            # No label, or one that names no mode: the default.
            mode_expr = {"key": MODE_LABEL, "operator": "NotIn", "values": others}
        else:
            mode_expr = {"key": MODE_LABEL, "operator": "In", "values": _case_variants(mode)}
        match: dict[str, Any] = {
            "namespaceSelector": {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": excluded},
                    {"key": "epguard.io/ignore", "operator": "NotIn", "values": ["true"]},
                    mode_expr,
                ]
            },
        }
        if config.object_selector:
            match["objectSelector"] = config.object_selector
        if mode != config.default_mode:
            # A cluster-scoped object has no namespace: the default mode's binding only
            # (the namespaceSelector does not apply to it).
            match["resourceRules"] = [
                {"apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*"],
                 "operations": ["CREATE"], "scope": "Namespaced"}
            ]  # fmt: skip
        out.append(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": binding_name(config, mode), "labels": _labels()},
                "spec": {
                    "policyName": policy_name(config),
                    "validationActions": [ACTIONS[mode]],
                    # Every shard; none at all (not written yet) admits.
                    "paramRef": {
                        "selector": {"matchLabels": {SHARD_LABEL: config.name}},
                        "parameterNotFoundAction": "Allow",
                    },
                    "matchResources": match,
                },
            }
        )
    return out


def shard_objects(
    config: BackstopConfig, params: Params, rules: bool = True
) -> list[dict[str, Any]]:
    """The RefusedImageLists to write; shard 0 carries ``rules: true``, the flag under
    which the policy tests the deny rules."""
    count = len(params.shards)
    out = []
    for i, data in enumerate(params.shards):
        body = dict(data)
        if i == 0 and rules:
            body["rules"] = True
        out.append(
            {
                "apiVersion": f"{PARAMS_GROUP}/{PARAMS_VERSION}",
                "kind": PARAMS_KIND,
                "metadata": {
                    "name": shard_name(config, count, i),
                    "labels": {**_labels(), SHARD_LABEL: config.name},
                },
                "data": body,
            }
        )
    return out
