"""``epguard scan --record``: the scan's outcome as an ImageVerdict the webhook acts on.

An image cause the scan found is written as an ``Unusable`` ImageVerdict named
``scan-<manifest digest>``, with ``source: scan`` and ``recordedBy``, the caller as the
API server names it (a SelfSubjectReview, not a value the caller chooses). The webhook
and the outage backstop then refuse pods on that image before any is scheduled, as they
do for a probe's verdict.

Why only ``Unusable``: a scan without a cause proves nothing about the driver, the GPU
or the smoke test, so it never writes ``Usable``. A passing scan of bytes that have a
scan verdict deletes that verdict (an epguard release that no longer finds the cause,
say): the scan takes back what a scan said, and nothing else.

Who may write: the chart's ``scanRecorder.serviceAccounts`` (the ClusterRole and the
ValidatingAdmissionPolicy in ``templates/rbac-scan-recorder.yaml``). RBAC cannot limit
``create`` by name or by field, so the policy holds a recorder to exactly what this
module writes: ``scan-`` names matching the digest, ``source: scan``, ``recordedBy`` its
own username, ``Unusable``, and never a probe's verdict.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from epguard.probe.diagnosis import versions_line
from epguard.webhook.cluster.kube import REQUEST_TIMEOUT, get_verdict
from epguard.webhook.engine.imageref import ImageRefError, parse
from epguard.webhook.engine.outcome import parse_versions
from epguard.webhook.engine.text import cut, first_line
from epguard.webhook.engine.verdicts import (
    GROUP,
    PLURAL,
    SOURCE_SCAN,
    VERSION,
    ImageVerdictSpec,
    build_spec,
    verdict_name,
    verdict_object,
)
from epguard.webhook.scan.report import text
from epguard.webhook.scan.scanner import Result

# Also the field manager of every write: the chart's policy checks lastSeen against the
# API server's time of this manager's write (templates/rbac-scan-recorder.yaml).
MANAGER = "epguard-scan"
# The CRD caps ``report`` at 16384 characters; the scan's text may run to 64 KiB.
MAX_REPORT = 16_000
MAX_REASON = MAX_FIX = 4_000
WRITE_ATTEMPTS = 5

Action = Literal["created", "updated", "deleted", "nothing"]


class TargetError(ValueError):
    """``--image`` cannot name these bytes (exit 2, as any bad input)."""


class RecordError(RuntimeError):
    """The API server did not take the record (one line, for the CLI: exit 3)."""


@dataclass(frozen=True, slots=True)
class Target:
    """What the verdict is about: the reference pods will use and the manifest digest."""

    image: str
    digest: str

    @property
    def name(self) -> str:
        return verdict_name(self.image, self.digest, SOURCE_SCAN)


@dataclass(frozen=True, slots=True)
class Recorded:
    name: str
    action: Action
    identity: str

    def line(self) -> str:
        if self.action == "nothing":
            return (
                f"epguard scan --record: nothing recorded (no image cause; only a GPU node "
                f"can prove the image usable), as {self.identity}"
            )
        return f"epguard scan --record: ImageVerdict {self.name} {self.action} as {self.identity}"


def target(result: Result, image: str) -> Target:
    """The verdict's subject: ``image`` (normalized) and the archive's manifest digest,
    which must be the one ``image`` pins, if it pins one."""
    try:
        ref = parse(image)
    except ImageRefError as exc:
        raise TargetError(f"--image {image!r}: {exc}") from None
    if result.digest is None:
        raise TargetError(
            f"--record needs the image's manifest digest, and a {result.kind} has none (it "
            "is not the bytes a registry serves): scan the OCI archive or layout you push"
        )
    if ref.digest and result.platform_digest \
            and ref.digest.lower() == result.platform_digest.lower():
        raise TargetError(
            f"--image pins {ref.digest}, the {result.kind}'s platform manifest inside the "
            f"image index {result.digest}: pods that pull the tag run, and the kubelet "
            f"reports, the index digest; pin {result.digest}"
        )
    if ref.digest and ref.digest.lower() != result.digest.lower():
        raise TargetError(
            f"--image pins {ref.digest}, but the scanned manifest is {result.digest}: "
            "record the image you scanned"
        )
    return Target(image=str(ref), digest=result.digest.lower())


def spec(
    result: Result,
    subject: Target,
    identity: str,
    now: dt.datetime,
    previous: Mapping[str, Any] | None = None,
) -> ImageVerdictSpec:
    """The ImageVerdict spec for a scan with at least one cause; count and firstSeen
    carry from ``previous``, so re-recording on every CI run counts the runs."""
    if not result.causes:
        raise ValueError("a scan without an image cause records no verdict")
    primary = result.causes[0]
    return build_spec(
        image=subject.image,
        digest=subject.digest,
        verdict="Unusable",
        reason=first_line(primary.cause, MAX_REASON),
        report=cut(text(result), MAX_REPORT),
        # The probe's own `versions:` line, read as the controller reads a probe's.
        versions=parse_versions(versions_line(result.versions)),
        source=SOURCE_SCAN,
        now=now,
        previous=previous,
        omit_empty_versions=True,
        fix=first_line(primary.fix, MAX_FIX),
        recorded_by=identity,
    )


def _api_message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = None
    message = body.get("message") if isinstance(body, dict) else None
    return str(message or exc.reason or "no message")[:2000]


def _failure(exc: ApiException, what: str, identity: str) -> RecordError:
    message = _api_message(exc)
    if exc.status == 401:
        return RecordError(f"{what}: the API server did not accept the credentials: {message}")
    if exc.status == 403:
        return RecordError(
            f"{what}: forbidden for {identity}: the epguard chart lets only the "
            f"ServiceAccounts in scanRecorder.serviceAccounts record scans ({message})"
        )
    if exc.status == 404:
        return RecordError(
            f"{what}: the API server has no {PLURAL}.{GROUP}: is the epguard chart installed? "
            f"({message})"
        )
    return RecordError(f"{what}: refused by the API server (HTTP {exc.status}): {message}")


def whoami(api: client.ApiClient) -> str:
    """The caller's username as the API server sees it (SelfSubjectReview, GA in 1.28;
    every authenticated user may create one)."""
    try:
        review = client.AuthenticationV1Api(api).create_self_subject_review(
            client.V1SelfSubjectReview(), _request_timeout=REQUEST_TIMEOUT
        )
    except ApiException as exc:
        raise _failure(exc, "asking the API server who this is", "this caller") from None
    user = getattr(getattr(review, "status", None), "user_info", None)
    name = getattr(user, "username", None)
    if not isinstance(name, str) or not name:
        raise RecordError("the API server's SelfSubjectReview named no user")
    return name


def record(api: client.ApiClient, result: Result, subject: Target, now: dt.datetime) -> Recorded:
    """Write (cause found) or take back (none found) the scan's verdict for ``subject``."""
    try:
        return _record(api, result, subject, now)
    except HTTPError as exc:  # connection refused, timeouts, TLS: no answer at all
        raise RecordError(f"cannot reach the API server: {exc}") from None


