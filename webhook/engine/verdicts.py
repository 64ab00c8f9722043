"""Verdicts learned from real probe runs (``ImageVerdict``, group epguard.io), in memory.

The policy only sees the ``VerdictLookup`` protocol, so the admission path never
calls the API server: a watch (``watch.py``) keeps a ``VerdictStore`` current.

Trust depends on how the pod names its image:

* pinned by digest: the bytes are the bytes the probe saw, so an Unusable
  verdict for that digest refuses, for as long as the verdict exists;
* by tag only: tags move (a rebuilt ``:latest`` may be fixed), so an Unusable
  verdict refuses only while younger than ``tag_ttl`` and warns after.

The ImageVerdict fields read here (from ``spec``, falling back to ``status``):
``image`` (as written in the pod), ``digest`` (resolved from the pod's
``imageID``), ``verdict`` (``Usable``/``Unusable``), ``reason``, ``lastSeen``
(RFC 3339; see "Times" below) and ``pod`` (``namespace/name`` of the pod that saw
it); ``source`` says who found it: ``probe`` (the controller, from a signed probe in a
pod; the default for objects written before the field existed) or ``scan`` (``epguard
scan --record``, from the image's files, by ``recordedBy``, the API server's name for
the caller).

Times. ``lastSeen`` orders the verdicts of one image (the newest answers) and keeps a
tag's Unusable verdict refusing for ``tag_ttl``; it is written by the writer, and a
writer's clock (or a hostile writer) may put it in the future, where it would outrank
every newer verdict and refuse the tag for ever. So the time a verdict is held at is
never later than (1) the API server's time of the newest write to the object (the
newest ``metadata.managedFields[].time``: the server sets it, not the client, for the
entry of whoever changed a field) nor (2) the moment this process first saw the object
say so. (2) covers managedFields a writer sent itself; the chart's scan-recorder policy
refuses those from recorders, and checks lastSeen against (1) when it is written.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NotRequired, Protocol, TypedDict

from epguard.webhook.engine.imageref import ImageRef, ImageRefError, parse
from epguard.webhook.engine.text import first_line, parse_time, stamp

Trust = Literal["deny", "warn", "usable"]

# The ImageVerdict custom resource (cluster-scoped), as the chart's CRD defines it.
GROUP, VERSION, KIND, PLURAL = "epguard.io", "v1alpha1", "ImageVerdict", "imageverdicts"
DEFAULT_TAG_TTL = dt.timedelta(hours=24)
# Who found a verdict (``spec.source``). Each writer has its own object names, so one
# never overwrites the other's (``verdict_name``; the chart's scan-recorder policy holds
# the scan to its own).
SOURCE_PROBE, SOURCE_SCAN = "probe", "scan"
SCAN_NAME_PREFIX = "scan-"
# Of a tag's hash in a probe verdict's name: 64 bits, where a collision would need a
# chosen second tag of the same bytes, and only merge two references' verdicts.
TAG_HASH_CHARS = 16


def verdict_name(image: str, digest: str | None, source: str = SOURCE_PROBE) -> str:
    """The ImageVerdict's object name: one object per image content and tag, per writer.

    The scan's is ``scan-<manifest digest>``. The probe's is by digest when the kubelet
    resolved one (the bytes the probe saw), and for a reference by tag, the digest and a
    hash of the normalized ``name:tag``: the tag a verdict answers for is its object's
    alone, so a probe of the same bytes under another reference (pinned, another tag, a
    mirror) writes an object of its own and never takes a tag's verdict away from it
    (before, it replaced ``spec.image`` of the one object per digest, and the tag's
    Unusable verdict stopped refusing for every tenant). Without a digest: ``ref-`` and a
    hash of the normalized reference, so two spellings of one image share an object.
    """
    if source == SOURCE_SCAN:
        return SCAN_NAME_PREFIX + (digest or "").replace(":", "-")
    try:
        ref: ImageRef | None = parse(image)
    except ImageRefError:
        ref = None
    if digest:
        name = digest.replace(":", "-")
        if ref is not None and ref.tag is not None and ref.digest is None:
            name += "-" + hashlib.sha256(ref.name_tag.encode()).hexdigest()[:TAG_HASH_CHARS]
        return name
    key = str(ref) if ref is not None else image
    return "ref-" + hashlib.sha256(key.encode()).hexdigest()[:40]


# The JSON epguard writes (the chart's CRD schema). What it *reads* back is walked
# leniently (``verdict_from_object``): anyone with write access may have edited it.
class VerdictVersions(TypedDict):
    sglang: str | None
    torch: str | None
    mooncake: str | None


class ImageVerdictSpec(TypedDict):
    image: str
    digest: str
    verdict: str  # Usable | Unusable
    reason: str
    report: str
    versions: VerdictVersions
    firstSeen: str  # RFC 3339, UTC
    lastSeen: str
    pod: NotRequired[str]  # namespace/name of the pod whose probe saw it (probe only)
    count: int
    runs: NotRequired[list[str]]  # the last probe terminations counted (probe only)
    source: NotRequired[str]  # SOURCE_PROBE | SOURCE_SCAN
    recordedBy: NotRequired[str]  # the API server's username of the scan's caller (scan only)
    fix: NotRequired[str]  # what to change in the image, as the scan said it (scan only)
    # kubernetes.io/arch of the node the probe ran on (probe only; controller/architectures.py)
    architecture: NotRequired[str]


# The CRD's limit on each ``spec.versions`` value (``maxLength: 128``). The versions come
# from the image (a METADATA file may claim any version, on either path: the probe's
# ``versions:`` line or the scan's files), and one value over the limit makes the API
# server refuse the whole verdict, so every writer cuts them with ``version_value``.
MAX_VERSION = 128


def version_value(value: str) -> str:
    """One ``spec.versions`` value as the CRD takes it: the first line, cut to
    MAX_VERSION characters (the last one an ellipsis, so a cut value says so)."""
    return first_line(value, MAX_VERSION)


@dataclass(frozen=True, slots=True)
class Versions:
    """What the probe's ``versions:`` line says (``outcome.parse_versions``, for the scan
    too): the versions an ImageVerdict records."""

    torch: str = ""
    sglang: str = ""
    mooncake: str = ""


def build_spec(
    *,
    image: str,
    digest: str,
    verdict: str,
    reason: str,
    report: str,
    versions: Versions,
    source: str,
    now: dt.datetime,
    previous: Mapping[str, Any] | None,
    omit_empty_versions: bool = False,
    pod: str | None = None,
    runs: list[str] | None = None,
    fix: str | None = None,
    recorded_by: str | None = None,
    architecture: str | None = None,
) -> ImageVerdictSpec:
    """The ImageVerdict spec a writer (the controller for a probe, ``epguard scan
    --record``) puts: written now, ``count`` and ``firstSeen`` carried from ``previous``
    (the spec read back, if any), each version cut to fit the CRD (an empty one written
    as null, which the API server drops, when ``omit_empty_versions``). ``pod`` and
    ``runs`` and ``architecture`` are the probe's, ``fix`` and ``recorded_by`` the scan's."""
    written = stamp(now)
    prev = previous if isinstance(previous, Mapping) else {}
    count, first_seen = prev.get("count"), prev.get("firstSeen")

    def cut(value: str) -> str | None:
        return version_value(value) or (None if omit_empty_versions else "")

    spec: ImageVerdictSpec = {
        "image": image,
        "digest": digest,
        "verdict": verdict,
        "reason": reason,
        "report": report,
        "versions": {
            "sglang": cut(versions.sglang),
            "torch": cut(versions.torch),
            "mooncake": cut(versions.mooncake),
        },
        "firstSeen": first_seen if isinstance(first_seen, str) and first_seen else written,
        "lastSeen": written,
        "count": (count if isinstance(count, int) and count > 0 else 0) + 1,
        "source": source,
    }
    if pod is not None:
        spec["pod"] = pod
    if runs is not None:
        spec["runs"] = runs
    if fix is not None:
        spec["fix"] = fix
    if recorded_by is not None:
        spec["recordedBy"] = recorded_by
    if architecture is not None:
        spec["architecture"] = architecture
    return spec


class ImageVerdictMeta(TypedDict, total=False):
    name: str
    labels: dict[str, str]
    resourceVersion: str


class ImageVerdictObject(TypedDict):
    apiVersion: str
    kind: str
    metadata: ImageVerdictMeta
    spec: ImageVerdictSpec


# The namespace whose probe first taught a probe verdict: its share of the verdict store
# is counted by this label (controller.verdictsPerNamespace). It stays what the creator
# wrote when a probe of another namespace updates the verdict.
TAUGHT_BY_LABEL = "epguard.io/taught-by"
# Who wrote a verdict: the controller (probes) or the scan recorder (their ``manager``).
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# ``spec.architecture`` as a label, so the architecture sweep lists by selector only the
# verdicts taught on another architecture (controller/architectures.py).
ARCHITECTURE_LABEL = "epguard.io/architecture"


def verdict_object(
    name: str,
    spec: ImageVerdictSpec,
    manager: str,
    existing: Mapping[str, Any] | None,
    taught_by: str | None = None,
) -> ImageVerdictObject:
    """The whole ImageVerdict to create (``existing`` None) or replace. The resourceVersion
    read goes with it, so a write that raced another ends in a 409 and a re-read, not in
    a lost update. ``taught_by``: the namespace of the probe that creates it; the spec's
    ``architecture`` is a label too."""
    labels = {MANAGED_BY_LABEL: manager}
    metadata: ImageVerdictMeta = {"name": name, "labels": labels}
    old_meta = existing.get("metadata") if existing is not None else None
    if isinstance(old_meta, Mapping):
        rv = old_meta.get("resourceVersion")
        if isinstance(rv, str):
            metadata["resourceVersion"] = rv
        old_labels = old_meta.get("labels")
        taught_by = old_labels.get(TAUGHT_BY_LABEL) if isinstance(old_labels, Mapping) else None
    if isinstance(taught_by, str) and taught_by:
        labels[TAUGHT_BY_LABEL] = taught_by
    architecture = spec.get("architecture")
    if architecture:
        labels[ARCHITECTURE_LABEL] = architecture
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": metadata, "spec": spec}


@dataclass(frozen=True, slots=True)
class Verdict:
    object_name: str
    image: str
    ref: ImageRef | None
    digest: str | None
    usable: bool
    reason: str
    last_seen: dt.datetime | None
    pod: str | None
    source: str = SOURCE_PROBE
    recorded_by: str | None = None
    fix: str = ""
    # ``lastSeen`` as the object says it; ``last_seen`` is what this process trusts of it
    # (see "Times" above).
    claimed_last_seen: dt.datetime | None = None

    @property
    def from_scan(self) -> bool:
        return self.source == SOURCE_SCAN


@dataclass(frozen=True, slots=True)
class VerdictHit:
    verdict: Verdict
    trust: Trust
    by_digest: bool
    # By digest, or by a tag seen within the tag TTL: the image is judged (no preflight).
    fresh: bool = True

    def where(self, namespace: str | None = None) -> str:
        """Where the verdict comes from, told to a request in ``namespace``: the pod that
        failed, and when, are said only to its own namespace. To any other, a refusal
        named another tenant's namespace and pod, and when it ran a private image (review
        helper); ImageVerdicts are not readable by tenants."""
        v = self.verdict
        if v.from_scan:
            by = f" by {v.recorded_by}" if v.recorded_by else ""
            at = f" at {stamp(v.last_seen)}" if v.last_seen else ""
            return f"found in the image's files by epguard scan, recorded{by}{at}"
        if v.pod and (namespace is None or not v.pod.startswith(namespace + "/")):
            return "seen failing in another namespace"
        bits = [f"in pod {v.pod}"] if v.pod else []
        if v.last_seen is not None:
            bits.append(f"at {stamp(v.last_seen)}")
        return ("seen failing " + " ".join(bits)) if bits else "seen failing in this cluster"


class VerdictLookup(Protocol):
    def lookup(self, ref: ImageRef, now: dt.datetime) -> VerdictHit | None: ...


class NoVerdicts:
    """The lookup used when nothing is learned (CLI, or no cluster)."""

    def lookup(self, ref: ImageRef, now: dt.datetime) -> VerdictHit | None:
        return None


def _field(obj: Mapping[str, Any], name: str) -> Any:
    for part in ("spec", "status"):
        section = obj.get(part)
        if isinstance(section, Mapping) and section.get(name) is not None:
            return section.get(name)
    return None


def _written_at(meta: Mapping[str, Any]) -> dt.datetime | None:
    """The API server's time of the newest write that changed the object: the newest
    ``managedFields[].time``, or None when there is none."""
    entries = meta.get("managedFields")
    if not isinstance(entries, list):
        return None
    times = [parse_time(e.get("time")) for e in entries if isinstance(e, Mapping)]
    return max((t for t in times if t is not None), default=None)


# What verdict_from_object reads of an ImageVerdict's spec (or status).
_READ = ("image", "verdict", "digest", "reason", "pod", "source", "recordedBy", "fix", "lastSeen")


def slim_verdict_object(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`verdict_from_object` reads of an ImageVerdict, and nothing else (not
    its report, its runs, the field sets of managedFields): a listing keeps this of each
    verdict while it reads the next page. Kept whole, 10,000 verdicts with a probe's
    report (15.7 KB each once parsed) were ~160 MB in a webhook limited to 256 Mi."""
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    kept: dict[str, Any] = {k: meta[k] for k in ("name", "resourceVersion") if k in meta}
    newest = _written_at(meta)  # the one thing verdict_from_object reads of them
    if newest is not None:
        kept["managedFields"] = [{"time": stamp(newest)}]
    out: dict[str, Any] = {"metadata": kept}
    for part in ("spec", "status"):
        section = obj.get(part)
        if isinstance(section, Mapping):
            fields = {k: section[k] for k in _READ if section.get(k) is not None}
            for k in ("reason", "fix"):
                if isinstance(fields.get(k), str):
                    fields[k] = first_line(fields[k])
            out[part] = fields
    return out


