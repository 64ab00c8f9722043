"""cluster/kube.py list_items: every object of a paged list, decoded one at a time, so a
page of tenants' big pods is never parsed at once (the preflight pass reads with it);
and list_pages, the same reader a page at a time (the backstop's and the recorder's
verdict lists, the watches' relists)."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest

from epguard.webhook.cluster.kube import LIST_PAGE, list_items, list_pages


class Response:
    """As urllib3 answers with ``_preload_content=False``: ``read()`` hands the body over
    (``.data`` would keep it cached)."""

    def __init__(self, data: bytes) -> None:
        self._body: bytes | None = data

    def read(self) -> bytes:
        body, self._body = self._body, None
        assert body is not None, "read twice"
        return body


def pod(i: int, entries: int = 0) -> dict[str, Any]:
    env = [{"name": f"E{j}", "value": "x"} for j in range(entries)]
    return {"metadata": {"name": f"p-{i}"}, "spec": {"containers": [{"name": "w", "env": env}]}}


def pager(pages: list[list[Any]], indent: int | None = None, sort_keys: bool = False) -> Any:
    """A list call as the API server answers it (compact JSON, ``items`` last); each
    page's bytes made before any call (the test measures the reading, not this)."""
    calls: list[dict[str, Any]] = []
    bodies = []
    for n, items in enumerate(pages):
        more = {"continue": f"t{n + 1}"} if n + 1 < len(pages) else {}
        body = {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": "7", **more},
            "items": items,
        }
        sep = None if indent else (",", ":")
        text = json.dumps(
            body, indent=indent, separators=sep, ensure_ascii=False, sort_keys=sort_keys
        )
        bodies.append(text.encode())

    def call(**kw: Any) -> Response:
        calls.append(kw)
        return Response(bodies[len(calls) - 1])

    call.calls = calls  # type: ignore[attr-defined]
    call.bodies = bodies  # type: ignore[attr-defined]
    return call


def test_every_item_of_every_page_in_order_with_the_continue_token() -> None:
    tricky = {"metadata": {"name": "x"}, "data": {"s": '],"items":[{', "n": [1, [2, {}]]}}
    call = pager([[pod(0), tricky], [], [pod(2)]])
    got = list(list_items(call, page_size=2, label_selector="a=b"))
    assert got == [pod(0), tricky, pod(2)]
    assert [c["_continue"] for c in call.calls] == [None, "t1", "t2"]
    assert all(c["limit"] == 2 and c["label_selector"] == "a=b" for c in call.calls)


def test_an_indented_body_reads_the_same() -> None:
    call = pager([[pod(0), pod(1)]], indent=2)
    assert [p["metadata"]["name"] for p in list_items(call, page_size=5)] == ["p-0", "p-1"]


def test_a_list_whose_items_come_before_its_metadata_is_read_to_its_last_page() -> None:
    """A custom resource's list is written with sorted keys (apiVersion, items, kind,
    metadata): the continue token comes after the items (the first version of the
    reader took the head before "items" as the list's metadata and stopped at page 1)."""
    call = pager([[pod(0)], [pod(1)], [pod(2)]], sort_keys=True)
    assert call.bodies[0].index(b'"items"') < call.bodies[0].index(b'"continue"')
    assert [p["metadata"]["name"] for p in list_items(call, page_size=1)] == ["p-0", "p-1", "p-2"]
    assert [c["_continue"] for c in call.calls] == [None, "t1", "t2"]


def test_items_that_are_not_objects_are_skipped_and_numbers_read_as_json_reads_them() -> None:
    call = pager([[pod(0), 3, "x", None, {"metadata": {"name": "big"}, "n": 10**30, "f": 1.5}]])
    got = list(list_items(call, page_size=5))
    assert [p["metadata"]["name"] for p in got] == ["p-0", "big"]
    assert got[1]["n"] == 10**30 and got[1]["f"] == 1.5


