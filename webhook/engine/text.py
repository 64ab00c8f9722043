"""How epguard writes a time and cuts a message, in every part that does.

A time is RFC 3339 in UTC to the second (``2026-11-30T20:00:00Z``): ImageVerdicts'
``firstSeen``/``lastSeen``, the probe-signing keys' ``created``, what a refusal says
about when a verdict was seen. A message's first line is what an ImageVerdict's
``reason``, ``fix`` and ``versions`` keep of what the probe or the scan said, and a
text over a limit is cut with an ellipsis that says so.
"""

from __future__ import annotations

import datetime as dt

STAMP_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def stamp(moment: dt.datetime) -> str:
    """``moment`` as RFC 3339 in UTC, to the second."""
    return moment.astimezone(dt.UTC).strftime(STAMP_FORMAT)


def parse_stamp(value: str) -> dt.datetime | None:
    """A time written by :func:`stamp` (as the API server writes its own), in UTC; None
    when ``value`` is not one."""
    try:
        return dt.datetime.strptime(value, STAMP_FORMAT).replace(tzinfo=dt.UTC)
    except ValueError:
        return None


def parse_time(value: object) -> dt.datetime | None:
    """An RFC 3339 time as the API server writes it (``...Z``, fractional seconds
    allowed), in UTC; None if ``value`` is not one. Lenient, for times others write
    (the API server, a container's status, an object a tenant may have edited), where
    :func:`parse_stamp` takes only epguard's own."""
    if not isinstance(value, str) or not value:
        return None
    try:
        t = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, the last one an ellipsis so that a cut text
    says so."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def first_line(text: str, limit: int | None = None) -> str:
    """The first line of ``text`` once stripped ("" for none), :func:`cut` to ``limit``."""
    lines = text.strip().splitlines()
    line = lines[0] if lines else ""
    return line if limit is None else cut(line, limit)
