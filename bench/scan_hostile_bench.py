"""``epguard scan`` on the hostile archives of issue 21 (points 7, 8, 9, 11), at the
audit's sizes: exit, seconds and peak RSS, before and after.

    .venv/bin/python bench/scan_hostile_bench.py [--before DIR] [--seconds S] [--only NAME]

Builds each archive from crafted bytes (tests/scan/hostile.py) in a temporary
directory, then runs the scan of this tree ("after") and, with ``--before DIR`` (a
checkout of another commit, e.g. ``git worktree add /tmp/d5scan d5affd9``), the scan
of that tree ("before"), each as
``timeout S prlimit --as=4G python -m epguard.webhook.command scan`` with PYTHONPATH
pointing at its tree. A run that hits the wall-clock limit prints
``timeout``; one killed by the address-space limit shows its exit and memory. Peak
RSS is the process tree's (RUSAGE_CHILDREN). Prints one line per case.

Targets (after): every case ends with its exit (2 for what cannot be judged; 0/1 for
an image judged), never a traceback, in well under --seconds, under 300 MiB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.scan import hostile  # noqa: E402

GiB = 1 << 30
NO_REQUEST = ["--argv", "python3", "-c", "pass"]
AS_LIMIT = 4 * GiB

_PEAK = (
    "import resource, subprocess, sys\n"
    "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "err = (p.stderr.strip().splitlines() or [''])[-1][:400]\n"
    "tb = 'Traceback' in p.stderr\n"
    "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, int(tb),"
    " len(p.stdout))\n"
    "print(err)"
)


def _case(make: Callable[[Path], Path], *args: str) -> Callable[[Path], tuple[Path, list[str]]]:
    return lambda d: (make(d), list(args))


def _site_tar() -> bytes:
    site = "usr/local/lib/python3.11/dist-packages"
    return hostile.tar_of([(f"{site}/torch/__init__.py", b""), ("opt/d5/x", b"")])


CASES: dict[str, Callable[[Path], tuple[Path, list[str]]]] = {
    "7 PAX size=-1536 in a layer": _case(
        lambda d: hostile.one_layer(d, hostile.pax_negative_size_tar())),
    "7 base-256 size -512 in a layer": _case(
        lambda d: hostile.one_layer(d, hostile.base256_negative_size_tar())),
    "7 PAX size=-1536 in the outer archive": _case(
        lambda d: hostile.outer_archive_with(d, hostile.pax_negative_size_tar())),
    "7 base-256 size -512 in the outer archive": _case(
        lambda d: hostile.outer_archive_with(d, hostile.base256_negative_size_tar())),
    "8 200k entries, 4000-byte names": _case(
        lambda d: hostile.one_layer(d, hostile.many_long_names_layer(200_000, 4000), "gzip"),
        *NO_REQUEST),
    "8 512 MiB PAX header": _case(
        lambda d: hostile.one_layer(d, hostile.huge_pax_header_layer(512 << 20), "gzip")),
    "8 256 MiB GNU long name": _case(
        lambda d: hostile.one_layer(d, hostile.huge_long_name_layer(256 << 20), "gzip")),
    "8 200k notes (sparse loaders, 1,000-byte names), JSON": _case(
        lambda d: hostile.one_layer(d, hostile.sparse_members_layer(
            200_000, 2 << 20,
            b"usr/lib/python3/dist-packages/mooncake/" + b"m" * 950 + b"%d.py"), "gzip"),
        "--json", *NO_REQUEST),
    "9 512 KiB PAX header that makes tarfile's regex backtrack": _case(
        lambda d: hostile.one_layer(d, hostile.backtracking_pax_tar(512 << 10))),
    "8 3,000 PAX headers of 100 KB in a row": _case(
        lambda d: hostile.one_layer(d, hostile.pax_run_layer(3000, 100_000), "gzip"),
        *NO_REQUEST),
    "9 1,000 sparse libraries claiming 1 TiB": _case(
        lambda d: hostile.one_layer(d, hostile.sparse_members_layer(1000, 1 << 40), "gzip"),
        *NO_REQUEST),
    "9 100k-byte symlink target": _case(
        lambda d: hostile.one_layer(d, hostile.long_symlink_tar(100_000))),
    "9 100k-entry PATH/LD_LIBRARY_PATH/PYTHONPATH": _case(
        lambda d: hostile.one_layer(d, _site_tar(), config=hostile.long_path_config(100_000))),
    "9 zstd frame (16 GiB) listed 20x, default budget": _case(
        lambda d: hostile.zstd_bomb_layout(d, 16 * GiB, 20)),
    "11 deep directories + opaque whiteout": _case(
        lambda d: hostile.deep_whiteout_layers(d, 2000), *NO_REQUEST),
    "11 non-UTF-8 names": _case(
        lambda d: hostile.one_layer(d, hostile.non_utf8_names_tar()), *NO_REQUEST),
    "11 DT_STRSZ 2^64-1": _case(
        lambda d: hostile.one_layer(d, hostile.tar_of(
            [("usr/lib/libbad.so", hostile.elf_with_strsz(2**64 - 1))])), *NO_REQUEST),
    "11 docker archive, forged config name": _case(
        lambda d: hostile.docker_archive(d, forge_name="ab" * 32), *NO_REQUEST),
    "11 docker archive --record": _case(
        lambda d: hostile.docker_archive(d), "--record", "--image", "registry.example/x:1",
        "--kubeconfig", "/nonexistent"),
}


def run(tree: Path, image: Path, args: list[str], seconds: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = ["timeout", str(seconds), "prlimit", f"--as={AS_LIMIT}", sys.executable, "-c",
           "import sys; from epguard.webhook.command import main; sys.exit(main())", "scan",
           str(image), *args]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True,
                         env=env, cwd=tree)
    wall = time.perf_counter() - start
    first, _, said = out.stdout.partition("\n")
    rc, kib, tb, out = (int(x) for x in first.split())
    if rc == 124:
        return f"timeout at {wall:6.1f} s, {kib / 1024:7.1f} MiB"
    shown = "traceback: " if tb else ""
    said = said.strip().removeprefix("epguard: cannot scan: ")
    said = said if len(said) <= 90 else "…" + said[-89:]
    return (f"exit {rc}, {wall:6.1f} s, {kib / 1024:7.1f} MiB, {out / 1024:8.1f} KiB out "
            f"({shown}{said!r})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="a checkout of the commit to compare with")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--only", help="cases whose name contains this")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="scan-hostile-"))
    try:
        for name, make in CASES.items():
            if args.only and args.only not in name:
                continue
            d = work / str(abs(hash(name)))
            d.mkdir()
            t = time.perf_counter()
            image, extra = make(d)
            built = time.perf_counter() - t
            print(f"{name} (built in {built:.1f} s)", flush=True)
            if args.before:
                print(f"  before: {run(args.before, image, extra, args.seconds)}", flush=True)
            print(f"  after:  {run(REPO, image, extra, args.seconds)}", flush=True)
            shutil.rmtree(d)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