@pytest.mark.parametrize("wide", [False, True], ids=["ascii", "a-character-past-U+FFFF"])
def test_a_page_of_big_pods_is_never_parsed_at_once(wide: bool) -> None:
    # A str of text holding one character past U+FFFF takes 4 bytes a character: the
    # page is never held as such a str.
    page = [pod(i, 5_000) for i in range(12)]
    if wide:
        for p in page:
            p["metadata"]["annotations"] = {"x": "\U0001f600"}
    text = json.dumps({"items": page}, separators=(",", ":"), ensure_ascii=False).encode()
    tracemalloc.start()
    one = json.loads(json.dumps(page[0]))
    _, one_size = tracemalloc.get_traced_memory()
    del one
    tracemalloc.stop()
    call = pager([page])
    del page
    tracemalloc.start()
    try:
        names = [p["metadata"]["name"] for p in list_items(call, page_size=12)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert names == [f"p-{i}" for i in range(12)]
    # The page's bytes, one item's text and about one parsed pod (12 parsed pods before
    # paging; the page's bytes twice and two parsed pods in the first paged version).
    assert peak < 1.5 * len(text) + 1.5 * one_size, (peak, len(text), one_size)
    assert peak < 12 * one_size / 2


def test_list_pages_reads_every_page_with_the_first_pages_snapshot_version() -> None:
    """A custom resource's list (sorted keys: items before metadata) of three pages; the
    later pages' resourceVersion is not the snapshot's."""
    call = pager([[pod(0), 3], [pod(1)], [pod(2)]], sort_keys=True)
    call.bodies[1] = call.bodies[1].replace(b'"resourceVersion":"7"', b'"resourceVersion":"9"')
    assert b'"resourceVersion":"9"' in call.bodies[1]
    got = list(list_pages(call))
    assert [([p["metadata"]["name"] for p in page], rv) for page, rv in got] == [
        (["p-0"], "7"),
        (["p-1"], "7"),
        (["p-2"], "7"),
    ]
    assert [c["_continue"] for c in call.calls] == [None, "t1", "t2"]
    assert all(c["limit"] == LIST_PAGE for c in call.calls)


def test_list_pages_stops_listing_when_its_caller_stops() -> None:
    call = pager([[pod(0)], [pod(1)], [pod(2)]])
    for page, _ in list_pages(call):
        assert page[0]["metadata"]["name"] == "p-0"
        break
    assert len(call.calls) == 1


def verdict_object(i: int) -> dict[str, Any]:
    """An ImageVerdict as a probe records it: a whole report, its runs, managedFields."""
    fields = {f"f:{k}": {} for k in ("image", "digest", "verdict", "reason", "report", "runs")}
    return {
        "apiVersion": "epguard.io/v1alpha1",
        "kind": "ImageVerdict",
        "metadata": {
            "name": f"iv-{i}",
            "resourceVersion": str(100 + i),
            "managedFields": [{"manager": "epguard-controller", "operation": "Update",
                               "time": "2026-12-05T10:00:00Z",
                               "fieldsV1": {"f:spec": fields}}],
        },
        "spec": {
            "image": f"registry.example/ml/sglang:v{i}",
            "digest": "sha256:" + f"{i:064x}",
            "verdict": "Unusable",
            "reason": f"epguard: torch has no mooncake ({i})\nscope: image\nfix: rebuild",
            "report": "x" * 4000,
            "runs": [{"pod": f"ml/w-{j}", "at": "2026-12-05T10:00:00Z"} for j in range(20)],
            "lastSeen": "2026-12-05T10:00:00Z",
            "pod": "ml/w-0",
            "fix": "rebuild the image\nsecond line",
            "count": 20,
        },
    }  # fmt: skip


def test_a_verdict_listing_keeps_only_what_the_verdict_is_made_of() -> None:
    # Kept whole, 10,000 verdicts with a report were ~160 MB in the webhook (256 Mi).
    from epguard.webhook.cluster.kube import list_all
    from epguard.webhook.engine.verdicts import slim_verdict_object, verdict_from_object

    whole = [verdict_object(i) for i in range(2_000)]
    for obj in whole[:3]:
        assert verdict_from_object(slim_verdict_object(obj)) == verdict_from_object(obj)
    call = pager([whole[n : n + 500] for n in range(0, 2_000, 500)])
    del whole
    tracemalloc.start()
    try:
        items, version = list_all(call, slim=slim_verdict_object)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(items) == 2_000 and version == "7"
    assert "report" not in items[0]["spec"] and "runs" not in items[0]["spec"]
    # ~1 KB a verdict kept, against ~16 KB whole.
    assert kept < 2_000 * 2_000, kept
