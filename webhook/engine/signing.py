"""Signed injection: proof that a pod's probe containers are the ones epguard injected.

A learned verdict refuses other people's pods, so the controller may learn only from a
probe epguard itself put in the pod. Anyone who can create a pod can also write an
``epguard-probe`` init container that prints a verdict of its choosing, so a name, a
label or a command line proves nothing. ``/mutate`` therefore signs what it injects, as
it will be stored — every field of every ``epguard-*`` init container (but those the API
server defaults), the probe's volume, the ``epguard.io/probed`` label, the pod-level
fields that decide what can reach the probe's process (process, host and security
settings), the namespace and the time — with HMAC-SHA256 under a key held in a Secret
that only the webhook and the controller can read (the controller creates and rotates
it, ``controller/probe_key.py``). The signature goes in the
``epguard.io/probe-signature`` annotation.

A signature binds epguard's parts; it cannot bind the rest of the pod, which a tenant
writes. So a signed pod is evidence only while the rest keeps away from the probe
(:func:`exposure`): epguard's init containers first and together, no other container on
the probe's volume, no ephemeral container. And a signature is used once, by the pod it
was made for: /validate refuses a stale one at CREATE, and the controller learns only
from a pod created within :data:`FRESH_SECONDS` of its signature, once per signature.
Copying a signed pod's parts into a hand-made pod therefore proves nothing.

``/validate`` refuses a pod whose epguard parts are not exactly what was signed, and the
controller records an outcome only when the signature verifies against the pod's
*current* spec (an init container's image can be patched after creation).

Pure: no I/O. The key material arrives as a :class:`Keyring`.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import hmac
import json
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epguard.webhook.engine.outcome import PROBE_VOLUME, PROBED_LABEL
from epguard.webhook.engine.text import parse_stamp, stamp
from epguard.webhook.engine.workloads import as_list, as_map

# Every init container under this prefix belongs to epguard: /mutate removes the ones a
# tenant wrote and /validate refuses unsigned ones. The prefix is reserved (README).
PREFIX = "epguard-"
SIGNATURE_ANNOTATION = "epguard.io/probe-signature"
FORMAT = "v3"
# The format of the epguard before, which signed less (not the probe's termination
# message): still checked, so that a pod an old webhook replica mutated during an upgrade
# is admitted, but never evidence. The controller makes such a preflight again.
OLDER_FORMAT = "v2"

# The Secret's one data key: JSON {"keys": [{"id", "key" (base64), "created"}, ...]},
# newest first. Two keys are kept after a rotation so pods signed just before it verify.
SECRET_KEY = "keys.json"
KEY_BYTES = 32
MAX_KEYS = 3
# A Secret's data is at most 1 MiB; a keyring is a few hundred bytes. Anything larger is
# not ours and is not parsed.
MAX_SECRET_BYTES = 64 * 1024

# Container fields the API server fills in after /mutate's patch (defaulting) or that
# epguard signs in a projection of its own (resources: quantities are canonicalised;
# volumeMounts and the termination message: below). Every other field of an epguard
# container is signed as it is, so one that a tenant adds (``workingDir``,
# ``restartPolicy: Always``, a lifecycle hook …) breaks the signature.
# ``imagePullPolicy`` alone is not signed (its default depends on the image's tag): it
# changes which bytes the kubelet runs, never what the probe reports about them, and a
# verdict is keyed by the digest the runtime reports (by tag only after a pull with
# Always, outcome.py).
_DEFAULTED_FIELDS = frozenset(
    {
        "terminationMessagePath",
        "terminationMessagePolicy",
        "imagePullPolicy",
        "resources",
        "volumeMounts",
    }
)
# The API server's defaults for the termination message (k8s.io/api core/v1
# TerminationMessagePathDefault, TerminationMessageReadFile). Both are signed with the
# defaults filled in: the kubelet mounts a file of its own at the path, over whatever the
# image holds there (a path into the image's mooncake package empties that file for the
# probe, which then reports the image broken), and the policy decides whether a probe's
# log stands in for its message.
_TERMINATION_PATH = "/dev/termination-log"
_TERMINATION_POLICY = "File"
# Pod-level fields that decide what can reach the probe's process or files while it runs:
# signed with the probe, so a signed probe copied into a pod with other values does not
# verify.
_POD_FIELDS = (
    "shareProcessNamespace",
    "hostPID",
    "hostIPC",
    "hostNetwork",
    "hostUsers",
    "securityContext",
    "runtimeClassName",
)
# A signature is used once, by the pod it was made for: /validate refuses a CREATE whose
# signature is older than this, and the controller learns only from a pod created within
# this of its signature (``metadata.creationTimestamp``, set by the API server). It covers
# the time between /mutate and the write (a few seconds) plus clock skew between the
# webhook's replicas and the API server.
FRESH_SECONDS = 120


class KeyringError(ValueError):
    """The Secret does not hold a usable keyring (one line, for logs and /readyz)."""


@dataclass(frozen=True, slots=True)
class Key:
    id: str
    secret: bytes = b""
    created: str = ""

    def __repr__(self) -> str:  # never print the key itself
        return f"Key(id={self.id!r}, created={self.created!r})"


@dataclass(frozen=True, slots=True)
class Keyring:
    """The keys, newest first: sign with the first, verify with any."""

    keys: tuple[Key, ...]

    @property
    def current(self) -> Key:
        return self.keys[0]

    def find(self, key_id: str) -> Key | None:
        return next((k for k in self.keys if k.id == key_id), None)

    def settled(self, now: dt.datetime, seconds: float) -> Key:
        """The newest key made at least ``seconds`` before ``now``, else the newest: what
        the controller signs its preflights with, so that a webhook replica whose watch
        has not yet read a just-rotated key still verifies them (one that could not
        refused or re-injected them, and under onError=open their pods were opened)."""
        for key in self.keys:
            made = parse_stamp(key.created) if key.created else None
            if made is not None and (now - made).total_seconds() >= seconds:
                return key
        return self.current

    def to_json(self) -> str:
        return json.dumps(
            {
                "keys": [
                    {"id": k.id, "key": base64.b64encode(k.secret).decode(), "created": k.created}
                    for k in self.keys
                ]
            },
            sort_keys=True,
        )


def new_key(now: dt.datetime) -> Key:
    return Key(id=secrets.token_hex(4), secret=secrets.token_bytes(KEY_BYTES), created=stamp(now))


def new_keyring(now: dt.datetime) -> Keyring:
    return Keyring((new_key(now),))


def rotated(ring: Keyring, now: dt.datetime) -> Keyring:
    """A fresh current key; the previous ones stay (up to MAX_KEYS) to verify older pods."""
    return Keyring((new_key(now), *ring.keys)[:MAX_KEYS])


def key_age(ring: Keyring, now: dt.datetime) -> dt.timedelta | None:
    created = parse_stamp(ring.current.created)
    if created is None:
        return None
    return now.astimezone(dt.UTC) - created


def parse_keyring(text: str | bytes) -> Keyring:
    """The keyring in a Secret's ``keys.json``; KeyringError naming what is wrong."""
    if len(text) > MAX_SECRET_BYTES:
        raise KeyringError(f"{SECRET_KEY} is {len(text)} bytes, over {MAX_SECRET_BYTES}")
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise KeyringError(f"{SECRET_KEY} is not JSON: {exc}") from None
    entries = as_list(as_map(doc).get("keys"))
    keys: list[Key] = []
    for i, entry in enumerate(entries[:MAX_KEYS]):
        e = as_map(entry)
        key_id, raw, created = e.get("id"), e.get("key"), e.get("created", "")
        if not isinstance(key_id, str) or not key_id or not isinstance(raw, str):
            raise KeyringError(f"{SECRET_KEY} keys[{i}] needs a string id and key")
        try:
            secret = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise KeyringError(f"{SECRET_KEY} keys[{i}].key is not base64") from None
        if len(secret) < 16:
            raise KeyringError(f"{SECRET_KEY} keys[{i}].key is {len(secret)} bytes, under 16")
        keys.append(Key(key_id, secret, created if isinstance(created, str) else ""))
    if not keys:
        raise KeyringError(f"{SECRET_KEY} holds no key")
    return Keyring(tuple(keys))


