"""``epguard``: the webhook's engine, offline, for CI pipelines.

``epguard check FILE|- ...`` judges manifests (multi-document YAML, ``List``
objects, ``helm template`` output on stdin) exactly as the webhook would judge a
CREATE of each object, prints the findings in the same words, and exits 1 when
anything would be denied. ``epguard rules FILE`` validates a rules file.
``epguard scan IMAGE`` judges an image archive from its files (webhook/scan/).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

import yaml

from epguard.webhook.engine.namespaces import MODES, Mode, NamespaceIndex
from epguard.webhook.engine.policy import Decision, PolicyConfig, PolicyState, decide
from epguard.webhook.engine.review import AdmissionRequest, GroupVersionKind
from epguard.webhook.engine.rules import (
    RulesError,
    RulesHolder,
    default_rules_path,
    load_rules_file,
)
from epguard.webhook.engine.workloads import (
    KindError,
    KindRegistry,
    as_map,
    describe_object,
    group_of,
    parse_kinds,
)

if TYPE_CHECKING:  # imported where used: only `epguard scan` needs them
    from epguard.webhook.scan.record import Target
    from epguard.webhook.scan.scanner import Result

EXIT_OK, EXIT_DENIED, EXIT_ERROR = 0, 1, 2
# `epguard scan --record` only: the scan ran (its report is printed) but the API server
# did not take the record. Not 1 or 2, so a pipeline can tell "bad image" and "bad input"
# from "the cluster was not told".
EXIT_NOT_RECORDED = 3


@dataclass(frozen=True)
class Checked:
    source: str
    label: str
    decision: Decision


def _documents(source: str, stream: TextIO) -> Iterator[Any]:
    for doc in yaml.safe_load_all(stream):
        yield from _flatten(doc)


def _flatten(doc: Any) -> Iterator[Any]:
    d = as_map(doc)
    kind = d.get("kind")
    if isinstance(kind, str) and kind.endswith("List") and isinstance(d.get("items"), list):
        for item in d["items"]:
            yield from _flatten(item)
    elif d:
        yield d


def check_object(obj: Any, state: PolicyState, namespace: str | None) -> Decision | None:
    o = as_map(obj)
    kind = o.get("kind")
    if not isinstance(kind, str):
        return None
    group = group_of(o.get("apiVersion"))
    if not state.config.kinds.knows(group, kind):
        return None
    api_version = o.get("apiVersion")
    version = api_version.rsplit("/", 1)[-1] if isinstance(api_version, str) else ""
    meta = as_map(o.get("metadata"))
    ns = meta.get("namespace") if isinstance(meta.get("namespace"), str) else namespace
    request = AdmissionRequest(
        uid="epguard-check",
        kind=GroupVersionKind(group=group, version=version, kind=kind),
        operation="CREATE",
        namespace=ns,
        object=o,
    )
    return decide(request, state)


def _print_human(results: list[Checked], out: TextIO) -> None:
    for r in results:
        d = r.decision
        head = f"{r.source}: {r.label}"
        if not d.allowed:
            for f in d.denials:
                print(f"{head}: DENY: {f.message}", file=out)
        elif d.result in ("warned", "audited"):
            for f in d.denials:
                print(f"{head}: WOULD DENY ({d.mode} mode): {f.message}", file=out)
        for w in d.warnings:
            if d.result == "warned" and w.startswith("epguard (warn mode) would deny: "):
                continue
            print(f"{head}: WARN: {w}", file=out)


def _print_json(results: list[Checked], out: TextIO) -> None:
    payload = [
        {
            "source": r.source,
            "object": r.label,
            "allowed": r.decision.allowed,
            "result": r.decision.result,
            "message": r.decision.message,
            "warnings": list(r.decision.warnings),
        }
        for r in results
    ]
    json.dump(payload, out, indent=2)
    out.write("\n")


def cmd_check(args: argparse.Namespace) -> int:
    try:
        rules = load_rules_file(args.rules or default_rules_path())
    except RulesError as exc:
        print(f"epguard: {exc}", file=sys.stderr)
        return EXIT_ERROR
    kinds = KindRegistry()
    if args.kinds:
        try:
            with open(args.kinds, encoding="utf-8") as fh:
                kinds = KindRegistry(parse_kinds(fh.read(), args.kinds))
        except (OSError, UnicodeDecodeError, KindError) as exc:
            print(f"epguard: {exc}", file=sys.stderr)
            return EXIT_ERROR
    mode: Mode = args.mode
    namespaces = NamespaceIndex()
    state = PolicyState(
        rules=RulesHolder(rules),
        namespaces=namespaces,
        config=PolicyConfig(default_mode=mode, allow_skip=not args.no_skip, kinds=kinds),
    )
    results: list[Checked] = []
    checked = skipped = 0
    for path in args.files:
        try:
            if path == "-":
                docs = list(_documents("<stdin>", sys.stdin))
            else:
                with open(path, encoding="utf-8") as fh:
                    docs = list(_documents(path, fh))
        except (OSError, UnicodeDecodeError) as exc:
            print(f"epguard: cannot read {path}: {exc}", file=sys.stderr)
            return EXIT_ERROR
        except yaml.YAMLError as exc:
            print(f"epguard: {path}: not valid YAML: {exc}", file=sys.stderr)
            return EXIT_ERROR
        for doc in docs:
            decision = check_object(doc, state, args.namespace)
            if decision is None:
                skipped += 1
                continue
            checked += 1
            source = "<stdin>" if path == "-" else path
            results.append(Checked(source, describe_object(doc), decision))
    if args.output == "json":
        _print_json(results, sys.stdout)
    else:
        _print_human(results, sys.stdout)
    denied = sum(1 for r in results if not r.decision.allowed)
    warned = sum(len(r.decision.warnings) for r in results)
    print(
        f"epguard: {checked} object(s) checked ({skipped} of other kinds skipped), "
        f"{denied} denied, {warned} warning(s); {len(rules)} rule(s) from {rules.source}",
        file=sys.stderr,
    )
    return EXIT_DENIED if denied else EXIT_OK


def cmd_rules(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            rules = load_rules_file(path)
        except RulesError as exc:
            print(f"epguard: {exc}", file=sys.stderr)
            status = EXIT_ERROR
            continue
        print(f"{path}: {len(rules)} rule(s) OK")
        for r in rules.rules:
            target = r.image or ""
            if r.digest:
                target += f"@{r.digest}"
            print(f"  {r.id}: {r.action} {target}")
    return status


def cmd_scan(args: argparse.Namespace) -> int:
    """`epguard scan`: exit 0/1 is the image's verdict; anything that stops the scan
    (bad input, a spent budget, a failure of epguard itself) is exit 2 with one line,
    never a traceback and never 1 ("an image cause")."""
    # Imported here: zstandard and the probe's modules are only the scan's business.
    from epguard.webhook.scan import report

    # A name or config string that is not valid UTF-8 is printed escaped, not raised.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")

    def bad_input(error: str) -> int:
        out = report.bad_input(error, args.format)
        (sys.stdout if args.format != "text" else sys.stderr).write(out)
        return EXIT_ERROR

    try:
        return _scan(args, bad_input)
    except RecursionError:
        return bad_input("internal error: RecursionError (an input nested too deep for "
                         "epguard; this is a bug in epguard, not a cause in the image)")
    except MemoryError:
        return bad_input("out of memory (an input over epguard's limits, or a machine with "
                         "too little memory; not a cause in the image)")
    except Exception as exc:  # the last line of defence: one line and exit 2
        said = " ".join(str(exc).split())[:300]
        return bad_input(f"internal error: {type(exc).__name__}: {said} (a bug in epguard, "
                         "not a cause in the image)")


def _deadline(seconds: float) -> Callable[[], None]:
    """A hard stop behind the scan's own deadline checks: SIGALRM at ``seconds`` + 5
    raises BudgetError wherever the scan is; 10 s later, if that was swallowed, the
    process says so and exits 2. Returns the function that disarms it."""
    import os
    import signal

    from epguard.webhook.scan.tarstream import BudgetError

    if not hasattr(signal, "setitimer"):
        return lambda: None
    state = {"fired": False}

    def fire(signum: int, frame: object) -> None:
        if state["fired"]:
            sys.stderr.write(f"epguard: cannot scan: the scan took more than {seconds:g} s: "
                             "over the --timeout budget\n")
            sys.stderr.flush()
            os._exit(EXIT_ERROR)
        state["fired"] = True
        signal.setitimer(signal.ITIMER_REAL, 10)
        raise BudgetError(f"the scan took more than {seconds:g} s: over the --timeout budget")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds + 5)

    def disarm() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    return disarm


def _scan(args: argparse.Namespace, bad_input: Callable[[str], int]) -> int:
    from epguard.webhook.scan import report, scanner
    from epguard.webhook.scan.tarstream import Budget, BudgetError

    argv = list(args.argv or [])
    if argv and argv[0] == "--":
        argv = argv[1:]
    if args.record and not args.record_image:
        return bad_input("--record needs --image REF: the reference pods use for this image")
    if args.timeout <= 0 or args.max_bytes <= 0:
        return bad_input("--timeout and --max-bytes must be positive")
    disarm = _deadline(args.timeout)
    try:
        result = scanner.scan(args.image, argv=argv or None, ref=args.ref,
                              platform=args.platform,
                              budget=Budget(args.max_bytes, args.timeout))
    except (scanner.ScanError, BudgetError) as exc:
        return bad_input(str(exc))
    finally:
        disarm()
    subject = None
    if args.record:
        from epguard.webhook.scan import record

        try:
            subject = record.target(result, args.record_image)
        except record.TargetError as exc:
            return bad_input(str(exc))
    if args.format == "json":
        sys.stdout.write(report.as_json(result))
    elif args.format == "github":
        sys.stdout.write(report.github(result))
    else:
        sys.stdout.write(report.text(result) + "\n")
    if subject is None:
        return result.exit_code
    return _record_scan(result, subject, args.kubeconfig) or result.exit_code


def _size(value: str) -> int:
    """``64G``, ``512M``, ``1T`` or a plain number of bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    v = value.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if v and v[-1] in units:
            return int(float(v[:-1]) * units[v[-1]])
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {value!r} (e.g. 64G)") from None


