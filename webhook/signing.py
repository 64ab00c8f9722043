"""Signed injection: proof that a pod's probe containers are the ones epguard injected.

A learned verdict refuses other people's pods, so the controller may learn only from a
probe epguard itself put in the pod. Anyone who can create a pod can also write an
``epguard-probe`` init container that prints a verdict of its choosing, so a name, a
label or a command line proves nothing. ``/mutate`` therefore signs what it injects —
every ``epguard-*`` init container (image, command, args, env, envFrom, resources,
securityContext, mounts), the probe's volume and the ``epguard.io/probed`` label — with
HMAC-SHA256 under a key held in a Secret that only the webhook and the controller can
read (the controller creates and rotates it, ``controller/probe_key.py``). The signature
goes in the ``epguard.io/probe-signature`` annotation; it also covers the namespace, so
a signed spec copied into another namespace does not verify there.

``/validate`` refuses a pod whose epguard parts are not exactly what was signed, and the
controller records an outcome only when the signature verifies against the pod's
*current* spec (an init container's image can be patched after creation).

Why a projection, not the raw containers: the API server defaults fields after a
mutating webhook's patch (``terminationMessagePolicy``, ``imagePullPolicy``, …). The
signed fields are those epguard sets and the defaulting leaves alone.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from webhook.outcome import PROBED_LABEL
from webhook.workloads import as_list, as_map

# Every init container under this prefix belongs to epguard: /mutate removes the ones a
# tenant wrote and /validate refuses unsigned ones. The prefix is reserved (README).
PREFIX = "epguard-"
SIGNATURE_ANNOTATION = "epguard.io/probe-signature"
PROBE_VOLUME = "epguard-probe"
FORMAT = "v1"

# The Secret's one data key: JSON {"keys": [{"id", "key" (base64), "created"}, ...]},
# newest first. Two keys are kept after a rotation so pods signed just before it verify.
SECRET_KEY = "keys.json"
KEY_BYTES = 32
MAX_KEYS = 3
# A Secret's data is at most 1 MiB; a keyring is a few hundred bytes. Anything larger is
# not ours and is not parsed.
MAX_SECRET_BYTES = 64 * 1024

_CONTAINER_FIELDS = ("name", "image", "command", "args", "env", "envFrom", "securityContext")


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


def _stamp(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_key(now: dt.datetime) -> Key:
    return Key(id=secrets.token_hex(4), secret=secrets.token_bytes(KEY_BYTES), created=_stamp(now))


def new_keyring(now: dt.datetime) -> Keyring:
    return Keyring((new_key(now),))


def rotated(ring: Keyring, now: dt.datetime) -> Keyring:
    """A fresh current key; the previous ones stay (up to MAX_KEYS) to verify older pods."""
    return Keyring((new_key(now), *ring.keys)[:MAX_KEYS])


def key_age(ring: Keyring, now: dt.datetime) -> dt.timedelta | None:
    try:
        created = dt.datetime.strptime(ring.current.created, "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None
    return now.astimezone(dt.UTC) - created.replace(tzinfo=dt.UTC)


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

    def set(self, ring: Keyring | None, error: str | None = None) -> None:
        self.ring = ring
        self.error = error


# --- what is signed --------------------------------------------------------------------


def is_epguard_name(name: object) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def _project_container(c: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {f: c[f] for f in _CONTAINER_FIELDS if c.get(f)}
    resources = as_map(c.get("resources"))
    out["resources"] = {
        section: {str(k): str(v) for k, v in as_map(resources.get(section)).items()}
        for section in ("requests", "limits")
        if as_map(resources.get(section))
    }
    out["volumeMounts"] = [
        {
            "name": m.get("name"),
            "mountPath": m.get("mountPath"),
            "readOnly": bool(m.get("readOnly")),
            "subPath": m.get("subPath") or "",
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


def _payload(
    namespace: str,
    containers: Sequence[Mapping[str, Any]],
    volume: Mapping[str, Any] | None,
    label: str | None,
) -> bytes:
    doc = {
        "format": FORMAT,
        "namespace": namespace,
        "containers": [_project_container(c) for c in containers],
        "volume": dict(volume) if volume is not None else None,
        "label": label,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(
    key: Key,
    namespace: str,
    containers: Sequence[Mapping[str, Any]],
    volume: Mapping[str, Any] | None,
    label: str = "true",
) -> str:
    """The annotation value for these injected parts: ``v1:<key id>:<hex HMAC>``."""
    mac = hmac.new(key.secret, _payload(namespace, containers, volume, label), hashlib.sha256)
    return f"{FORMAT}:{key.id}:{mac.hexdigest()}"


@dataclass(frozen=True, slots=True)
class Verification:
    ok: bool
    reason: str  # why not, in words a tenant and an admin can act on; "" when ok
    key_id: str = ""  # the key the signature names, held or not ("" without a signature)


def verify(ring: Keyring, namespace: str, pod: Mapping[str, Any]) -> Verification:
    """Whether the pod's epguard parts are exactly what epguard signed, now."""
    parts = parts_of(pod)
    if not parts.containers:
        return Verification(False, "it carries no epguard probe container")
    if parts.signature is None:
        return Verification(
            False, f"its epguard-* init containers carry no {SIGNATURE_ANNOTATION} annotation"
        )
    fields = parts.signature.split(":")
    if len(fields) != 3 or fields[0] != FORMAT:
        return Verification(False, f"its {SIGNATURE_ANNOTATION} annotation is malformed")
    key = ring.find(fields[1])
    if key is None:
        return Verification(
            False,
            f"it was signed with key {fields[1][:16]!r}, which epguard does not hold",
            fields[1],
        )
    expected = sign(key, namespace, parts.containers, parts.volume, parts.label or "")
    if not hmac.compare_digest(expected.encode(), parts.signature.encode()):
        return Verification(
            False,
            "its epguard-* init containers, the epguard-probe volume or the "
            f"{PROBED_LABEL} label differ from what epguard injected",
            key.id,
        )
    return Verification(True, "", key.id)
