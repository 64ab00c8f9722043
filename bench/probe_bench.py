"""Probe time-to-verdict vs the bare import the worker does, in the same environment.

    .venv/bin/python bench/probe_bench.py [--runs N]

For each environment it times, interleaved, N runs of

    probe:  python probe --termination-log <tmp> -- python3 -m sglang.launch_server ...
    bare:   python -c "import torch, mooncake.pg"

and prints the medians and their ratio (target: ratio <= 1.15). On a machine
without a GPU every real mooncake wheel fails to import, so the real environments
measure a failing import on both sides; the "usable" environment is the test
double from tests/probe (real torch, fake mooncake that registers both backends).
Needs the real-package envs of scripts/tools.d/30-realpkgs.sh.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "probe"))

from probe_harness import (  # noqa: E402
    MTE_CUDA12,
    MTE_CUDA13,
    PG_NAMES,
    REGISTER_BOTH,
    SGLANG_PG,
    TORCH_ENV,
    TORCH_PY,
    WORKER,
    clean_env,
    write_double,
)

CACHE = TORCH_ENV.parent


def timed(cmd: list[str], env: dict[str, str], cwd: str) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    return time.perf_counter() - start, proc.returncode


def bench(name: str, pythonpath: list[Path], runs: int, tmp: str) -> tuple[float, float]:
    env = clean_env(pythonpath)
    log = os.path.join(tmp, "termination-log")
    probe = [str(TORCH_PY), str(REPO / "probe"), "--termination-log", log, "--", *WORKER]
    bare = [str(TORCH_PY), "-c", "import torch, mooncake.pg"]
    # One untimed run each: page cache and .pyc files, as on a node that pulled the image.
    timed(probe, env, tmp)
    timed(bare, env, tmp)
    p_times, b_times = [], []
    p_rc = b_rc = None
    for _ in range(runs):
        t, p_rc = timed(probe, env, tmp)
        p_times.append(t)
        t, b_rc = timed(bare, env, tmp)
        b_times.append(t)
    p, b = statistics.median(p_times), statistics.median(b_times)
    verdict = Path(log).read_text().splitlines()[0] if Path(log).exists() else "?"
    print(f"{name:<34} probe {p:6.3f} s (exit {p_rc})   bare import {b:6.3f} s (exit {b_rc})"
          f"   ratio {p / b:5.3f}")
    print(f"{'':<34} verdict: {verdict[:110]}")
    return p, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    if not (TORCH_ENV / ".done").exists():
        print("real-package envs missing: run `make tools` first", file=sys.stderr)
        return 2
    overlays = CACHE / "overlays"
    print(f"probe time-to-verdict vs `python -c 'import torch, mooncake.pg'`, "
          f"median of {args.runs} interleaved runs, torch 2.13.0+cu130, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    ratios = []
    with tempfile.TemporaryDirectory(prefix="epguard-bench-") as tmp:
        double = write_double(Path(tmp) / "double", pg=REGISTER_BOTH + PG_NAMES)
        cases = [
            ("usable (test double)", [double, overlays / SGLANG_PG[0]]),
            ("cuda13 0.3.13.post1 (fails: libs)", [overlays / MTE_CUDA13, overlays / SGLANG_PG[0]]),
            ("cuda12 0.3.13.post1 (fails: cudart)",
             [overlays / MTE_CUDA12, overlays / SGLANG_PG[0]]),
        ]
        for name, paths in cases:
            p, b = bench(name, paths, args.runs, tmp)
            ratios.append(p / b)
    print(f"worst ratio {max(ratios):.3f} (target <= 1.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