def verdict_from_object(obj: Any) -> Verdict | None:
    """An ImageVerdict as the API returns it → Verdict, or None when unusable as evidence.
    Its ``last_seen`` is never later than the API server's time of the write."""
    if not isinstance(obj, Mapping):
        return None
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    image = _field(obj, "image")
    verdict = _field(obj, "verdict")
    if not isinstance(name, str) or not isinstance(image, str) or not isinstance(verdict, str):
        return None
    if verdict.lower() not in ("usable", "unusable"):
        return None
    try:
        ref: ImageRef | None = parse(image)
    except ImageRefError:
        ref = None
    digest = _field(obj, "digest")
    digest = digest.lower() if isinstance(digest, str) and digest else None
    if digest is None and ref is not None and ref.digest:
        digest = ref.digest.lower()
    reason = _field(obj, "reason")
    pod = _field(obj, "pod")
    source = _field(obj, "source")
    recorded_by = _field(obj, "recordedBy")
    fix = _field(obj, "fix")
    claimed = parse_time(_field(obj, "lastSeen"))
    written = _written_at(meta) if isinstance(meta, Mapping) else None
    return Verdict(
        object_name=name,
        image=image,
        ref=ref,
        digest=digest,
        usable=verdict.lower() == "usable",
        reason=first_line(reason) if isinstance(reason, str) else "",
        last_seen=min(claimed, written) if claimed and written else claimed,
        pod=pod if isinstance(pod, str) and pod else None,
        source=SOURCE_SCAN if source == SOURCE_SCAN else SOURCE_PROBE,
        recorded_by=recorded_by if isinstance(recorded_by, str) and recorded_by else None,
        fix=first_line(fix) if isinstance(fix, str) else "",
        claimed_last_seen=claimed,
    )


