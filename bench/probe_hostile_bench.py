"""The probe on hostile image roots: exit status, seconds and peak memory of each.

    .venv/bin/python bench/probe_hostile_bench.py [--probe DIR] [--timeout S] [--as-mib N]

Builds each root of tests/probe/hostile_roots.py (a fake torch 2.13.0+cu130, a mooncake
0.3.13-shaped package whose pg_2_13_0 extension needs libcudart.so.12, SGLang 0.5.18's
import; the files prove it unusable) with one hostile file, and runs

    timeout S prlimit --as=N python3 PROBE --timeout 10 -- python3 -m sglang.launch_server ...

Prints, per root: the exit status (124 = killed by ``timeout``), the seconds, the peak
RSS of the largest process (the probe or its child), the verdict's classification and
whether the files decided it. To measure the code as it was, point ``--probe`` at a
checkout of it (``git worktree add /tmp/d5probe d5affd9``; ``--probe /tmp/d5probe/probe``).

Target: every root ends (no 124), within the probe's own --timeout budget, never with
"probe internal error", under 100 MiB peak; exit 1 where the healthy-looking root
exits 1 (the hostile file must not turn a proven cause into exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.probe import hostile_roots  # noqa: E402

_MEASURE = (
    "import resource, subprocess, sys, time\n"
    "t = time.monotonic()\n"
    "rc = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE).returncode\n"
    "print(rc, time.monotonic() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def run(probe: Path, variant: str | None, timeout: float, as_mib: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="epguard-hostile-") as tmp:
        root = Path(tmp) / "root"
        extra = hostile_roots.make(root, variant)
        log = Path(tmp) / "termination-log"
        out = Path(tmp) / "report.json"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update({"PYTHONPATH": str(root), "PYTHONNOUSERSITE": "1"}, **extra)
        cmd = [
            "timeout", "-s", "KILL", str(timeout), "prlimit", f"--as={as_mib << 20}",
            "sh", "-c", 'exec "$@" > "$0"', str(out),
            sys.executable, str(probe), "--json", "--termination-log", str(log),
            "--timeout", "10", "--", *hostile_roots.WORKER,
        ]
        measured = subprocess.run(
            [sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, env=env,
            cwd=tmp,
        ).stdout.split()
        rc, seconds, peak_kib = int(measured[0]), float(measured[1]), int(measured[2])
        try:
            report = json.loads(out.read_text())
        except (OSError, ValueError):
            report = {}
        message = log.read_text() if log.exists() else ""
        return {
            "root": variant or "(healthy-looking: files prove cuda-mismatch)",
            "exit": 124 if rc in (124, 137, -9) else rc,
            "seconds": seconds,
            "peak_mib": peak_kib / 1024,
            "classification": report.get("classification")
            or ("internal error" if "internal error" in message else "-"),
            "from": report.get("decided_from") or "-",
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", type=Path, default=REPO / "probe")
    ap.add_argument("--timeout", type=float, default=60.0, help="wall-clock kill (s)")
    ap.add_argument("--as-mib", type=int, default=2048, help="address-space limit (MiB)")
    ap.add_argument("--only", default=None, help="run only roots whose name contains this")
    args = ap.parse_args()
    args.probe = args.probe.resolve()
    print(f"probe: {args.probe}  (timeout {args.timeout:g} s, --as {args.as_mib} MiB, "
          f"python {sys.version.split()[0]})")
    print(f"{'root':42} {'exit':>4} {'seconds':>8} {'peak MiB':>9}  classification / from")
    worst = 0
    for variant in [None, *hostile_roots.VARIANTS]:
        if args.only and (variant is None or args.only not in variant):
            continue
        r = run(args.probe, variant, args.timeout, args.as_mib)
        print(f"{r['root']:42.42} {r['exit']:>4} {r['seconds']:>8.2f} {r['peak_mib']:>9.1f}  "
              f"{r['classification']} / {r['from']}", flush=True)
        if r["exit"] not in (1,) or r["classification"] == "internal error":
            worst = 1
    _ = resource  # the children's peak comes from the measuring process
    return worst


if __name__ == "__main__":
    sys.exit(main())
