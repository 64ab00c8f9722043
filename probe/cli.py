"""Command line: ``python3 probe [options] -- WORKER_ARGV...``.

Exit status: 0 usable or nothing to check, 1 unusable, 2 usage error. A bug in
the probe must not block workers, so by default it is reported on stderr (and in
the termination message) and the probe exits 0; ``--on-internal-error=deny``
makes it exit 1 instead.
"""

import argparse
import importlib
import importlib.machinery
import json
import os
import shutil
import stat
import sys
import traceback

try:
    from . import cmdline, deadline, message, sandbox
except ImportError:  # run as `python3 probe`: the directory itself is on sys.path
    import cmdline
    import deadline
    import message
    import sandbox


def _sibling(name):
    # Imported after the child is started, so that their import overlaps torch's.
    if __package__:
        return importlib.import_module("." + name, __package__)
    return importlib.import_module(name)

DEFAULT_TERMINATION_LOG = "/dev/termination-log"
# SGLang's --config is a tenant's file: read only a regular file of reasonable size.
MAX_CONFIG_BYTES = 256 * 1024
MAX_TIMEOUT = 3600
# How deep the probe checks; the first is the default (the webhook's EPGUARD_PROBE_LEVEL
# and the chart's injection.probeLevel offer exactly these).
PROBE_LEVELS = ("import", "smoke")
# The evidence line of a verdict the image's files decided (with or without --files-only).
FROM_FILES = ("decided from the image's files, before import torch (the probe's --no-static "
              "imports anyway)")
# What only the probe on a GPU node can judge (static.GPU_ONLY, in short): the first line
# of a --files-only run whose files prove no cause. "{modules}" is what SGLang imports.
LEFT_FOR_GPU_NODE = (
    "the import of {modules} after torch",
    "the NVIDIA driver (libcuda.so.1)",
    "a visible GPU",
    "the registration of the mooncake and mooncake-cpu backends",
    "the one-rank smoke test",
)
# Causes the files show but do not prove, listed in a --files-only message.
MAX_UNCONFIRMED = 3


