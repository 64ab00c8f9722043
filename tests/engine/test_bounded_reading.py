"""Hostile command lines are judged on the safe side with bounded memory (timings are
printed by bench/argv_bench.py, not asserted here)."""

from __future__ import annotations

import tracemalloc

import pytest

from epguard.webhook.engine.argv import analyse_container
from epguard.webhook.engine.policy import decide
from epguard.webhook.engine.workloads import MAX_VISITS
from tests.factory import BAD_IMAGE, container, make_state, request
from tests.hostile_pods import CONTAINERS, doubling_env_pod, many_words_pod, nested_script_pod

MAX_PEAK = 50 * 2**20


@pytest.mark.parametrize(
    "obj",
    [nested_script_pod(), nested_script_pod(30 * 1024), many_words_pod(), doubling_env_pod()],
    ids=[
        "48 x 64 KB nested scripts",
        "48 x 30 KB nested scripts",
        "48 x 1000 words",
        "doubling env chain",
    ],
)
def test_hostile_pods_are_refused_with_bounded_memory(obj: dict[str, object]) -> None:
    state = make_state()
    req = request(obj)
    tracemalloc.start()
    try:
        decision = decide(req, state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not decision.allowed  # the image is refused; every worker reads as "requested"
    assert peak < MAX_PEAK


def test_a_nested_script_inside_the_budget_is_read_exactly() -> None:
    small = nested_script_pod(4 * 1024)
    containers = small["spec"]["containers"]  # type: ignore[index]
    reports = [analyse_container(c) for c in containers]
    assert len(reports) == CONTAINERS
    assert all(r.requests_mooncake and not r.over_budget for r in reports)


def _disaggregated(roles: list[dict[str, object]]) -> dict[str, object]:
    return {
        "apiVersion": "disaggregatedset.x-k8s.io/v1",
        "kind": "DisaggregatedSet",
        "metadata": {"name": "d", "namespace": "ml"},
        "spec": {"roles": roles},
    }


def test_an_object_too_large_to_read_is_answered_by_mode_not_taken_for_no_pods() -> None:
    """Past the walk's budget the object read as one without pods and was admitted: 9,999
    empty roles and then one worker on a refused image (found by a review helper)."""
    bad = {"spec": {"leaderWorkerTemplate": {"workerTemplate": {"spec": {"containers": [
        container(image=BAD_IMAGE)]}}}}}  # fmt: skip
    obj = _disaggregated([{} for _ in range(MAX_VISITS)] + [bad])
    refused = decide(request(obj), make_state())
    assert not refused.allowed and "too large for epguard" in refused.message
    warned = decide(request(obj), make_state(default_mode="warn"))
    assert warned.allowed and any("too large" in w for w in warned.warnings)
    # An update of an object that was already that large is not blocked by it.
    relabelled = decide(request(obj, operation="UPDATE", old=obj), make_state())
    assert relabelled.allowed
    # The object's own exemption holds, as for any denial.
    skipped = {**obj, "metadata": {"name": "d", "namespace": "ml",
                                   "annotations": {"epguard.io/skip": "load test"}}}  # fmt: skip
    exempted = decide(request(skipped), make_state())
    assert exempted.allowed and exempted.result == "exempted"
    # Within the budget, the same worker is read and refused by its image.
    small = decide(request(_disaggregated([{}, bad])), make_state())
    assert not small.allowed and "too large" not in small.message


def test_the_judged_argv_cache_keeps_no_tenant_env_past_its_bounds() -> None:
    """A script that names a huge env value (never expanded: it is single-quoted) beside a
    worker, different in each pod: the controller judges every gated pod's containers each
    pass, and the cache kept each value whole (1.3 MB a pod, up to 2,048 of them)."""
    from epguard.probe import shell
    from epguard.webhook.engine import argv

    value = "x" * (shell.BUDGET + 1)
    tracemalloc.start()
    try:
        for i in range(40):
            analyse_container(
                {
                    "name": "side",
                    "image": "busybox",
                    "command": ["sh", "-c", "echo '$A'"],
                    "env": [{"name": "A", "value": f"{i}{value}"}],
                }
            )
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 4 * shell.BUDGET  # 40 kept values would be 40 x 32 KiB
    assert all(argv.key_chars(*key) <= shell.BUDGET for key in argv._cache)
    assert argv._cache_chars <= argv.CACHE_CHARS
