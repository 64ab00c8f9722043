"""Verdicts learned from probe runs (ImageVerdict): digest pins deny, tags deny within a TTL."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from epguard.webhook.controller.compiler import compile_params
from epguard.webhook.engine.imageref import parse
from epguard.webhook.engine.policy import decide
from epguard.webhook.engine.verdicts import VerdictStore, verdict_from_object
from tests.factory import container, make_state, pod, request

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
IMAGE = "registry.example.com/ml/sglang:v0.5.18-custom"
DIGEST = "sha256:" + "ef" * 32
OTHER_DIGEST = "sha256:" + "01" * 32


def imageverdict(
    name: str = "iv-1",
    image: str = IMAGE,
    digest: str = DIGEST,
    verdict: str = "Unusable",
    last_seen: dt.datetime = NOW - dt.timedelta(hours=1),
) -> dict[str, Any]:
    return {
        "apiVersion": "epguard.io/v1alpha1",
        "kind": "ImageVerdict",
        "metadata": {"name": name},
        "spec": {
            "image": image,
            "digest": digest,
            "verdict": verdict,
            "reason": "ImportError: Mooncake PG was not built against torch==2.13.0.\nmore",
            "versions": {"sglang": "0.5.18", "torch": "2.13.0", "mooncake": "0.3.11"},
            "firstSeen": "2026-11-29T10:00:00Z",
            "lastSeen": last_seen.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "pod": "ml/worker-0",
            "count": 3,
        },
    }


def store_with(*objs: dict[str, Any], ttl_hours: float = 24) -> VerdictStore:
    store = VerdictStore(dt.timedelta(hours=ttl_hours))
    for o in objs:
        v = verdict_from_object(o)
        assert v is not None
        store.upsert(v, now=NOW)
    return store


def judge(image: str, store: VerdictStore) -> Any:
    state = make_state()
    state.verdicts = store
    return decide(request(pod([container(image=image)])), state, now=NOW)


def test_denies_a_digest_pinned_image_with_an_unusable_verdict_and_says_where_it_was_learned() -> (
    None
):
    d = judge(f"registry.example.com/ml/sglang@{DIGEST}", store_with(imageverdict()))
    assert not d.allowed
    assert "Mooncake PG was not built against torch==2.13.0" in (d.message or "")
    assert "seen failing in pod ml/worker-0 at 2026-11-30T11:00:00Z" in (d.message or "")
    assert "[epguard verdict iv-1]" in (d.message or "")
    assert d.fired == ("verdict:iv-1",)


def test_another_namespace_is_refused_without_the_pod_that_failed_being_named() -> None:
    """A tenant that named another's private image learnt from the refusal the other
    tenant's namespace, pod and when it ran (review helpers): ImageVerdicts are not
    readable by tenants, so the refusal must not tell them either."""
    state = make_state()
    state.verdicts = store_with(imageverdict())
    for image in (f"registry.example.com/ml/sglang@{DIGEST}", IMAGE):
        d = decide(request(pod([container(image=image)]), namespace="team-b"), state, now=NOW)
        assert not d.allowed
        message = d.message or ""
        assert "Mooncake PG was not built against torch==2.13.0" in message
        assert "(seen failing in another namespace)" in message
        assert "worker-0" not in message and "in pod" not in message
    stale = store_with(imageverdict(last_seen=NOW - dt.timedelta(hours=25)))
    state.verdicts = stale
    d = decide(request(pod([container(image=IMAGE)]), namespace="team-b"), state, now=NOW)
    assert d.allowed and d.warnings
    assert all("worker-0" not in w for w in d.warnings)
    assert any("seen failing in another namespace" in w for w in d.warnings)


def test_digest_verdicts_do_not_expire() -> None:
    old = imageverdict(last_seen=NOW - dt.timedelta(days=30))
    assert not judge(f"registry.example.com/ml/sglang@{DIGEST}", store_with(old)).allowed


def test_denies_a_tag_within_the_ttl() -> None:
    assert not judge(IMAGE, store_with(imageverdict())).allowed


def test_only_warns_on_a_tag_after_the_ttl() -> None:
    d = judge(IMAGE, store_with(imageverdict(last_seen=NOW - dt.timedelta(hours=25))))
    assert d.allowed
    assert any("older than the TTL" in w and "Pin the image by digest" in w for w in d.warnings)


def test_a_newer_usable_outcome_replaces_an_unusable_one() -> None:
    store = store_with(
        imageverdict("iv-old", verdict="Unusable", last_seen=NOW - dt.timedelta(hours=2)),
        imageverdict("iv-new", digest=OTHER_DIGEST, verdict="Usable", last_seen=NOW),
    )
    d = judge(IMAGE, store)
    assert d.allowed and d.warnings == ()


def test_deleting_the_imageverdict_clears_it() -> None:
    store = store_with(imageverdict())
    store.delete("iv-1")
    d = judge(IMAGE, store)
    assert d.allowed
    assert any("add the epguard probe" in w for w in d.warnings)


def test_a_tag_verdict_about_other_bytes_does_not_judge_a_different_pinned_digest() -> None:
    d = judge(f"{IMAGE}@{OTHER_DIGEST}", store_with(imageverdict()))
    assert d.allowed


def test_ignores_verdict_objects_it_cannot_use() -> None:
    assert verdict_from_object({"metadata": {"name": "x"}, "spec": {"image": IMAGE}}) is None
    assert (
        verdict_from_object(
            {"metadata": {"name": "x"}, "spec": {"image": IMAGE, "verdict": "Maybe"}}
        )
        is None
    )
    assert verdict_from_object([1, 2]) is None
    v = verdict_from_object(
        {"metadata": {"name": "x"}, "status": {"image": "bad IMAGE", "verdict": "Unusable"}}
    )
    assert v is not None and v.ref is None and v.last_seen is None


def test_a_tag_verdict_without_a_time_is_treated_as_stale() -> None:
    obj = imageverdict()
    del obj["spec"]["lastSeen"]
    d = judge(IMAGE, store_with(obj))
    assert d.allowed and any("older than the TTL" in w for w in d.warnings)


def test_the_index_follows_every_change_without_a_full_rebuild() -> None:
    older = imageverdict("iv-old", verdict="Unusable", last_seen=NOW - dt.timedelta(hours=3))
    newer = imageverdict("iv-new", verdict="Usable", last_seen=NOW - dt.timedelta(hours=1))
    store = store_with(older, newer)
    ref = parse(f"{IMAGE}@{DIGEST}")
    hit = store.lookup(ref, NOW)
    assert hit is not None and hit.verdict.object_name == "iv-new"
    # Deleting the winner hands the key back to the next newest.
    store.delete("iv-new")
    hit = store.lookup(ref, NOW)
    assert hit is not None and hit.verdict.object_name == "iv-old" and hit.trust == "deny"
    # Moving a verdict to another digest leaves its old key.
    moved = verdict_from_object(imageverdict("iv-old", digest=OTHER_DIGEST))
    assert moved is not None and store.upsert(moved)
    # The tag now names other bytes than the digest pinned here: no answer for it.
    assert store.lookup(ref, NOW) is None
    assert store.lookup(parse(f"other.example.com/x@{DIGEST}"), NOW) is None
    assert store.lookup(parse(f"other.example.com/x@{OTHER_DIGEST}"), NOW) is not None


def test_a_full_store_refuses_new_names_and_counts_them() -> None:
    store = VerdictStore(cap=2)
    for n in range(4):
        v = verdict_from_object(imageverdict(f"iv-{n}", digest="sha256:" + f"{n:02x}" * 32))
        assert v is not None
        assert store.upsert(v) is (n < 2)
    assert len(store) == 2 and store.dropped == 2
    # An update of a verdict already held is never refused.
    again = verdict_from_object(imageverdict("iv-0", verdict="Usable"))
    assert again is not None and store.upsert(again)


def test_scan_verdicts_never_crowd_out_the_probes() -> None:
    """A recorder that wrote 50,000 scan verdicts (no scan needed) filled the store, and
    after a restart, listed by name (`scan-…` before `sha256-…`), every probe verdict was
    dropped (review helper). Scans have a share of their own."""

    def scan(n: int) -> Any:
        obj = imageverdict(f"scan-{n}", digest="sha256:" + f"{n:02x}" * 32)
        obj["spec"] |= {"source": "scan", "recordedBy": "system:serviceaccount:ci:scanner"}
        return verdict_from_object(obj)

    probes = [
        verdict_from_object(imageverdict(f"sha256-{n}", digest="sha256:" + f"{n + 50:02x}" * 32))
        for n in range(2)
    ]
    store = VerdictStore(cap=2, scan_cap=2)
    assert [store.upsert(scan(n)) for n in range(3)] == [True, True, False]
    assert all(store.upsert(p) for p in probes)
    assert len(store) == 4 and store.dropped == 1
    relisted = VerdictStore(cap=2, scan_cap=2)
    relisted.replace([scan(n) for n in range(5)] + probes)  # in name order, as listed
    for n in range(2):
        hit = relisted.lookup(parse(f"r.example/x@sha256:{f'{n + 50:02x}' * 32}"), NOW)
        assert hit is not None and hit.trust == "deny"
    assert relisted.dropped == 3
    # An admin's edit that turns a held probe verdict into a scan one takes a scan place.
    turned = verdict_from_object(imageverdict("sha256-0", digest="sha256:" + "32" * 32))
    assert turned is not None
    turned = dataclasses.replace(turned, source="scan")
    assert not relisted.upsert(turned)  # the scans' share is full


# --- times in the future ---------------------------------------------------------------

FUTURE = dt.datetime(2099, 1, 1, tzinfo=dt.UTC)


def written(obj: dict[str, Any], at: dt.datetime) -> dict[str, Any]:
    """``obj`` as the API server returns it after a write at ``at``: the writer's
    managedFields entry carries the server's time of the write."""
    obj["metadata"]["managedFields"] = [{
        "manager": "epguard-scan", "operation": "Update", "apiVersion": "epguard.io/v1alpha1",
        "time": at.strftime("%Y-%m-%dT%H:%M:%SZ"), "fieldsType": "FieldsV1",
        "fieldsV1": {"f:spec": {}},
    }]  # fmt: skip
    return obj


