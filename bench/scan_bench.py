"""``epguard scan`` on the real worker image archives, against ``tar -xf`` as the floor.

    .venv/bin/python bench/scan_bench.py [--runs N] [ARCHIVE ...]

For each archive (default: the worker images `make tools` builds, 5.4 GB OCI
archives each: Debian python3, torch 2.13.0 with its CUDA 13 libraries, SGLang and
mooncake), it times N runs of the scan (every layer's digest verified, every
entry merged) and of ``tar -xf`` of the same archive into a temporary directory (what
any tool that unpacks the image pays, before it has read one file), and prints the
medians and the scan's peak RSS. Targets: scan <= 60 s and <= 200 MB.
Both sides run warm: one untimed run first, so the archive is in the page cache for
both (the machine has the memory for it); a cold run would add the disk's read time
to both sides alike.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster import images  # noqa: E402

_PEAK = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode\n"
    "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def run(cmd: list[str]) -> tuple[float, int, float]:
    """Wall seconds, exit status, peak RSS (MiB) of the command's process tree."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - start
    rc, kib = (int(x) for x in out.stdout.split())
    return wall, rc, kib / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("archives", nargs="*", type=Path)
    args = ap.parse_args()
    archives = args.archives or images.built_workers()
    if not archives:
        print("no worker image archives: run `make tools` first", file=sys.stderr)
        return 2
    epguard = str(REPO / ".venv" / "bin" / "epguard")
    worst_t = worst_m = 0.0
    for archive in archives:
        size = archive.stat().st_size / 2**30
        scan = [epguard, "scan", str(archive)]
        run(scan)
        scans, tars = [], []
        for _ in range(args.runs):
            scans.append(run(scan))
            with tempfile.TemporaryDirectory(dir=archive.parent, prefix="tar-floor-") as d:
                tars.append(run(["tar", "-xf", str(archive), "-C", d]))
                shutil.rmtree(d, ignore_errors=True)
        t = statistics.median(s[0] for s in scans)
        m = max(s[2] for s in scans)
        floor = statistics.median(s[0] for s in tars)
        worst_t, worst_m = max(worst_t, t), max(worst_m, m)
        print(f"{archive.name} ({size:.1f} GiB), median of {args.runs}, exit {scans[-1][1]}")
        print(f"  scan      {t:6.2f} s   peak RSS {m:6.1f} MiB")
        print(f"  tar -xf   {floor:6.2f} s   ratio scan/tar {t / floor:5.2f}")
    print(f"worst scan {worst_t:.2f} s (target <= 60), peak {worst_m:.1f} MiB (target <= 200)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