def _record_scan(result: Result, subject: Target, kubeconfig: str | None) -> int:
    """Write the scan's verdict; EXIT_NOT_RECORDED (and why, on stderr) if not written."""
    import datetime as dt

    from kubernetes.config.config_exception import ConfigException

    from epguard.webhook.cluster.kube import NoCredentials, api_client
    from epguard.webhook.scan import record

    try:
        api = api_client(kubeconfig, home_kubeconfig=True)
    except (NoCredentials, ConfigException, OSError) as exc:
        print(f"epguard scan --record: no cluster credentials: {exc}", file=sys.stderr)
        return EXIT_NOT_RECORDED
    try:
        done = record.record(api, result, subject, dt.datetime.now(dt.UTC))
    except record.RecordError as exc:
        print(f"epguard scan --record: not recorded: {exc}", file=sys.stderr)
        return EXIT_NOT_RECORDED
    finally:
        api.close()  # type: ignore[no-untyped-call]  # the client is untyped
    print(done.line(), file=sys.stderr)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epguard", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "check",
        help="judge manifests offline; exit 1 if any would be denied",
        description="Judge Kubernetes manifests with the webhook's engine. Exit 0: nothing "
        "denied; 1: something would be denied; 2: bad input or rules.",
    )
    c.add_argument("files", nargs="+", metavar="FILE|-", help="YAML manifests, '-' for stdin")
    c.add_argument("--rules", help="rules file (default: the built-in rules)")
    c.add_argument("--mode", choices=MODES, default="enforce", help="default enforce")
    c.add_argument("--namespace", help="namespace for objects that name none")
    c.add_argument("--no-skip", action="store_true", help="ignore the epguard.io/skip annotation")
    c.add_argument(
        "--kinds",
        metavar="FILE",
        help="YAML list of extra workload kinds (the chart value webhook.extraKinds)",
    )
    c.add_argument("-o", "--output", choices=("text", "json"), default="text")
    c.set_defaults(func=cmd_check)
    r = sub.add_parser("rules", help="validate rules files")
    r.add_argument("files", nargs="+", metavar="FILE")
    r.set_defaults(func=cmd_rules)
    s = sub.add_parser(
        "scan",
        help="judge an image archive from its files; exit 1 on an image cause",
        description="Read an OCI image layout directory, an OCI or docker archive, or an "
        "unpacked root filesystem, and report every cause in the image's files that stops "
        "mooncake elastic EP. Nothing is executed, unpacked or written. Exit 0: no image "
        "cause (a GPU node still checks the driver, the GPU and the smoke test); 1: an "
        "image cause; 2: bad input; 3 (--record): the API server did not take the record.",
    )
    s.add_argument("image", metavar="IMAGE", help="layout directory, archive or rootfs")
    s.add_argument("--ref", help="which image, when the archive holds several (name or tag)")
    s.add_argument("--platform", default="linux/amd64", help="for multi-platform indexes")
    s.add_argument("--format", choices=("text", "json", "github"), default="text")
    s.add_argument("--json", dest="format", action="store_const", const="json",
                   help="same as --format json")
    s.add_argument("--record", action="store_true",
                   help="write an image cause as an ImageVerdict (source scan) for the "
                   "manifest digest, so the webhook refuses the image; a passing scan deletes "
                   "an earlier scan verdict of the same bytes. Exit 3: not recorded")
    s.add_argument("--image", dest="record_image", metavar="REF",
                   help="with --record: the reference pods use (registry/name:tag; a digest "
                   "in it must be the scanned manifest's)")
    s.add_argument("--kubeconfig", help="with --record (default: in-cluster, $KUBECONFIG, "
                   "~/.kube/config)")
    s.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="give up (exit 2) after this long (default 600)")
    s.add_argument("--max-bytes", type=_size, default=64 << 30, metavar="SIZE",
                   help="give up (exit 2) after reading this much decompressed tar from "
                   "the layers: a decompression bomb's budget (default 64G)")
    s.add_argument("--argv", nargs=argparse.REMAINDER,
                   help="the worker's command line (default: the image's Entrypoint/Cmd, "
                   "else any SGLang launch with --elastic-ep-backend mooncake); put last")
    s.set_defaults(func=cmd_scan)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