def keyring_from_secret(obj: Mapping[str, Any]) -> Keyring:
    """A Secret object as the API returns it (``data`` values base64)."""
    raw = as_map(obj.get("data")).get(SECRET_KEY)
    if not isinstance(raw, str):
        raise KeyringError(f"the Secret has no {SECRET_KEY}")
    try:
        return parse_keyring(base64.b64decode(raw, validate=True))
    except (binascii.Error, ValueError) as exc:
        if isinstance(exc, KeyringError):
            raise
        raise KeyringError(f"{SECRET_KEY} is not base64") from None


class KeyringHolder:
    """The keyring in use, swapped as one reference (read by the event loop, written by
    the Secret's watch); ``error`` says why there is none."""

    def __init__(self, ring: Keyring | None = None) -> None:
        self.ring = ring
        self.error: str | None = None if ring else "no key loaded yet"
        # Whether the Secret's watch has answered once (a key, or none to be had): until
        # then the webhook is not ready (server.py), since it cannot tell a signed pod.
        self.synced = ring is not None

    def set(self, ring: Keyring | None, error: str | None = None) -> None:
        self.ring = ring
        self.error = error
        self.synced = True


# --- what is signed --------------------------------------------------------------------


def is_epguard_name(name: object) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def _project_container(c: Mapping[str, Any], fmt: str = FORMAT) -> dict[str, Any]:
    out: dict[str, Any] = {
        str(f): v
        for f, v in c.items()
        if f not in _DEFAULTED_FIELDS and v not in (None, "", [], {})
    }
    resources = as_map(c.get("resources"))
    out["resources"] = {
        section: {str(k): str(v) for k, v in as_map(resources.get(section)).items()}
        for section in ("requests", "limits")
        if as_map(resources.get(section))
    }
    if fmt != OLDER_FORMAT:
        if as_list(resources.get("claims")):  # a DRA claim gives the container a device
            out["resources"]["claims"] = as_list(resources.get("claims"))
        out["terminationMessagePath"] = c.get("terminationMessagePath") or _TERMINATION_PATH
        out["terminationMessagePolicy"] = c.get("terminationMessagePolicy") or _TERMINATION_POLICY
    out["volumeMounts"] = [
        {
            "name": m.get("name"),
            "mountPath": m.get("mountPath"),
            "readOnly": bool(m.get("readOnly")),
            "subPath": m.get("subPath") or "",
            "subPathExpr": m.get("subPathExpr") or "",
            "mountPropagation": m.get("mountPropagation") or "",
            "recursiveReadOnly": m.get("recursiveReadOnly") or "",
        }
        for m in map(as_map, as_list(c.get("volumeMounts")))
    ]
    return out


