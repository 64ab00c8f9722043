#!/usr/bin/env python3
"""The outage backstop's read and compile (webhook/controller/compiler.py ``EntryIndex`` and
``compile_params``, what the controller runs when the ImageVerdicts change) at 1,000,
10,000 and 100,000 Unusable verdicts, each its own image and digest: the index's time and
the memory it holds, the compile's wall time, the peak of Python allocations during the
compile with the index held (tracemalloc, a separate run: tracing slows the compile), the
shards and their sizes.
A benchmark prints figures; it asserts nothing.

    .venv/bin/python bench/backstop_compile.py [--counts 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import resource
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epguard.webhook.controller.compiler import SHARD_BYTES, EntryIndex, compile_params
from epguard.webhook.engine.text import stamp
from epguard.webhook.engine.verdicts import verdict_from_object

NOW = dt.datetime.now(dt.UTC)


def verdict(i: int) -> dict[str, Any]:
    d = "sha256:" + f"{i:016x}" * 4
    return {
        "metadata": {"name": d.replace(":", "-")},
        "spec": {
            "image": f"registry.example.com/team-{i % 100}/sglang:b{i}",
            "digest": d,
            "verdict": "Unusable",
            "reason": f"libcudart.so.12 is missing (build {i % 7})",
            "pod": "ml/sglang-0",
            "lastSeen": stamp(NOW),
        },
    }


def index(n: int) -> tuple[EntryIndex, float, int]:
    """The index the controller reads n verdicts into (one at a time, as from its pages),
    the time that took and the memory it holds."""
    tracemalloc.start()
    t0 = time.perf_counter()
    s = EntryIndex(dt.timedelta(hours=24), NOW)
    for i in range(n):
        v = verdict_from_object(verdict(i))
        if v is not None:
            s.add(v)
    took = time.perf_counter() - t0
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return s, took, held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1000,10000,100000")
    args = parser.parse_args()
    print(f"{'verdicts':>9}{'read s':>8}{'index MiB':>10}{'entries':>9}{'shards':>8}"
          f"{'largest KiB':>13}{'total KiB':>11}{'compile s':>11}{'peak MiB':>10}"
          f"{'dropped':>9}")  # fmt: skip
    for n in (int(c) for c in args.counts.split(",")):
        s, read_s, held = index(n)
        t0 = time.perf_counter()
        params = compile_params(s, NOW)
        took = time.perf_counter() - t0
        tracemalloc.start()
        compile_params(s, NOW)
        peak = tracemalloc.get_traced_memory()[1] + held
        tracemalloc.stop()
        sizes = [
            len(json.dumps(d, separators=(",", ":"), ensure_ascii=False).encode())
            for d in params.shards
        ]
        over = sum(1 for size in sizes if size > SHARD_BYTES)
        note = f"  ({over} shards over the cap!)" if over else ""
        print(f"{n:>9}{read_s:>8.1f}{held / 2**20:>10.0f}{params.kept:>9}{len(params.shards):>8}"
              f"{max(sizes) / 1024:>13.0f}"
              f"{sum(sizes) / 1024:>11.0f}{took:>11.2f}{peak / 2**20:>10.1f}"
              f"{params.dropped:>9}{note}")  # fmt: skip
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nprocess peak RSS {rss:.0f} MiB (the verdict objects and stores included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