def test_a_verdict_dated_in_the_future_refuses_a_tag_only_for_the_ttl_after_its_write() -> None:
    store = store_with(written(imageverdict(last_seen=FUTURE), NOW - dt.timedelta(hours=1)))
    assert not judge(IMAGE, store).allowed
    state = make_state()
    state.verdicts = store
    later = decide(request(pod([container(image=IMAGE)])), state, now=NOW + dt.timedelta(days=2))
    assert later.allowed
    assert any("older than the TTL" in w for w in later.warnings)


def test_a_verdict_dated_in_the_future_does_not_outrank_a_newer_one() -> None:
    forged = written(imageverdict("scan-x", last_seen=FUTURE), NOW - dt.timedelta(hours=2))
    newer = written(imageverdict("iv-new", verdict="Usable", last_seen=NOW - dt.timedelta(hours=1)),
                    NOW - dt.timedelta(hours=1))  # fmt: skip
    for image in (IMAGE, f"registry.example.com/ml/sglang@{DIGEST}"):
        d = judge(image, store_with(forged, newer))
        assert d.allowed and d.warnings == (), image


def test_a_future_time_is_held_at_when_it_was_first_seen_across_relists() -> None:
    # No managedFields to bound it (a writer may send its own): the time it was first
    # seen does, and a re-list or a re-delivered event does not move it later.
    obj = imageverdict(last_seen=FUTURE)
    v = verdict_from_object(obj)
    assert v is not None and v.last_seen == FUTURE
    store = VerdictStore()
    first_seen = NOW - dt.timedelta(hours=30)
    store.upsert(v, now=first_seen)
    store.upsert(v, now=NOW)
    store.replace([v], now=NOW)
    hit = store.lookup(parse(IMAGE), NOW)
    assert hit is not None and hit.verdict.last_seen == first_seen and hit.trust == "warn"
    # A new lastSeen is a new claim, held from when it is seen.
    moved = verdict_from_object(imageverdict(last_seen=FUTURE + dt.timedelta(days=1)))
    assert moved is not None
    store.upsert(moved, now=NOW)
    hit = store.lookup(parse(IMAGE), NOW)
    assert hit is not None and hit.verdict.last_seen == NOW and hit.trust == "deny"