# At most this many ImageVerdicts are held (a few hundred bytes each). A cluster learns
# one per image digest its workers ran; far more than that is a controller gone wrong or
# someone creating ImageVerdicts by the million, and the webhook must not grow with it.
MAX_VERDICTS = 50_000
# Scan verdicts have a share of their own, beside MAX_VERDICTS for the probes': a scan
# recorder's verdicts count against no namespace, and one recorder that wrote 50,000 of
# them (no scan needed) filled the store; after a restart, listed by name ("scan-…"
# before "sha256-…"), every probe verdict was dropped and pods on images found Unusable
# were admitted in every namespace (review helper).
MAX_SCAN_VERDICTS = 10_000
_EPOCH = dt.datetime.min.replace(tzinfo=dt.UTC)


def observed(v: Verdict, now: dt.datetime, held: Verdict | None = None) -> Verdict:
    """``v`` with its time no later than when this process first saw it say so: ``now``,
    or the time already held for the same object and the same ``lastSeen``."""
    if v.last_seen is None:
        return v
    bound = now
    if held is not None and held.claimed_last_seen == v.claimed_last_seen and held.last_seen:
        bound = min(bound, held.last_seen)
    return v if v.last_seen <= bound else dataclasses.replace(v, last_seen=bound)


def rank(v: Verdict) -> tuple[dt.datetime, str]:
    """The newest verdict of a key answers for it ("a newer probe outcome replaces it");
    the name breaks ties, so the answer never depends on the order events arrived in."""
    return (v.last_seen or _EPOCH, v.object_name)


