"""The one way epguard writes a time, cuts a text and names an object."""

from __future__ import annotations

import datetime as dt

from epguard.webhook.engine.text import cut, first_line, parse_stamp, stamp
from epguard.webhook.engine.workloads import describe, describe_object


def test_a_stamp_is_utc_to_the_second_and_reads_back() -> None:
    moment = dt.datetime(2026, 11, 30, 22, 0, 7, 123, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert stamp(moment) == "2026-11-30T20:00:07Z"
    assert parse_stamp("2026-11-30T20:00:07Z") == moment.replace(microsecond=0)
    assert parse_stamp("2026-11-30 20:00:07") is None


def test_the_first_line_is_stripped_and_cut_with_an_ellipsis() -> None:
    assert first_line("  \n first \nsecond") == "first "
    assert first_line(" \n ") == ""
    assert first_line("abcdef", 4) == "abc…"
    assert cut("abcd", 4) == "abcd" and cut("abcde", 4) == "abc…"


def test_an_object_is_kind_namespace_and_name() -> None:
    assert describe("Pod", "ml", "w-0") == "Pod ml/w-0"
    assert describe("ClusterRole", None, "x") == "ClusterRole x"
    pod = {"kind": "Pod", "metadata": {"namespace": "ml", "generateName": "w-"}}
    assert describe_object(pod) == "Pod ml/w-"
    assert describe_object({"metadata": {}}) == "object <unnamed>"