def test_a_time_in_the_past_is_kept_as_written() -> None:
    obj = written(imageverdict(last_seen=NOW - dt.timedelta(hours=3)), NOW - dt.timedelta(hours=2))
    v = verdict_from_object(obj)
    assert v is not None and v.last_seen == NOW - dt.timedelta(hours=3)


def test_a_verdict_on_a_pinned_reference_says_nothing_about_its_tag() -> None:
    # One tenant pins a broken build under a good tag's name (name:tag@digest: the
    # runtime pulls the digest); the verdict is about those bytes, so another tenant's
    # pod on the tag alone is not refused, in the webhook or in the backstop's entries.
    pinned = imageverdict(image=f"{IMAGE}@{DIGEST}")
    store = store_with(pinned)
    assert judge(IMAGE, store).allowed
    assert not judge(f"{IMAGE}@{DIGEST}", store).allowed
    assert not judge(f"registry.example.com/ml/sglang@{DIGEST}", store).allowed
    (shard,) = compile_params(store, NOW).shards
    assert shard["t"] == {} and len(shard["d"]) == 1
    # ... and a Usable one on a pinned good build does not clear a bad tag.
    bad_tag = imageverdict(name="iv-tag", digest=OTHER_DIGEST)
    good_pin = imageverdict(
        name="iv-pin", image=f"{IMAGE}@{DIGEST}", verdict="Usable", last_seen=NOW
    )
    assert not judge(IMAGE, store_with(bad_tag, good_pin)).allowed