def read_config(path):
    """The text of a worker's ``--config`` file, or None if it cannot be read safely."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CONFIG_BYTES:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        return None
    return data.decode("utf-8", "replace")


def read_request(worker):
    """The one reader (cmdline.py), with the option table of the SGLang in this image."""
    version = _sibling("inventory").dist_version("sglang", live_image().path)
    # The worker's argv is read as its own shell would, with the worker's variables.
    return cmdline.read(worker, env=sandbox.worker_environment(), release=version or None,
                        read_config=read_config)


def _parser():
    p = argparse.ArgumentParser(
        prog="python3 probe",
        usage="python3 probe [options] -- WORKER_ARGV...",
        description="Check, inside the worker's image, that SGLang's elastic EP can load "
                    "mooncake's torch ProcessGroup. WORKER_ARGV is the worker container's "
                    "command and args, verbatim.",
        allow_abbrev=False,
    )
    p.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    p.add_argument("--termination-log", metavar="PATH", default=None,
                   help="where to write the termination message (default: "
                        f"{DEFAULT_TERMINATION_LOG} when "
                        "writable)")
    p.add_argument("--max-message-bytes", type=int, default=2048, metavar="N",
                   help="size limit of the termination message (default 2048; the kubelet "
                        "shares 12 KiB among a pod's containers)")
    p.add_argument("--level", choices=PROBE_LEVELS, default=PROBE_LEVELS[0],
                   help="smoke: also run a one-rank process group on the mooncake backends")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds each step in the child may take, and the reading of "
                        "the image's files; the whole run ends within 16 x this "
                        "(default 120)")
    p.add_argument("--on-internal-error", choices=("allow", "deny"), default="allow",
                   help="exit status when the probe itself fails: allow=0 (default), deny=1")
    p.add_argument("--always", action="store_true",
                   help="check even if WORKER_ARGV does not request mooncake")
    p.add_argument("--no-static", action="store_true",
                   help="always import, even when the image's files already prove a cause")
    p.add_argument("--files-only", action="store_true",
                   help="judge the image's files only (a preflight pod in the worker's image, "
                        "no GPU): never start the child or import torch; exit 1 with the "
                        "init container's message for a cause the files prove, else exit 0 "
                        "saying what is left for the GPU node. Not with --level smoke or "
                        "--no-static")
    return p


def _split(argv):
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _termination_path(opts):
    if opts.termination_log is not None:
        return opts.termination_log or None
    path = DEFAULT_TERMINATION_LOG
    if os.path.exists(path) and os.access(path, os.W_OK):
        return path
    return None


def _write(path, text):
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        sys.stderr.write(f"epguard: cannot write {path}: {exc.strerror}\n")


def _absorb(o, run):
    for e in run.events:
        kind = e.get("event")
        if kind == "torch":
            o.torch = e
        elif kind == "import":
            o.imports[e["module"]] = e
        elif kind == "alternate":
            o.alternates[e["module"]] = bool(e.get("ok"))
        elif kind == "backends":
            o.backends = e
        elif kind == "cuda":
            o.cuda = e
        elif kind == "smoke":
            o.smoke.append(e)


def _plan(req, level, timeout, modules):
    alternates = [] if req.either else [
        m for m in _sibling("requirement").MODULES if m not in req.modules]
    return {"modules": modules, "names": req.names, "first_success_only": req.either,
            "alternates": alternates, "level": level, "timeout": timeout}


_SITE_DIRS = ("site-packages", "dist-packages")


def live_image(environ=None, driver_mounted=False):
    """This pod's root as static.py reads it: the child's sys.path (PYTHONPATH is kept
    for the child, while this interpreter may run with -I), without the probe's own
    directory; in the image's own environment unless ``environ`` is given.
    ``driver_mounted``: read as if the NVIDIA driver were mounted (a preflight, which
    runs without a GPU on purpose: the driver is the GPU node's, not the image's)."""
    static = _sibling("static")
    files = _sibling("files")
    environ = sandbox.image_environment() if environ is None else environ
    here = os.path.dirname(os.path.abspath(__file__))
    env_path = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = env_path + [p for p in sys.path if p and os.path.abspath(p) != here]
    # This interpreter runs with -I; the child does not, and site adds the user
    # site-packages of its HOME (when it exists) before the other site folders.
    user = _sibling("access").user_site(environ)
    if user and os.path.isdir(user) and user not in path:
        site_dirs = [i for i, p in enumerate(path) if p.rstrip("/").endswith(_SITE_DIRS)]
        path.insert(site_dirs[0] if site_dirs else len(path), user)
    return static.Image(files.LIVE, path, importlib.machinery.EXTENSION_SUFFIXES,
                        environ, driver_mounted=driver_mounted, workdir=os.getcwd())


def check(opts, req_argv, environ=None, executable=None):
    """The outcome of the checks, and the verdict when the files alone decided it.

    By default in the image's own environment, with the image's interpreter; with
    ``environ`` (the worker's) the child runs there, with ``executable``, and the files
    are consulted only when that is this interpreter (whose sys.path they are read for)."""
    # Start the child first: it spends a second or more importing torch, while the
    # inventory and SGLang's sources are read here. When the image's files prove a
    # cause, the child is stopped long before torch is in memory.
    child = sandbox.Child(opts.timeout, environ, executable)
    same_interpreter = executable is None or executable == sys.executable
    static_note = None
    if not opts.no_static and same_interpreter:
        # Under --timeout; an error or the deadline decides nothing (static.decide).
        facts, found, static_note = _sibling("static").decide(
            live_image(environ), req_argv, deadline.static_until(opts.timeout))
        if found is not None:
            child.stop()
            return facts.outcome, found.verdict
    diagnosis = _sibling("diagnosis")
    requirement_mod = _sibling("requirement")
    inventory = _sibling("inventory")
    o = diagnosis.Outcome()
    o.static_note = static_note
    o.request = req_argv
    o.level = opts.level
    o.timeout = opts.timeout
    # Where the child looks (its PYTHONPATH too: this interpreter may run with -I, and an
    # image may install its packages on a PYTHONPATH of its own).
    files = _sibling("files")
    path = live_image(environ).path
    o.requirement = requirement_mod.requirement(files.LIVE, path)
    o.dists = inventory.mooncake_distributions(path)
    o.package = inventory.mooncake_package(files.LIVE, path,
                                           importlib.machinery.EXTENSION_SUFFIXES)
    o.torch_metadata = inventory.dist_version("torch", path)
    req = o.requirement
    # With no mooncake at all there is nothing to import: only torch and CUDA facts.
    modules = list(req.modules) if (o.dists or o.package.found) else []
    pending = modules
    for _ in range(len(modules) + 1):
        child.send_plan(_plan(req, opts.level, opts.timeout, pending))
        run = child.collect()
        _absorb(o, run)
        if run.finished:
            break
        if run.timed_out:
            rec = {"ok": False, "timeout": int(opts.timeout) if opts.timeout == int(
                opts.timeout) else opts.timeout}
        elif run.signal:
            rec = {"ok": False, "crash": run.signal}
        else:
            rec = {"ok": False, "crash": f"exit status {run.returncode}"}
        o.output_tail = run.output_tail
        step = run.last_step or ""
        if step == "import torch":
            o.torch = rec
            break
        mod = step[len("import "):] if step.startswith("import ") else None
        if mod in pending:
            o.imports[mod] = rec
            pending = pending[pending.index(mod) + 1:]
            if not pending:
                break
            child = sandbox.Child(opts.timeout, environ, executable)
            continue
        if mod:
            o.alternates[mod] = False
        elif step == "cuda":
            o.cuda = dict(rec, available=False, devices=0)
        elif step.startswith("smoke"):
            o.smoke.append(dict(rec, backend=step))
        break
    return o, None


def _judged(opts, req_argv, environ=None):
    """(outcome, verdict, decided from files) in the image's environment, or in
    ``environ`` with the interpreter its PATH finds."""
    executable = sandbox.interpreter_for(environ) if environ is not None else None
    o, v = check(opts, req_argv, environ, executable)
    if v is not None:
        return o, v, True
    return o, _sibling("diagnosis").diagnose(o), False


def _with_pod_environment(o, v, evidence, o_w, v_w, pod_vars):
    """The image's verdict ``v`` (its own environment) and the worker's ``v_w`` (the pod's
    variables ``pod_vars`` restored) as one: a failure about the image stands only when
    the image fails in its own environment; a failure only the pod's variables cause is
    this pod's (environment scope), and a pass only they bring is not a fact about the
    image. A message that may become a verdict about the image counts the pod's
    variables; one about this pod names them. Returns (outcome, verdict, evidence,
    usable only in this pod, the verdict is the image's own)."""
    usable = _sibling("diagnosis").USABLE
    image_cause = v.verdict != usable and v.scope == message.IMAGE
    count, names = sandbox.said_count(pod_vars), sandbox.said_names(pod_vars)
    if v.verdict == usable and v_w.verdict == usable:
        evidence.insert(min(2, len(evidence)), "environment: usable in the image's own "
                        f"environment and with the pod's {count}")
        return o, v, evidence, False, True
    if v_w.verdict == usable:
        ev = list(v_w.evidence)
        ev.insert(min(1, len(ev)), "environment: usable only with the pod's variables "
                  f"({names}); the image's own environment fails: {v.cause}")
        return o_w, v_w, ev, True, False
    if image_cause:
        evidence.insert(min(2, len(evidence)), "environment: decided in the image's own "
                        f"environment, without the pod's {count}; with them it fails too")
        return o, v, evidence, False, True
    # The image's own environment has no image cause: whatever fails is this pod's (the
    # worker run's own scope line, which may say "image", is replaced by this one).
    v_w.scope = message.ENVIRONMENT
    ev = [e for e in v_w.evidence if not e.startswith(message.SCOPE)]
    ev.insert(min(1, len(ev)), "{}environment (fails with the pod's variables: {}; in the "
              "image's own environment: {})".format(
                  message.SCOPE, names,
                  "usable" if v.verdict == usable else v.cause))
    return o_w, v_w, ev, False, False


def _crash_site(tail):
    """The innermost mooncake frame faulthandler printed for a fatal signal.

    faulthandler lists the most recent call first; the innermost frame is often
    ctypes or importlib, so the first one inside a mooncake package says more.
    """
    frames = [ln.strip() for ln in tail.splitlines() if ln.strip().startswith("File ")]
    for line in frames:
        if "/mooncake/" in line:
            return line
    return frames[0] if frames else None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    own, worker = _split(argv)
    opts = _parser().parse_args(own)  # exits 2 on a usage error
    if opts.max_message_bytes < 200:
        _parser().error("--max-message-bytes must be at least 200")
    # NaN compares false with everything and inf never fires: both would let one hung
    # import hold the pod forever (the whole run is bounded by deadline.RUN_STEPS x
    # --timeout, the reading of the image's files by --timeout).
    if not (0 < opts.timeout <= MAX_TIMEOUT):
        _parser().error(f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT}]")
    if opts.files_only and opts.level != PROBE_LEVELS[0]:
        _parser().error(f"--files-only imports nothing, so it cannot run --level {opts.level} "
                        "(the probe on the GPU node does)")
    if opts.files_only and opts.no_static:
        _parser().error("--files-only is the reading of the image's files alone: it cannot "
                        "be combined with --no-static")
    try:
        # The timer is disarmed when the with-block ends, before the report.
        with deadline.whole_run(opts.timeout):
            return _run(opts, worker)
    except deadline.Expired:
        seconds = deadline.RUN_STEPS * opts.timeout
        if opts.files_only:
            # Only a cause the files prove fails a --files-only run; a hang proves none.
            note = (f"the probe's whole run passed {seconds:g} s ({deadline.RUN_STEPS} x "
                    "--timeout): the files decided nothing")
            return _files_clear(opts, None, None, note, sandbox.pod_variables())
        return _expired(opts, seconds)
    except Exception as exc:  # noqa: BLE001 - a probe bug must not block the worker
        sys.stderr.write("epguard: probe internal error (please report):\n")
        traceback.print_exc()
        first = f"{message.PREFIX}probe internal error: {type(exc).__name__}: {exc}"
        fix = ("report this epguard bug; the worker %s" % (
            "is blocked because --on-internal-error=deny" if opts.on_internal_error == "deny"
            else "starts unchecked"))
        _write(_termination_path(opts), message.render(first, [], fix, opts.max_message_bytes))
        return 1 if opts.on_internal_error == "deny" else 0


def _expired(opts, seconds):
    """The whole run passed RUN_STEPS x --timeout: a hang somewhere (what the step
    timeouts did not cover), so, like a hung step, unusable in this pod."""
    cause = (f"timed out after {seconds:g} s (the probe's whole run: "
             f"{deadline.RUN_STEPS} x --timeout)")
    fix = "find what the probe waited for in this pod (a file, a lock, a device)"
    text = message.render(
        message.UNUSABLE_HERE + cause,
        ["versions: torch=unknown sglang=unknown mooncake=unknown",
         message.SCOPE + "environment (this pod or its node; the image may be fine)"],
        fix, opts.max_message_bytes)
    doc = message.report("unusable", [], [{"name": "deadline", "ok": False,
                                          "detail": cause}], {}, cause, fix,
                         classification="timeout", scope=message.ENVIRONMENT,
                         message=text)
    _emit(opts, text, doc)
    return 1


def _emit(opts, text, doc):
    """The termination message (and stderr, for ``kubectl logs``), and with --json the
    report on stdout."""
    _write(_termination_path(opts), text)
    sys.stderr.write(text + "\n")
    if opts.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")


def _request_doc(req_argv):
    return {"backend": req_argv.backend, "where": req_argv.where,
            "dp_attention": req_argv.dp_attention}


def _run(opts, worker):
    req_argv = read_request(worker)
    # Read only on the safe side (the flag and mooncake in text no command places): the
    # webhook judges such an image by rules and verdicts but never probes it, since what
    # runs the text cannot be told; a probe stopping the pod on it could stop a pod that
    # would have served (its launch line says none, an env value says mooncake).
    if (not req_argv.requested or req_argv.unplaced) and not opts.always:
        why = ("the worker argv does not request --elastic-ep-backend mooncake"
               if worker else "no worker argv given (expected: -- WORKER_ARGV...)")
        if req_argv.unresolved is not None and not req_argv.requested:
            # Not "does not request": the value is made by the shell as it runs, which
            # neither admission nor the probe computes.
            why = ("the value of " + cmdline.BACKEND + " cannot be read before the worker "
                   "runs (" + req_argv.unresolved[:200] + "): the image was not checked; "
                   "spell the value literally, or pass it in an environment variable, to "
                   "have it checked")
        elif req_argv.unplaced:
            why += (" on a line the probe reads (it names mooncake only in text no command"
                    " places: " + cmdline.UNPLACED + ")")
        elif req_argv.backend is not None:
            why += f" (it asks for {req_argv.backend.strip()!r})"
        text = message.render(message.NOTHING + why, [], "nothing to fix",
                              opts.max_message_bytes).splitlines()[0]
        doc = message.report("not-requested", [], [
            {"name": "request", "ok": True, "detail": why}], {}, why, "nothing to fix",
            message=text, classification="not-requested")
        _emit(opts, text, doc)
        return 0
    if opts.files_only:
        return _files_only(opts, req_argv)

    o, v, from_files = _judged(opts, req_argv)
    evidence = list(v.evidence)
    if from_files:
        evidence.insert(min(2, len(evidence)), FROM_FILES)
    if v.classification == "crash" and o.output_tail:
        site = _crash_site(o.output_tail)
        if site:
            evidence.insert(1, "crash site: " + site)
    pod_vars = sandbox.pod_variables()
    usable_here, images_own = False, True
    if pod_vars:
        o_w, v_w, _ = _judged(opts, req_argv, sandbox.worker_environment())
        o, v, evidence, usable_here, images_own = _with_pod_environment(
            o, v, evidence, o_w, v_w, pod_vars)
    # What the run the verdict comes from went without: the image's own environment's
    # (names the image chose) or, for this pod's verdict, the worker's.
    dropped = sandbox.interpreter_variables(
        sandbox.image_environment() if images_own else sandbox.worker_environment())
    if v.verdict == _sibling("diagnosis").USABLE and not usable_here:
        other = _users_site(sandbox.image_environment())
        if other is not None:  # a pass another user's pod may not share
            usable_here = True
            evidence.insert(min(2, len(evidence)), "environment: " + other)
    if v.verdict != _sibling("diagnosis").USABLE and v.scope == message.IMAGE:
        refused = _refused_to_this_user(deep=not from_files,
                                        libraries=bool(v.missing_libraries),
                                        cause=v.classification)
        fix = ("run the pod as a user that can read the image's packages (or make them "
               "readable in the image), then the probe can judge the image")
        if refused is None and v.classification == "jit-prerequisites":
            refused, fix = _adapter_elsewhere()
        other = _other_interpreter(req_argv)
        if other is not None:
            refused, fix = other
        if refused is not None:
            # What the image seems to lack may only be hidden from this pod's user.
            v.scope = message.ENVIRONMENT
            evidence = [e for e in evidence if not e.startswith(message.SCOPE)]
            evidence.insert(min(1, len(evidence)),
                            message.SCOPE + "environment (" + refused + ")")
            v.fix = fix
    return _verdict(opts, req_argv, o, v, evidence, from_files, usable_here, dropped,
                    pod_vars)


def _venv_of(path):
    """The virtual environment ``path`` (an interpreter, as named) belongs to, or None: its
    packages are the venv's, though its real file is the system's python."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    return root if os.path.isfile(os.path.join(root, "pyvenv.cfg")) else None


def _other_interpreter(req_argv):
    """(why, fix) in words when the worker's launch may run another interpreter, or find
    other packages or libraries, than this probe does in the image's own environment:
    its program is another interpreter (``/opt/venv/bin/python -m sglang.launch_server``,
    or ``python3.11`` found on the worker's PATH while the image's PATH finds
    /usr/bin/python3), or its command line changes the search itself (``source
    …/activate``, ``export PATH=…``, ``conda run``: cmdline.steering). What this one lacks
    then says nothing about what that one imports (found by review helpers: "torch is not
    installed", scope image, for an image whose venv has it). None when it is this one,
    or is not found."""
    if req_argv.steered:
        return (f"the worker's command line runs {req_argv.steered!r} before or around its "
                "launch, which changes what the launch finds (interpreter, packages or "
                "libraries); the probe cannot follow it, so what it finds missing in the "
                "image's own environment may be there for the worker: the image is not "
                "judged by that",
                "set PATH, PYTHONPATH and the like in the container's env (the probe checks "
                "the image with and without them) or in the image, instead of in the "
                "command line, so that the probe checks what the worker runs")
    why = _runs_another(req_argv)
    if why is None:
        return None
    return why, (f"launch SGLang with the python3 the image's PATH finds ({sys.executable}),"
                 f" or put {os.path.dirname(req_argv.program or '')} first on PATH, so that "
                 "the probe checks the interpreter the worker runs")


def _runs_another(req_argv):
    """In words, when the launch's program is an interpreter other than this one; else
    None (see _other_interpreter)."""
    program = req_argv.program
    if not program or not os.path.basename(program).startswith("python"):
        return None
    here = sys.executable
    if "/" not in program:
        # `python3.11 -m …`, `python -m …`: against the python3 the same PATH finds, which
        # the child imports with (interpreter_for; review helper).
        if program == "python3":
            return None
        path = sandbox.worker_environment().get("PATH", "")
        if len(path) > 64 * 1024:
            return None
        found, here = shutil.which(program, path=path), shutil.which("python3", path=path)
        if found is None or here is None:
            return None
        program = found
    if not os.path.exists(program):
        return None
    same = os.path.abspath(program) == os.path.abspath(here) or (
        os.path.realpath(program) == os.path.realpath(here)
        and _venv_of(program) == _venv_of(here))
    if same:
        return None
    return (f"the worker runs {program}, not {here} that the probe runs in, so what the "
            "probe finds missing may be there for it: the image is not judged by that")


# Causes that say something is absent from the image (a package, a module, a name, a
# library, a toolchain): a path this user was refused on the way may hide it.
_ABSENCE = frozenset({"torch-not-installed", "mooncake-not-installed", "module-missing",
                      "missing-names", "missing-libraries", "no-extension-for-torch",
                      "jit-prerequisites", "cuda-mismatch"})


def _refused_to_this_user(deep, libraries=False, cause=None):
    """A path Python finds packages through that this process's user may not read
    (probe/access.py), in words; None when there is none. Before a failure is called
    the image's: a cause only the pod's runAsUser sees is no fact about the image.
    ``deep``: every file of the packages (after an import); else their folders only
    (after the reading of the files, which noted every refusal it met). Then the
    folders of PATH (the runtime looks python3 up as this user: past one it may not
    search, another interpreter runs, without the image's packages) and, with
    ``libraries`` (a library is said missing), of the loader's search path. With a
    ``cause`` that says something is absent (_ABSENCE), any path this user was refused
    while the probe looked (files.LIVE). Last, whether the packages found follow the
    user's HOME (_users_site)."""
    environ = sandbox.image_environment()
    access = _sibling("access")
    where, cut = access.refused(live_image(environ).path, environ, deep=deep)
    if where is not None:
        return _not_judged("cannot read", where, "so a package may be hidden from it")
    if cut and os.getuid() != 0:
        # Past the walk's budget a refusal is unknown, not absent (root is refused
        # nothing the permission bits decide).
        return (f"the packages hold more than {access.MAX_ENTRIES} entries, more than "
                f"epguard looks at for what this pod's user (uid {os.getuid()}) may read: "
                "the image is not judged as this user")
    folder = access.refused_folder(environ.get("PATH", "").split(os.pathsep)[:256])
    if folder is not None:
        return _not_judged("cannot search", folder,
                           "a folder of PATH, so another python3 may run")
    if libraries:
        folder = access.refused_folder(_sibling("elf").system_dirs(None, environ))
        if folder is not None:
            return _not_judged("cannot search", folder, "where the loader looks for libraries")
    files = _sibling("files")
    if files.LIVE.denied is not None and (libraries or cause in _ABSENCE):
        # Refused on the way to something the diagnosis looked for (a RUNPATH folder, a
        # CUDA_HOME): what seems missing may only be hidden from this user. (Not a
        # mismatch the files show whole: that is no absence.)
        return _not_judged("cannot read", files.LIVE.denied,
                           "so what the image seems to lack may be hidden from it")
    return _users_site(environ, unknown_holds=cause in _ABSENCE)


def _users_site(environ, unknown_holds=False):
    """Why the packages found depend on the pod's user (its HOME's user site), in words;
    None when they do not (probe/access.py another_users_site; ``unknown_holds``: a
    site this user may not list may hold them, before an absence is the image's)."""
    homes, _ = _sibling("inventory").user_homes([environ])
    found = _sibling("access").another_users_site(environ, homes, _runtime_home(),
                                                  unknown_holds)
    if found is None:
        return None
    site, home = found
    return (f"the image holds packages in {site[:200]!r}, the user site of HOME "
            f"{home[:200]!r}, and a child adds the site of its user's HOME (uid "
            f"{os.getuid()} has {environ.get('HOME', '')[:200]!r}): another user's pod "
            "imports other packages, so the image is not judged as this user")


def _runtime_home():
    """The HOME the runtime gives this uid where the image sets none: its /etc/passwd
    entry's, or ``/`` (read as every image file is: bounded, non-blocking)."""
    return _sibling("inventory").passwd_home(os.getuid()) or "/"


def _adapter_elsewhere():
    """(why, fix) when the image may hold a prebuilt JIT adapter this pod's mooncake does
    not look at (another user's HOME, a MOONCAKE_PG_JIT_DIR only the worker sets), or a
    place one could be that this user may not search; (None, None) otherwise. Then a
    build that cannot happen here is this pod's: another user's pod loads the adapter."""
    inventory = _sibling("inventory")
    worker = sandbox.worker_environment()
    roots, undecided = inventory.jit_cache_roots([sandbox.image_environment(), worker])
    if undecided is not None:
        return (f"{undecided[:200]}: where a prebuilt JIT adapter may be is not known for "
                "every user of the image",
                "set MOONCAKE_PG_JIT_DIR to an absolute folder in the image")
    folder = _sibling("access").refused_folder(roots)
    if folder is not None:
        return (_not_judged("cannot search", folder, "where a prebuilt JIT adapter may be"),
                "run the pod as the user the image was built for, or ship the adapter "
                "under a MOONCAKE_PG_JIT_DIR the image sets and every user may read")
    found, hidden = inventory.prebuilt_adapter(roots)
    if found is None and hidden is not None:
        return (_not_judged("cannot read", hidden, "where a prebuilt JIT adapter may be"),
                "run the pod as the user the image was built for, or make the adapter "
                "readable to every user")
    if found is not None:
        home = (worker.get("HOME") or "")[:200]
        cache = os.path.dirname(os.path.dirname(found))[:200]
        return (f"the image holds a prebuilt JIT adapter, {found[:200]!r}, that this pod's "
                f"mooncake did not load (its HOME is {home!r}): another user's pod may",
                f"set MOONCAKE_PG_JIT_DIR to {cache!r} (or run the pod as the user whose "
                "HOME holds it)")
    return None, None


def _not_judged(refused, path, so):
    return (f"this pod's user (uid {os.getuid()}) {refused} {path[:200]!r}, {so}: the image "
            "is not judged as this user")


def _verdict(opts, req_argv, o, v, evidence, from_files, usable_here, dropped, pod_vars):
    """Write the verdict ``v`` (message, stderr, --json) and return the exit status."""
    diagnosis = _sibling("diagnosis")
    if v.verdict == diagnosis.USABLE:
        head = message.USABLE_HERE if usable_here else message.USABLE
    else:
        head = message.UNUSABLE if v.scope == message.IMAGE else message.UNUSABLE_HERE
    if dropped:
        # Early in the message: evidence is dropped from the end when space is short.
        said = ("environment: checked without {} (interpreter settings copied from the "
                "worker, not facts about the image)").format(", ".join(dropped))
        evidence.insert(min(2, len(evidence)), said)
    first = head + v.cause
    text = message.render(first, evidence, v.fix, opts.max_message_bytes)
    doc = message.report(
        v.verdict, o.requirement.modules, v.checks, v.versions, v.cause, v.fix,
        classification=v.classification,
        scope=message.ENVIRONMENT if usable_here else v.scope,
        checked_without=dropped, pod_variables=pod_vars,
        decided_from="files" if from_files else "import",
        missing_libraries=v.missing_libraries,
        request=_request_doc(req_argv),
        message=text)
    _emit(opts, text, doc)
    return 0 if v.verdict == diagnosis.USABLE else 1


def _without_pod_variables(pod_vars):
    return ("environment: judged in the image's own environment, without the pod's "
            f"{sandbox.said_count(pod_vars)}: --files-only judges the image, not a pod")


def _files_only(opts, req_argv):
    """--files-only: the reading of the image's files alone (static.decide), in the image's
    own environment, under --timeout. No child is started and torch is never imported.
    A cause the files prove is written exactly as the init container writes it (exit 1);
    anything else says what is left for the GPU node (exit 0)."""
    # Read as `epguard scan` reads an image: the driver counted as mounted, since this pod
    # has no GPU on purpose and its absence here says nothing about the image (an
    # ImageVerdict's reason must not tell everyone to mount a driver).
    facts, found, note = _sibling("static").decide(
        live_image(driver_mounted=True), req_argv, deadline.static_until(opts.timeout))
    pod_vars = sandbox.pod_variables()
    if found is None:
        return _files_clear(opts, req_argv, facts, note, pod_vars)
    other = _other_interpreter(req_argv)
    refused = other[0] if other is not None else _refused_to_this_user(
        deep=False, cause=found.verdict.classification)
    if refused is not None:
        return _files_clear(opts, req_argv, facts, refused + ": the files decide nothing",
                            pod_vars)
    evidence = list(found.verdict.evidence)
    evidence.insert(min(2, len(evidence)), FROM_FILES)
    if pod_vars:
        evidence.insert(min(2, len(evidence)), _without_pod_variables(pod_vars))
    # The image's own variables only: the pod's are not used here.
    dropped = sandbox.interpreter_variables(sandbox.image_environment())
    return _verdict(opts, req_argv, facts.outcome, found.verdict, evidence, True, False,
                    dropped, pod_vars)


def _files_clear(opts, req_argv, facts, note, pod_vars):
    """--files-only and the files prove no cause (or could not be read: ``note``): exit 0
    with what is left for the GPU node. No verdict about the image: that the files prove
    nothing is no pass (webhook/engine/outcome.py learns nothing from it)."""
    diagnosis = _sibling("diagnosis")
    o = facts.outcome if facts is not None else None
    req = o.requirement if o is not None else None
    modules = list(req.modules) if req is not None else []
    said = (" or " if req is not None and req.either else " and ").join(modules)
    left = [w.format(modules=said or "mooncake's process-group module")
            for w in LEFT_FOR_GPU_NODE]
    cause = "left for the GPU node: {} and {}".format(", ".join(left[:-1]), left[-1])
    notes = ([note] if note else []) + (list(facts.notes) if facts is not None else [])
    findings = list(facts.findings) if facts is not None else []
    versions = diagnosis.versions(o) if o is not None else {}
    evidence = [diagnosis.versions_line(versions)] if versions else []
    evidence += ["files: " + n for n in notes]
    evidence += ["from the files, for the import to confirm: " + f.verdict.cause
                 for f in findings[:MAX_UNCONFIRMED]]
    if pod_vars:
        evidence.append(_without_pod_variables(pod_vars))
    if req_argv is not None:
        evidence.append("request: " + req_argv.describe())
    fix = ("nothing to fix in the image's files; the probe in the worker's pod, on its GPU "
           "node, judges the rest")
    text = message.render(message.FILES_CLEAR + cause, evidence, fix, opts.max_message_bytes)
    checks = [{"name": "files", "ok": not notes,
               "detail": "; ".join(notes) or "no cause the image's files prove"}]
    checks += [{"name": "files: " + str(f.verdict.classification), "ok": False,
                "detail": "for the import to confirm: " + f.verdict.cause}
               for f in findings[:MAX_UNCONFIRMED]]
    doc = message.report(
        "unjudged", modules, checks, versions, cause, fix, classification=None, scope=None,
        checked_without=[], pod_variables=pod_vars, decided_from="files",
        missing_libraries=[], left_for_gpu_node=left,
        request=_request_doc(req_argv) if req_argv is not None else None, message=text)
    _emit(opts, text, doc)
    return 0