def _record(api: client.ApiClient, result: Result, subject: Target, now: dt.datetime) -> Recorded:
    identity = whoami(api)
    custom = client.CustomObjectsApi(api)
    name = subject.name
    for _ in range(WRITE_ATTEMPTS):
        try:
            existing = get_verdict(custom, name)
        except ApiException as exc:
            raise _failure(exc, f"reading ImageVerdict {name}", identity) from None
        try:
            if not result.causes:
                if existing is None:
                    return Recorded(name, "nothing", identity)
                custom.delete_cluster_custom_object(
                    GROUP, VERSION, PLURAL, name, _request_timeout=REQUEST_TIMEOUT
                )
                return Recorded(name, "deleted", identity)
            previous = existing.get("spec") if existing is not None else None
            body = verdict_object(
                name, spec(result, subject, identity, now, previous), MANAGER, existing
            )
            if existing is None:
                custom.create_cluster_custom_object(
                    GROUP,
                    VERSION,
                    PLURAL,
                    dict(body),
                    field_manager=MANAGER,
                    _request_timeout=REQUEST_TIMEOUT,
                )
                return Recorded(name, "created", identity)
            custom.replace_cluster_custom_object(
                GROUP,
                VERSION,
                PLURAL,
                name,
                dict(body),
                field_manager=MANAGER,
                _request_timeout=REQUEST_TIMEOUT,
            )
            return Recorded(name, "updated", identity)
        except ApiException as exc:
            if exc.status == 409:  # another run wrote it between our read and write
                continue
            if exc.status == 404 and existing is not None:
                continue  # deleted meanwhile: read again
            raise _failure(exc, f"writing ImageVerdict {name}", identity) from None
    raise RecordError(f"ImageVerdict {name}: {WRITE_ATTEMPTS} write conflicts in a row")
