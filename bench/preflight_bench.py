"""The preflight controller's passes at scale, on the in-memory API of its unit tests
(tests/controller/test_gatekeeper.py): N gated pods over namespaces and images. Prints the
preflights started (at most one per namespace and image), the time of the passes that
start them (run one after another, as the controller runs them; the in-memory creates
never spend a pass's CREATE_SECONDS, so one here) and of the pass that decides every
gate once they finished, and the peak Python memory of a pass. The API server's own
time is not in these figures (the real node: tests/e2e/test_preflight_on_node.py).

    .venv/bin/python bench/preflight_bench.py
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.controller.test_gatekeeper import CLEAR, gated_pod, setup


def run(pods: int, namespaces: int, images: int) -> tuple[int, int, float, float, int, float]:
    pf, api, _, _ = setup()
    for i in range(pods):
        api.add(
            gated_pod(f"w-{i}", image=f"r.example/sglang:{(i // namespaces) % images}",
                      namespace=f"team-{i % namespaces}")
        )  # fmt: skip
    started = time.perf_counter()
    created, passes = 0, 0
    while True:  # as the controller's loop: the next pass at once while some are left
        done = pf.run_once()
        created, passes = created + len(done.created), passes + 1
        if not done.deferred:
            break
    start_s = time.perf_counter() - started
    for preflight in api.preflights():
        api.finish(preflight, 0, CLEAR)
    tracemalloc.start()
    started = time.perf_counter()
    ungated = len(pf.run_once().ungated)
    decide_s = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return created, passes, start_s, decide_s, ungated, peak / 2**20


def main() -> None:
    print(f"{'pods':>6} {'ns':>4} {'images':>6} {'preflights':>10} {'start passes':>17} "
          f"{'decide pass':>12} {'ungated':>8} {'peak MiB':>9}")  # fmt: skip
    for pods, namespaces, images in ((200, 20, 5), (2000, 20, 5), (2000, 200, 50)):
        created, passes, start_s, decide_s, ungated, peak = run(pods, namespaces, images)
        bound = min(pods, namespaces * images)
        assert created <= bound, (created, bound)
        print(f"{pods:>6} {namespaces:>4} {images:>6} {created:>10} {passes:>4} in "
              f"{start_s * 1000:>7.0f}ms "
              f"{decide_s * 1000:>10.0f}ms {ungated:>8} {peak:>9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