def verdict_keys(v: Verdict) -> list[tuple[str, str]]:
    """The keys a verdict answers for: ("digest", its digest), ("tag", its name:tag).

    A verdict on a reference that pins a digest (``name:tag@sha256:...``) is about those
    bytes only: the runtime pulled by digest, and the tag may name other bytes. Keyed
    under the tag too, one tenant could pin a broken build under a good tag's name and
    have every pod on that tag refused (or pin a good build under a bad tag's name)."""
    keys = [("digest", v.digest)] if v.digest else []
    if v.ref is not None and v.ref.tag is not None and v.ref.digest is None:
        keys.append(("tag", v.ref.name_tag))
    return keys


def _newest(members: Iterable[Verdict]) -> Verdict:
    return max(members, key=rank)


class VerdictStore:
    """ImageVerdicts by object name, indexed by digest and by normalized name:tag.

    The indexes are kept incrementally: an event touches only the keys of the verdict it
    changes (the few verdicts sharing a digest or a tag), never the whole store. Written
    by the watch task, read by admissions; a lock keeps the indexes consistent with each
    other even if a writer runs in another thread. Past MAX_VERDICTS, new names are
    refused (counted in ``dropped``) rather than held.
    """

    def __init__(
        self,
        tag_ttl: dt.timedelta = DEFAULT_TAG_TTL,
        cap: int = MAX_VERDICTS,
        scan_cap: int = MAX_SCAN_VERDICTS,
    ) -> None:
        self.tag_ttl = tag_ttl
        self.cap = cap
        self.scan_cap = scan_cap
        self.dropped = 0
        self._scans = 0  # how many of _by_name are scan verdicts
        self._lock = threading.Lock()
        self._by_name: dict[str, Verdict] = {}
        # key -> names of the verdicts under it, and the newest of them (the answer).
        self._members: dict[tuple[str, str], set[str]] = {}
        self._winner: dict[tuple[str, str], Verdict] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def _full(self, v: Verdict) -> bool:
        """Whether a new verdict of ``v``'s kind is past its share (cap, scan_cap)."""
        if v.from_scan:
            return self._scans >= self.scan_cap
        return len(self._by_name) - self._scans >= self.cap

    def _refresh(self, key: tuple[str, str]) -> None:
        names = self._members.get(key)
        if not names:
            self._members.pop(key, None)
            self._winner.pop(key, None)
            return
        self._winner[key] = _newest(self._by_name[n] for n in names)

    def _remove(self, name: str) -> list[tuple[str, str]]:
        old = self._by_name.pop(name, None)
        if old is None:
            return []
        self._scans -= old.from_scan
        keys = verdict_keys(old)
        for key in keys:
            self._members.get(key, set()).discard(name)
        return keys

    def _add(self, v: Verdict) -> list[tuple[str, str]]:
        self._by_name[v.object_name] = v
        self._scans += v.from_scan
        keys = verdict_keys(v)
        for key in keys:
            self._members.setdefault(key, set()).add(v.object_name)
        return keys

    def upsert(self, verdict: Verdict, now: dt.datetime | None = None) -> bool:
        """Hold ``verdict`` (replacing one of the same name); False if the cap refused it.
        ``now``: when it was seen (its time is held no later than that)."""
        now = now or dt.datetime.now(dt.UTC)
        with self._lock:
            held = self._by_name.get(verdict.object_name)
            # A new name, or one that changes kind (an admin's edit of spec.source), takes
            # a place in its kind's share.
            if (held is None or held.from_scan != verdict.from_scan) and self._full(verdict):
                self.dropped += 1
                return False
            verdict = observed(verdict, now, held)
            touched = self._remove(verdict.object_name) + self._add(verdict)
            for key in set(touched):
                self._refresh(key)
            return True

    def delete(self, object_name: str) -> None:
        with self._lock:
            for key in set(self._remove(object_name)):
                self._refresh(key)

    def replace(self, verdicts: Iterable[Verdict], now: dt.datetime | None = None) -> None:
        """Hold exactly ``verdicts``: built aside, then swapped in at once, so a review
        reading meanwhile (lookup takes no lock) sees the old verdicts until the new
        ones are whole. (Emptied first and refilled in place, the store answered "no
        verdict" to reviews during a relist on the watch's thread: pods on Unusable
        images admitted for as long as the refill took.)"""
        now = now or dt.datetime.now(dt.UTC)
        before = self._by_name  # only the watch writes: read once, never changed here
        fresh = VerdictStore(self.tag_ttl, self.cap, self.scan_cap)
        for v in verdicts:
            had = fresh._by_name.get(v.object_name)
            if (had is None or had.from_scan != v.from_scan) and fresh._full(v):
                fresh.dropped += 1
                continue
            fresh._remove(v.object_name)
            fresh._add(observed(v, now, before.get(v.object_name)))
        for key in list(fresh._members):
            fresh._refresh(key)
        with self._lock:
            self._by_name, self._members = fresh._by_name, fresh._members
            self._scans = fresh._scans
            self._winner = fresh._winner  # the one index lookup reads: swapped last
            self.dropped += fresh.dropped

    def winners(self) -> list[tuple[str, str, Verdict]]:
        """(``digest`` or ``tag``, key, the verdict that answers for it): what ``lookup``
        decides by, for the outage backstop (backstop.py)."""
        with self._lock:
            return [(kind, key, v) for (kind, key), v in self._winner.items()]

    def lookup(self, ref: ImageRef, now: dt.datetime) -> VerdictHit | None:
        if ref.digest:
            v = self._winner.get(("digest", ref.digest.lower()))
            if v is not None:
                return VerdictHit(v, "usable" if v.usable else "deny", by_digest=True)
        if ref.tag is None:
            return None
        v = self._winner.get(("tag", ref.name_tag))
        if v is None:
            return None
        if ref.digest and v.digest and v.digest != ref.digest.lower():
            return None  # the tag's verdict was about other bytes than the ones pinned here
        fresh = v.last_seen is not None and now - v.last_seen < self.tag_ttl
        if v.usable:
            return VerdictHit(v, "usable", by_digest=False, fresh=fresh)
        return VerdictHit(v, "deny" if fresh else "warn", by_digest=False, fresh=fresh)
