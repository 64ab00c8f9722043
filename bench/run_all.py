"""Run every benchmark in turn and print their figures (``make bench``).

Each script is standalone and prints its own table; this only runs them with the
repository's interpreter so one command gives the figures the issues ask for:

* ``probe_bench.py``        probe time-to-verdict vs a bare ``import torch, mooncake.pg``
* ``webhook_bench.py``      /validate throughput and p50/p99 vs a bare FastAPI floor, RSS
* ``admission_latency.py``  pod-create latency: no policy vs ValidatingAdmissionPolicy vs epguard
* ``node_timings.py``       the real node: make up, apply -> termination message, memory, down
* ``argv_bench.py``         hostile command lines (nested scripts, doubling $(VAR)): time, memory
* ``hostile_bench.py``      the webhook process under issue 12's inputs: answer, stall, peak RSS
* ``scan_bench.py``         epguard scan of the real worker archives vs ``tar -xf``: time, RSS
* ``preflight_bench.py``    the preflight controller's passes: preflights per key, pass times
* ``preflight_node_bench.py`` the preflight gate's budgets on the real node: apply -> held or
  scheduled, model bytes the registry served, creates gated vs not, 200 pods at scale
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SCRIPTS = (
    "probe_bench.py",
    "webhook_bench.py",
    "admission_latency.py",
    "node_timings.py",
    "argv_bench.py",
    "hostile_bench.py",
    "scan_bench.py",
    "preflight_bench.py",
    "preflight_node_bench.py",
)


def main() -> int:
    failed = []
    for script in SCRIPTS:
        print(f"\n===== {script} =====", flush=True)
        rc = subprocess.call([sys.executable, str(BENCH / script)], cwd=BENCH.parent)
        if rc != 0:
            failed.append(f"{script} (exit {rc})")
    if failed:
        print("\nfailed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
