"""Probe time-to-verdict vs the bare import the worker does, in the same environment.

    .venv/bin/python bench/probe_bench.py [--runs N]

For each environment it times, interleaved, N runs of

    probe:  python probe --termination-log <tmp> -- python3 -m sglang.launch_server ...
    bare:   python -c "import torch, mooncake.pg"

and prints the medians and their ratio (target: ratio <= 1.15), and the peak memory of
each process tree. Where the image's files prove the cause (probe/static.py: no
pg_<torch>, a CUDA 12 extension beside CUDA 13 torch, the -non-cuda wheel), the probe
stops before ``import torch``: targets there are time <= 0.2x and peak memory <= 0.3x
the bare import (and the same case with --no-static shows the import path). On a machine
without a GPU every real mooncake wheel fails to import, so the real environments
measure a failing import on both sides; the "usable" environment is the test
double from tests/probe (real torch, fake mooncake that registers both backends).
Needs the real-package envs of scripts/tools.d/30-realpkgs.sh.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.probe.probe_harness import (  # noqa: E402
    MTE_CUDA12,
    MTE_CUDA13,
    MTE_CUDA13_OLD,
    MTE_NON_CUDA,
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


# Runs a command and prints the largest RSS among it and every descendant it reaped
# (getrusage(RUSAGE_CHILDREN) in a fresh process: one command's tree, nothing else).
_PEAK = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
    "stderr=subprocess.DEVNULL).returncode\n"
    "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def timed(cmd: list[str], env: dict[str, str], cwd: str) -> tuple[float, float, int, float]:
    """Wall seconds, CPU seconds (user + sys of the process tree), exit status, peak MiB."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, *cmd], env=env, cwd=cwd, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rc, peak_kib = (int(x) for x in proc.stdout.split())
    return wall, cpu, rc, peak_kib / 1024


def bench(
    name: str, pythonpath: list[Path], runs: int, tmp: str, opts: tuple[str, ...] = ()
) -> dict[str, float]:
    env = clean_env(pythonpath)
    log = os.path.join(tmp, "termination-log")
    probe = [str(TORCH_PY), str(REPO / "probe"), "--termination-log", log, *opts, "--", *WORKER]
    bare = [str(TORCH_PY), "-c", "import torch, mooncake.pg"]
    # The same import without interpreter teardown (torch's takes ~0.2 s): the moment
    # the worker itself would know. The probe kills its child once it has reported.
    quick = [
        str(TORCH_PY),
        "-c",
        "import os\ntry:\n import torch, mooncake.pg\n"
        "except BaseException:\n os._exit(1)\nos._exit(0)",
    ]
    # One untimed run each: page cache and .pyc files, as on a node that pulled the image.
    for cmd in (probe, bare, quick):
        timed(cmd, env, tmp)
    probe_runs, bare_runs, quick_runs = [], [], []
    for _ in range(runs):
        probe_runs.append(timed(probe, env, tmp))
        bare_runs.append(timed(bare, env, tmp))
        quick_runs.append(timed(quick, env, tmp))
    fig = {
        "quick_median": statistics.median(r[0] for r in quick_runs),
        "probe_median": statistics.median(r[0] for r in probe_runs),
        "bare_median": statistics.median(r[0] for r in bare_runs),
        "probe_min": min(r[0] for r in probe_runs),
        "bare_min": min(r[0] for r in bare_runs),
        "probe_cpu": statistics.median(r[1] for r in probe_runs),
        "bare_cpu": statistics.median(r[1] for r in bare_runs),
        "probe_peak": statistics.median(r[3] for r in probe_runs),
        "bare_peak": statistics.median(r[3] for r in bare_runs),
    }
    verdict = Path(log).read_text().splitlines()[0] if Path(log).exists() else "?"
    print(f"{name}  (probe exit {probe_runs[-1][2]}, bare exit {bare_runs[-1][2]})")
    for label, key in (("wall median", "median"), ("wall min", "min"), ("CPU median", "cpu")):
        p, b = fig["probe_" + key], fig["bare_" + key]
        print(f"  {label:<12} probe {p:6.3f} s   bare {b:6.3f} s   ratio {p / b:5.3f}")
    p, q = fig["probe_median"], fig["quick_median"]
    print(
        f"  {'no teardown':<12} probe {p:6.3f} s   bare {q:6.3f} s   ratio {p / q:5.3f}"
        "   (bare import ending in os._exit, wall median)"
    )
    pm, bm = fig["probe_peak"], fig["bare_peak"]
    print(f"  {'peak memory':<12} probe {pm:6.1f} MiB bare {bm:6.1f} MiB ratio {pm / bm:5.3f}")
    print(f"  verdict: {verdict[:120]}")
    fig["from_files"] = float("decided from the image's files" in Path(log).read_text()
                              if Path(log).exists() else False)
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    if not (TORCH_ENV / ".done").exists():
        print("real-package envs missing: run `make tools` first", file=sys.stderr)
        return 2
    overlays = CACHE / "overlays"
    print(
        f"probe time-to-verdict vs `python -c 'import torch, mooncake.pg'`, "
        f"median of {args.runs} interleaved runs, torch 2.13.0+cu130, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    figures = []
    with tempfile.TemporaryDirectory(prefix="epguard-bench-") as tmp:
        double = write_double(Path(tmp) / "double", pg=REGISTER_BOTH + PG_NAMES)
        cases = [
            ("usable (test double)", [double, overlays / SGLANG_PG[0]]),
            ("cuda13 0.3.13.post1 (fails: libs)", [overlays / MTE_CUDA13, overlays / SGLANG_PG[0]]),
        ]
        # Causes the files prove: decided before import torch.
        static_cases = [
            ("cuda12 0.3.13.post1 (cudart 12)", [overlays / MTE_CUDA12, overlays / SGLANG_PG[0]]),
            ("cuda13 0.3.10 (no pg_2_13_0)", [overlays / MTE_CUDA13_OLD, overlays / SGLANG_PG[0]]),
            ("non-cuda 0.3.13.post1", [overlays / MTE_NON_CUDA, overlays / SGLANG_PG[0]]),
        ]
        for name, paths in cases:
            figures.append(bench(name, paths, args.runs, tmp))
        fast = []
        for name, paths in static_cases:
            fast.append(bench(name, paths, args.runs, tmp))
            figures.append(bench(name + " --no-static", paths, args.runs, tmp, ("--no-static",)))
    for key in ("median", "min"):
        worst = max(f["probe_" + key] / f["bare_" + key] for f in figures)
        print(f"worst wall {key} ratio, imports {worst:.3f} (target <= 1.15)")
    worst = max(f["probe_median"] / f["quick_median"] for f in figures)
    print(f"worst ratio against the bare import without teardown {worst:.3f}")
    undecided = [f for f in fast if not f["from_files"]]
    print(f"decided from files: {len(fast) - len(undecided)} of {len(fast)} proven-cause images")
    worst_t = max(f["probe_median"] / f["bare_median"] for f in fast)
    worst_m = max(f["probe_peak"] / f["bare_peak"] for f in fast)
    print(f"worst from-files ratio: time {worst_t:.3f} (target <= 0.2), "
          f"peak memory {worst_m:.3f} (target <= 0.3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
