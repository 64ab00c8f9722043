"""The risky part of the probe, run in a child interpreter (``python -c <this file>``).

It imports torch, then the mooncake modules the engine needs, exactly as the worker
would, and reports each step as one JSON line on the file descriptor given as
argv[1]. The parent announces a step before it is taken, so when this process dies
of a signal or hangs, the parent knows which import did it. The plan (modules,
names, level) arrives on stdin after torch is imported: the parent works it out
from SGLang's sources while torch loads, which costs nothing on the critical path.

It is run with ``-c`` rather than as a file so that the probe's own directory is not
on sys.path while mooncake imports. Standard library only; Python 3.8 syntax.
"""

import contextlib
import faulthandler
import importlib
import json
import os
import sys
import traceback

_OUT = os.fdopen(int(sys.argv[1]), "w", buffering=1)


STEP = ["start"]  # the step in progress, for errors raised inside smoke()


def emit(**event):
    if event.get("event") == "step":
        STEP[0] = event["step"].replace("smoke ", "")
    _OUT.write(json.dumps(event, default=str) + "\n")
    _OUT.flush()


def describe(exc):
    """Type and message of an exception and of the ones it was raised from."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen and len(chain) < 4:
        seen.add(id(exc))
        chain.append({"type": type(exc).__name__, "message": str(exc)[:800]})
        exc = exc.__cause__ or exc.__context__
    return chain


def where(exc):
    frames = traceback.extract_tb(exc.__traceback__)
    return [f"{f.filename}:{f.lineno}" for f in frames[-3:]]


def mapped_libraries():
    """Shared objects mapped into this process: they satisfy later DT_NEEDED lookups."""
    out = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and ".so" in parts[5]:
                    out.add(parts[5].strip())
    except OSError:
        pass
    return sorted(out)


def backends():
    try:
        from torch.distributed import Backend
    except BaseException as exc:  # noqa: BLE001 - any failure is evidence
        return {"readable": False, "error": describe(exc)}
    caps = getattr(Backend, "backend_capability", None)
    if not isinstance(caps, dict):
        return {"readable": False, "error": [{"type": "AttributeError",
                                              "message": "Backend.backend_capability"}]}
    return {"readable": True,
            "capability": {str(k): [str(d) for d in v] for k, v in caps.items()}}


def smoke(module, want_cuda, timeout):
    """One-rank groups the way SGLang builds them: all-reduce and barrier on each.

    SGLang makes WORLD on "mooncake" (cuda) with MooncakeBackendOptions(active
    ranks), then per group a "mooncake" device group and a "mooncake-cpu" CPU group.
    Without a GPU only the CPU backend can be exercised.
    """
    import datetime
    import tempfile

    import torch
    import torch.distributed as dist

    options = getattr(module, "MooncakeBackendOptions", None)
    td = datetime.timedelta(seconds=timeout)

    def opts(device):
        if options is None:
            return None
        return options(torch.ones(1, dtype=torch.int32, device=device))

    fd, store_file = tempfile.mkstemp(prefix="epguard-smoke-")
    os.close(fd)
    store = dist.FileStore(store_file, 1)
    try:
        if want_cuda:
            torch.cuda.set_device(0)
            emit(event="step", step="smoke mooncake cuda:0")
            dist.init_process_group(backend="mooncake", store=store, rank=0, world_size=1,
                                    timeout=td, pg_options=opts("cuda:0"))
            t = torch.ones(4, device="cuda:0")
            dist.all_reduce(t)
            dist.barrier()
            torch.cuda.synchronize()
            emit(event="smoke", backend="mooncake", ok=bool(t.sum().item() == 4.0))
            emit(event="step", step="smoke mooncake-cpu")
            group = dist.new_group([0], backend="mooncake-cpu", pg_options=opts("cpu"),
                                   timeout=td)
        else:
            emit(event="step", step="smoke mooncake-cpu")
            dist.init_process_group(backend="mooncake-cpu", store=store, rank=0,
                                    world_size=1, timeout=td, pg_options=opts("cpu"))
            group = None
        t = torch.ones(4)
        dist.all_reduce(t, group=group)
        dist.barrier(group=group)
        emit(event="smoke", backend="mooncake-cpu", ok=bool(t.sum().item() == 4.0))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        with contextlib.suppress(OSError):
            os.unlink(store_file)


def main():
    faulthandler.enable()
    emit(event="start", python=sys.version.split()[0], pid=os.getpid())
    emit(event="step", step="import torch")
    try:
        import torch
    except BaseException as exc:  # noqa: BLE001
        emit(event="torch", ok=False, error=describe(exc), where=where(exc))
        torch = None
    else:
        emit(event="torch", ok=True, version=str(torch.__version__),
             cuda=getattr(torch.version, "cuda", None))

    plan = json.loads(sys.stdin.readline() or "{}")
    if torch is None:
        emit(event="done")
        return

    passed = None  # the first module that imports with every name
    for mod in plan.get("modules", []):
        if passed is not None and plan.get("first_success_only"):
            break
        emit(event="step", step="import " + mod)
        try:
            module = importlib.import_module(mod)
        except BaseException as exc:  # noqa: BLE001
            emit(event="import", module=mod, ok=False, error=describe(exc),
                 where=where(exc), mapped=mapped_libraries())
            continue
        names = plan.get("names", {}).get(mod, [])
        missing = [n for n in names if not hasattr(module, n)]
        emit(event="import", module=mod, ok=True, file=getattr(module, "__file__", None),
             missing_names=missing)
        if passed is None and not missing:
            passed = module

    for mod in plan.get("alternates", []) if passed is None else []:
        emit(event="step", step="import " + mod)
        try:
            module = importlib.import_module(mod)
            ok = True
        except BaseException:  # noqa: BLE001
            ok = False
        emit(event="alternate", module=mod, ok=ok)

    registered = backends()
    emit(event="backends", **registered)

    emit(event="step", step="cuda")
    try:
        available = bool(torch.cuda.is_available())
        count = int(torch.cuda.device_count()) if available else 0
        emit(event="cuda", available=available, devices=count)
    except BaseException as exc:  # noqa: BLE001
        available = False
        emit(event="cuda", available=False, devices=0, error=describe(exc))

    caps = registered.get("capability") or {}
    if plan.get("level") == "smoke" and passed is not None and "mooncake-cpu" in caps:
        try:
            smoke(passed, available, plan.get("timeout", 60))
        except BaseException as exc:  # noqa: BLE001
            emit(event="smoke", backend=STEP[0], ok=False, error=describe(exc))
    emit(event="done")


main()
