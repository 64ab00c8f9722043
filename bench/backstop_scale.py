"""The outage backstop end to end at scale, through a real kube-apiserver with no webhook
(tests/e2e/test_backstop_scale.py's steps, at counts too slow for the test suite): N real
Unusable ImageVerdicts created through the API, the controller's own sync (list a page at
a time, compile, install, write the shards) with its time and peak Python memory, then
every digest and every tag refused by the API server, and the API server's policy-check
counter (a decision turned into an admission by an error -- a CEL cost budget exceeded
under failurePolicy Ignore -- would count as "allow"). Prints figures; asserts nothing
but what it reports as FAILED.

    .venv/bin/python bench/backstop_scale.py [--count 100000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epguard.webhook.controller.backstop import BackstopState, sync_once
from tests.e2e.test_backstop_scale import (
    CONFIG,
    backstop_cluster,
    create_verdicts,
    digest_of,
    image_of,
    policy_checks,
    refused_all,
    stored_shards,
    wait_refused,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000)
    n = parser.parse_args().count
    with backstop_cluster() as cluster:
        create_verdicts(cluster, n)
        state = BackstopState(config=CONFIG, rules_configmap="epguard-rules",
                              rules_key="rules.yaml", tag_ttl=dt.timedelta(hours=24))  # fmt: skip
        t0 = time.perf_counter()
        params = sync_once(cluster.api, state, dt.datetime.now(dt.UTC))
        took = time.perf_counter() - t0
        state.compiled = None  # measure a full read and compile again, traced
        tracemalloc.start()
        sync_once(cluster.api, state, dt.datetime.now(dt.UTC))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        shards = stored_shards(cluster)
        print(f"controller sync: {took:.1f}s, peak {peak / 2**20:.0f} MiB (traced run); "
              f"kept {params.kept}, dropped {params.dropped}, {len(shards)} shards")  # fmt: skip
        wait_refused(cluster, f"registry.example.com/team-0/sglang@{digest_of(n, 0)}", 300)
        before = policy_checks(cluster)
        t0 = time.monotonic()
        pinned = [f"registry.example.com/team-{i % 100}/sglang@{digest_of(n, i)}" for i in range(n)]
        missed = [p for p, m in zip(pinned, refused_all(cluster, pinned), strict=True) if m is None]
        tags = [image_of(n, i) for i in range(n)]
        missed += [t for t, m in zip(tags, refused_all(cluster, tags), strict=True) if m is None]
        after = policy_checks(cluster)
        print(f"{2 * n - len(missed)} of {2 * n} images refused in {time.monotonic() - t0:.0f}s"
              f"{'' if not missed else ' FAILED, first missed: ' + missed[0]}")  # fmt: skip
        allowed = after.get("allow", 0) - before.get("allow", 0)
        denied = after.get("deny", 0) - before.get("deny", 0)
        print(f"API server policy checks: deny +{denied:.0f}, allow (an error admitted) "
              f"+{allowed:.0f}")  # fmt: skip
        return 1 if missed or allowed else 0


if __name__ == "__main__":
    raise SystemExit(main())