@dataclass(frozen=True, slots=True)
class EpguardParts:
    """Everything in a pod that carries epguard's name."""

    containers: tuple[Mapping[str, Any], ...]  # epguard-* init containers, in order
    volume: Mapping[str, Any] | None
    label: str | None
    signature: str | None

    @property
    def present(self) -> bool:
        return bool(self.containers) or self.label is not None or self.signature is not None


def parts_of(pod: Mapping[str, Any]) -> EpguardParts:
    spec = as_map(pod.get("spec"))
    metadata = as_map(pod.get("metadata"))
    label = as_map(metadata.get("labels")).get(PROBED_LABEL)
    signature = as_map(metadata.get("annotations")).get(SIGNATURE_ANNOTATION)
    volume = next(
        (v for v in map(as_map, as_list(spec.get("volumes"))) if v.get("name") == PROBE_VOLUME),
        None,
    )
    return EpguardParts(
        containers=tuple(
            c
            for c in map(as_map, as_list(spec.get("initContainers")))
            if is_epguard_name(c.get("name"))
        ),
        volume=volume,
        label=str(label) if label is not None else None,
        signature=str(signature) if signature is not None else None,
    )


def exposure(pod: Mapping[str, Any]) -> str | None:
    """Why something the pod holds besides epguard's parts could reach the probe's files
    or process while it runs, in words; None when nothing can.

    The signature binds the probe's containers, volume and the pod-level fields above;
    these are the pod's *other* parts, which it cannot bind (a tenant may add any
    container to its pod): so they must keep away from the probe. No other container
    mounts the probe's volume; epguard's init containers run together, with nothing of
    the tenant's between them (where it would run after the copy and before the probe);
    nothing runs beside or before the probe in a shared process namespace (a mesh's init
    container or sidecar before epguard's is fine otherwise: it cannot reach the probe's
    files, which the copy container writes after it); no ephemeral container (``kubectl
    debug``, which can join the probe's process namespace) was added."""
    spec = as_map(pod.get("spec"))
    inits = [as_map(c) for c in as_list(spec.get("initContainers"))]
    ours = [i for i, c in enumerate(inits) if is_epguard_name(c.get("name"))]
    others = [
        (kind, as_map(c))
        for kind in ("initContainers", "containers", "ephemeralContainers")
        for c in as_list(spec.get(kind))
        if not (kind == "initContainers" and is_epguard_name(as_map(c).get("name")))
    ]
    for kind, c in others:
        if any(as_map(m).get("name") == PROBE_VOLUME for m in as_list(c.get("volumeMounts"))):
            return (
                f"{kind[:-1]} {str(c.get('name'))[:63]!r} mounts the {PROBE_VOLUME} volume, "
                "which is epguard's alone"
            )
    if ours and ours[-1] - ours[0] + 1 != len(ours):
        between = next(
            inits[i] for i in range(ours[0], ours[-1]) if not is_epguard_name(inits[i].get("name"))
        )
        return (
            f"init container {str(between.get('name'))[:63]!r} runs between epguard's "
            f"{PREFIX}* init containers, which must run together"
        )
    shared = spec.get("shareProcessNamespace") is True or spec.get("hostPID") is True
    if shared and ours and ours[0] > 0:
        return (
            f"init container {str(inits[0].get('name'))[:63]!r} runs before or beside "
            "epguard's probe in a shared process namespace"
        )
    if as_list(spec.get("ephemeralContainers")):
        return "an ephemeral container was added to it, which can reach the probe's process"
    return None


