"""``python -m devcluster up|down|status|model``: the local control plane with epguard in
it, and the model image its registry serves."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from devcluster import stack


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devcluster",
        description="A local etcd + kube-apiserver (envtest-style) with epguard installed.",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=stack.DEFAULT_RUN_DIR,
        help="state, certificates, kubeconfig and logs (default: .run/ at the repo root)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start everything; the last line is `export KUBECONFIG=...`")
    p_up.add_argument(
        "--helm-arg",
        action="append",
        default=[],
        help="extra argument for `helm upgrade --install` (repeatable), e.g. --helm-arg=--set=x=y",
    )
    p_up.add_argument(
        "--chart",
        type=Path,
        default=stack.CHART_DIR,
        help="the chart to install (default: charts/epguard)",
    )
    sub.add_parser("down", help="stop everything `up` started and remove the run directory")
    sub.add_parser("status", help="what runs; exit 1 unless everything is alive")
    p_model = sub.add_parser(
        "model",
        help="the node registry's model image: MODEL_REF=... and MODEL_SERVED=<bytes served>",
    )
    p_model.add_argument(
        "--forget", action="store_true", help="remove it from containerd first (next use pulls)"
    )
    args = parser.parse_args(argv)
    run_dir: Path = args.run_dir.resolve()
    if args.command == "up":
        return stack.up(run_dir, args.helm_arg, args.chart.resolve())
    if args.command == "down":
        return stack.down(run_dir)
    if args.command == "model":
        return stack.model(run_dir, forget=args.forget)
    return stack.status(run_dir)


if __name__ == "__main__":
    raise SystemExit(main())