def test_a_relist_keeps_answering_with_the_old_verdicts_until_the_new_are_whole() -> None:
    # Emptied first and refilled in place, the store answered "no verdict" to reviews
    # while a relist ran on the watch's thread (lookup takes no lock).
    store = VerdictStore()
    first = verdict_from_object(imageverdict())
    assert first is not None
    store.replace([first], NOW)
    seen = []

    def relisted() -> Any:
        for i in range(3):
            seen.append(store.lookup(parse(f"{IMAGE}@{DIGEST}"), NOW))  # a review meanwhile
            v = verdict_from_object(imageverdict(name=f"iv-{i}", verdict="Usable"))
            assert v is not None
            yield v

    store.replace(relisted(), NOW)
    assert [hit is not None and hit.trust == "deny" for hit in seen] == [True, True, True]
    after = store.lookup(parse(f"{IMAGE}@{DIGEST}"), NOW)
    assert after is not None and after.trust == "usable"


def test_a_listed_verdict_keeps_the_newest_write_time_of_many_managers() -> None:
    # Cut to the first 64 managedFields entries, a listing could miss the newest write
    # that an event of the same object would see.
    from epguard.webhook.engine.verdicts import slim_verdict_object

    obj = imageverdict(last_seen=NOW)
    old = [{"manager": f"m{i}", "time": "2026-11-01T00:00:00Z"} for i in range(100)]
    obj["metadata"]["managedFields"] = [*old, {"manager": "new", "time": "2026-11-30T11:00:00Z"}]
    whole, slim = verdict_from_object(obj), verdict_from_object(slim_verdict_object(obj))
    assert whole is not None and slim is not None
    assert slim.last_seen == whole.last_seen == dt.datetime(2026, 11, 30, 11, tzinfo=dt.UTC)