def _payload(
    namespace: str,
    pod: Mapping[str, Any],
    signed_at: int,
    fmt: str = FORMAT,
) -> bytes:
    parts = parts_of(pod)
    spec = as_map(pod.get("spec"))
    doc = {
        "format": fmt,
        "namespace": namespace,
        "signedAt": signed_at,
        "containers": [_project_container(c, fmt) for c in parts.containers],
        "volume": dict(parts.volume) if parts.volume is not None else None,
        "label": parts.label,
        "pod": {f: spec[f] for f in _POD_FIELDS if spec.get(f) not in (None, False, {}, "")},
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(
    key: Key, namespace: str, pod: Mapping[str, Any], now: dt.datetime, fmt: str = FORMAT
) -> str:
    """The annotation value for a pod as it will be stored (after /mutate's patch, with
    its probed label): ``v3:<key id>:<unix seconds>:<hex HMAC>``. (``fmt``: the older
    format, as an old replica signs, for tests of an upgrade.)"""
    signed_at = int(now.timestamp())
    mac = hmac.new(key.secret, _payload(namespace, pod, signed_at, fmt), hashlib.sha256)
    return f"{fmt}:{key.id}:{signed_at}:{mac.hexdigest()}"


@dataclass(frozen=True, slots=True)
class Verification:
    ok: bool
    reason: str  # why not, in words a tenant and an admin can act on; "" when ok
    key_id: str = ""  # the key the signature names, held or not ("" without a signature)
    signed_at: int | None = None  # when /mutate signed it (unix seconds), once verified
    outdated: bool = False  # signed, by an older epguard (OLDER_FORMAT): no evidence


def verify(ring: Keyring, namespace: str, pod: Mapping[str, Any]) -> Verification:
    """Whether the pod's epguard parts are exactly what epguard signed, in a pod whose other
    parts cannot reach the probe, now. Freshness is the caller's (:func:`fresh`): /validate
    against the clock, the controller against the pod's creation time."""
    checked = check_signature(ring, namespace, pod)
    if not checked.ok:
        return checked
    exposed = exposure(pod)
    if exposed is not None:
        return Verification(False, exposed, checked.key_id, checked.signed_at)
    return checked


def check_signature(ring: Keyring, namespace: str, pod: Mapping[str, Any]) -> Verification:
    """Whether the pod's epguard parts are exactly what epguard signed (not whether the
    rest of the pod keeps away from them: :func:`exposure`)."""
    parts = parts_of(pod)
    if not parts.containers:
        return Verification(False, "it carries no epguard probe container")
    if parts.signature is None:
        return Verification(
            False, f"its epguard-* init containers carry no {SIGNATURE_ANNOTATION} annotation"
        )
    fields = parts.signature.split(":")
    # ASCII digits only: str.isdigit() is true of "²", which int() refuses.
    if (len(fields) != 4 or fields[0] not in (FORMAT, OLDER_FORMAT) or not fields[2].isascii()
            or not fields[2].isdigit() or len(fields[2]) > 12):  # fmt: skip
        return Verification(False, f"its {SIGNATURE_ANNOTATION} annotation is malformed")
    key = ring.find(fields[1])
    if key is None:
        return Verification(
            False,
            f"it was signed with key {fields[1][:16]!r}, which epguard does not hold",
            fields[1],
        )
    signed_at = int(fields[2])
    payload = _payload(namespace, pod, signed_at, fields[0])
    expected = hmac.new(key.secret, payload, hashlib.sha256)
    if not hmac.compare_digest(expected.hexdigest().encode(), fields[3].encode()):
        return Verification(
            False,
            "its epguard-* init containers, the epguard-probe volume, the "
            f"{PROBED_LABEL} label or the pod's process, host or security settings differ "
            "from what epguard signed",
            key.id,
        )
    if fields[0] == OLDER_FORMAT:
        return Verification(
            False,
            f"it was signed by an older epguard (format {OLDER_FORMAT}, which did not sign "
            "the probe's termination message)",
            key.id,
            signed_at,
            outdated=True,
        )
    return Verification(True, "", key.id, signed_at)


def fresh(signed_at: int, moment: dt.datetime) -> bool:
    """Whether a signature made at ``signed_at`` may belong to a pod written at ``moment``
    (within FRESH_SECONDS either way: the clocks of two machines)."""
    return abs(moment.timestamp() - signed_at) <= FRESH_SECONDS


def created_at(pod: Mapping[str, Any]) -> dt.datetime | None:
    """The pod's ``metadata.creationTimestamp`` (the API server's clock), if readable."""
    created = as_map(pod.get("metadata")).get("creationTimestamp")
    return parse_stamp(created) if isinstance(created, str) else None


# Signatures the controller has learned from, each with the pod that used it. Bounded:
# a pod can only use a signature within FRESH_SECONDS of it, so a replay is near its
# original in time and in this (oldest-first) order; 50k entries are ~10 MB.
MAX_LEDGER = 50_000


class SignatureLedger:
    """Each signature counts once: the first pod (by uid) that presents it owns it."""

    def __init__(self, limit: int = MAX_LEDGER) -> None:
        self.limit = limit
        self.owners: dict[str, str] = {}  # signature -> pod uid, insertion ordered
        # One ledger per controller, and kopf runs handlers on several threads: two
        # copies of a signature checked at once must not both be the first.
        self._lock = threading.Lock()

    def claim(self, signature: str, uid: str) -> str | None:
        """None when ``uid`` may use ``signature``; else the uid that used it first."""
        with self._lock:
            owner = self.owners.get(signature)
            if owner is not None:
                return None if owner == uid else owner
            self.owners[signature] = uid
            while len(self.owners) > self.limit:
                del self.owners[next(iter(self.owners))]
            return None
