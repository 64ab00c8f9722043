"""``--files-only``: the probe of a preflight pod, run in the worker's image on a node
with no GPU before the worker is scheduled.

It judges the image's files only (the static path, static.decide), never starts the
child and never imports torch. A cause the files prove is written exactly as the init
container writes it (exit 1); files that prove nothing give exit 0 and a first line
saying what is left for the GPU node (message.FILES_CLEAR).

The roots are tests/probe/hostile_roots.py's crafted image (a fake torch 2.13.0+cu130,
a mooncake 0.3.13-shaped package, SGLang 0.5.18's import), changed per test; the fake
torch writes a marker file when anything imports it. No real package is needed except
in the tests marked ``realpkg`` at the end.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from epguard.probe.message import FILES_CLEAR, NOTHING, UNUSABLE, UNUSABLE_HERE
from tests.probe import hostile_roots
from tests.probe.probe_harness import (
    MTE_CUDA12,
    MTE_CUDA13,
    MTE_CUDA13_OLD,
    MTE_NON_CUDA,
    PROBE_DIR,
    SGLANG_EP,
    SGLANG_PG,
    Result,
    clean_env,
    copy_probe,
    overlay,
    run_probe,
)

VERSIONS_RE = re.compile(r"^versions: torch=\S+ sglang=\S+( [a-z0-9-]+=\S+)+$")
NOT_REQUESTED = ["python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "none"]
MARKER = "TORCH-IMPORTED"
# torch/__init__.py of the fake torch: any import of it (the probe's own process or a
# child) leaves MARKER beside the package.
MARKING_TORCH = (
    "import os\n"
    f"open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "
    f"{MARKER!r}), 'w').close()\n"
    "from .version import __version__, cuda  # noqa\n"
)


def _ext(root: Path, leaf: str = "pg_2_13_0") -> Path:
    return root / "mooncake" / f"{leaf}{hostile_roots.ext_suffix()}"


def _no_extension_for_torch(root: Path) -> None:
    _ext(root).rename(_ext(root, "pg_2_12_0"))


def _missing_names(root: Path) -> None:
    _ext(root).write_bytes(hostile_roots.elf_bytes(["libc.so.6"]))


def _no_torch(root: Path) -> None:
    shutil.rmtree(root / "torch")
    shutil.rmtree(root / "torch-2.13.0.dist-info")


def _no_mooncake(root: Path) -> None:
    shutil.rmtree(root / "mooncake")
    shutil.rmtree(root / "mooncake_transfer_engine-0.3.13.post1.dist-info")


def _clear(root: Path) -> None:
    # pg_2_13_0 needs only libc and defines set_transfer_engine: nothing to prove.
    _ext(root).write_bytes(hostile_roots.elf_bytes(["libc.so.6"]) + b"\0set_transfer_engine\0")


def _unconfirmed(root: Path) -> None:
    # A library missing from the image's search path: an image cause the files show, but
    # the loader's search at run time may differ, so only the import proves it.
    _ext(root).write_bytes(
        hostile_roots.elf_bytes(["libnowhere.so.1", "libc.so.6"]) + b"\0set_transfer_engine\0"
    )


PROVEN: dict[str, Callable[[Path], None]] = {
    "cuda-mismatch": lambda root: None,
    "no-extension-for-torch": _no_extension_for_torch,
    "missing-names": _missing_names,
    "torch-not-installed": _no_torch,
    "mooncake-not-installed": _no_mooncake,
}


def make_root(tmp_path: Path, change: Callable[[Path], None], name: str = "root") -> Path:
    root = hostile_roots.write_root(tmp_path / name)
    (root / "torch" / "__init__.py").write_text(MARKING_TORCH)
    change(root)
    return root


def torch_imported(root: Path) -> bool:
    return (root / MARKER).exists()


def probe(
    tmp_path: Path,
    root: Path,
    *opts: str,
    worker: list[str] | None = None,
    probe_dir: Path = PROBE_DIR,
    python: str = sys.executable,
    **env: str,
) -> Result:
    """The probe as an init container runs it, with ``root`` as the image (PYTHONPATH)."""
    return run_probe(
        tmp_path,
        python=python,
        env=clean_env([root], **env),
        opts=list(opts),
        worker=hostile_roots.WORKER if worker is None else worker,
        probe_dir=probe_dir,
        timeout=120,
    )


def patched_probe(tmp_path: Path, module: str, old: str, new: str) -> Path:
    """A copy of the probe with ``old`` replaced by ``new`` in ``module``; never the repo."""
    copied = copy_probe(tmp_path / "patched")
    src = copied / module
    text = src.read_text()
    assert text.count(old) == 1, old
    src.write_text(text.replace(old, new))
    return copied


# --- a cause the files prove ------------------------------------------------------------

DRIVER = "libcuda.so.1"


def assert_the_init_containers_cause_without_the_driver(files: Any, full: Any) -> None:
    """A preflight reads the files as `epguard scan` does, the NVIDIA driver counted as
    mounted (it runs without a GPU on purpose): the same cause, versions, scope and
    request as the init container's, without the driver the GPU node mounts."""
    assert files.rc == full.rc == 1, files.message + files.stderr
    assert files.lines[0].split("; also missing:")[0] == full.lines[0].split("; also missing:")[0]
    assert DRIVER not in files.message and "NVIDIA driver" not in files.message
    for prefix in ("versions:", "scope:", "request:"):
        assert [ln for ln in files.lines if ln.startswith(prefix)] == [
            ln for ln in full.lines if ln.startswith(prefix)
        ]
    for key in ("verdict", "classification", "scope", "decided_from", "versions", "request"):
        assert files.report[key] == full.report[key], key
    assert files.report["missing_libraries"] == [
        m for m in full.report["missing_libraries"] if DRIVER not in str(m)
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cause", list(PROVEN))
def test_a_cause_the_files_prove_is_the_init_containers_without_the_gpu_nodes_driver(
    tmp_path, cause
):
    root = make_root(tmp_path, PROVEN[cause])
    files = probe(tmp_path, root, "--files-only")
    assert not torch_imported(root)
    full = probe(tmp_path, root)
    # The init container decided it from the files too: the same cause, the same path.
    assert full.report["decided_from"] == "files", full.message
    assert full.report["classification"] == cause
    assert files.lines[0].startswith(UNUSABLE)
    assert_the_init_containers_cause_without_the_driver(files, full)
    assert files.message.strip() in files.stderr


# --- files that prove nothing -----------------------------------------------------------


@pytest.mark.timeout(120)
def test_files_that_prove_nothing_exit_0_saying_what_is_left_for_the_gpu_node(tmp_path):
    root = make_root(tmp_path, _clear)
    r = probe(tmp_path, root, "--files-only")
    assert r.rc == 0, r.message + r.stderr
    assert r.lines[0].startswith(FILES_CLEAR)
    left = r.lines[0][len(FILES_CLEAR) :]
    assert left.startswith("left for the GPU node: the import of mooncake.pg after torch")
    for what in ("libcuda.so.1", "a visible GPU", "mooncake-cpu", "smoke test"):
        assert what in left
    assert [ln for ln in r.lines if VERSIONS_RE.match(ln)] == [
        "versions: torch=2.13.0+cu130 sglang=0.5.18 mooncake-transfer-engine=0.3.13.post1"
    ]
    assert "request: --elastic-ep-backend mooncake (argv)" in r.lines
    assert r.lines[-1].startswith("fix: nothing to fix in the image's files")
    assert not any(ln.startswith("from the files, for the import to confirm") for ln in r.lines)
    doc = r.report
    assert (doc["verdict"], doc["decided_from"], doc["scope"], doc["classification"]) == (
        "unjudged",
        "files",
        None,
        None,
    )
    assert doc["required_modules"] == ["mooncake.pg"]
    assert doc["versions"]["torch"] == "2.13.0+cu130"
    assert doc["checks"] == [
        {"name": "files", "ok": True, "detail": "no cause the image's files prove"}
    ]
    assert doc["cause"] == left and doc["message"] == r.message
    assert len(doc["left_for_gpu_node"]) == 5
    assert r.message.strip() in r.stderr
    # The same image without --files-only: the import decides (and imports torch).
    full = probe(tmp_path, root)
    assert full.report["decided_from"] == "import"


@pytest.mark.timeout(120)
def test_a_cause_the_files_show_but_do_not_prove_is_said_and_left_to_the_import(tmp_path):
    root = make_root(tmp_path, _unconfirmed)
    r = probe(tmp_path, root, "--files-only")
    assert r.rc == 0, r.message
    assert r.lines[0].startswith(FILES_CLEAR)
    [line] = [ln for ln in r.lines if ln.startswith("from the files, for the import to confirm: ")]
    assert "missing libnowhere.so.1" in line
    assert {
        "name": "files: missing-libraries",
        "ok": False,
        "detail": line.replace("from the files, ", ""),
    } in r.report["checks"]
    full = probe(tmp_path, root)
    assert full.rc == 1 and full.report["decided_from"] == "import"


# --- no child, no torch -----------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", [_clear, _unconfirmed, PROVEN["cuda-mismatch"]])
def test_files_only_never_imports_torch(tmp_path, change):
    root = make_root(tmp_path, change)
    r = probe(tmp_path, root, "--files-only")
    assert r.rc in (0, 1) and "internal error" not in r.message
    assert not torch_imported(root)
    if change is not PROVEN["cuda-mismatch"]:
        # The control: without --files-only the child imports this torch, and the
        # marker says so (the files prove nothing, so the import decides).
        probe(tmp_path, root)
        assert torch_imported(root)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", [_clear, PROVEN["cuda-mismatch"]])
def test_files_only_starts_no_child(tmp_path, change):
    # sandbox.Child, patched in a copy, leaves a marker and ends the probe with 97.
    started = tmp_path / "child-started"
    copied = patched_probe(
        tmp_path,
        "sandbox.py",
        "        self.timeout = timeout\n",
        f"        open({str(started)!r}, 'w').close()\n        os._exit(97)\n",
    )
    root = make_root(tmp_path, change)
    r = probe(tmp_path, root, "--files-only", probe_dir=copied)
    assert r.rc in (0, 1), r.stderr
    assert not started.exists()
    # The control: the init container's run starts the child first.
    control = probe(tmp_path, root, probe_dir=copied)
    assert control.rc == 97 and started.exists()


# --- options ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("opts", "said"), [(["--level", "smoke"], "--level smoke"), (["--no-static"], "--no-static")]
)
def test_files_only_with_an_import_option_is_a_usage_error(tmp_path, opts, said):
    root = make_root(tmp_path, _clear)
    r = probe(tmp_path, root, "--files-only", *opts)
    assert r.rc == 2
    assert "usage: python3 probe" in r.stderr
    assert "--files-only" in r.stderr and said in r.stderr
    assert r.message == "" and r.report is None
    # Each option alone, and --files-only with the default level, are fine.
    assert probe(tmp_path, root, *opts, worker=NOT_REQUESTED).rc == 0
    assert probe(tmp_path, root, "--files-only", "--level", "import").rc == 0


@pytest.mark.timeout(60)
def test_a_worker_that_does_not_request_mooncake_is_nothing_to_check(tmp_path):
    root = make_root(tmp_path, PROVEN["cuda-mismatch"])
    r = probe(tmp_path, root, "--files-only", worker=NOT_REQUESTED)
    assert r.rc == 0
    assert r.lines == [
        NOTHING + "the worker argv does not request --elastic-ep-backend "
        "mooncake (it asks for 'none')"
    ]
    assert r.report["verdict"] == "not-requested"
    # --always checks it anyway: the files prove the cause.
    always = probe(tmp_path, root, "--files-only", "--always", worker=NOT_REQUESTED)
    assert always.rc == 1 and always.lines[0].startswith(UNUSABLE)
    assert not torch_imported(root)


@pytest.mark.timeout(60)
def test_a_flag_only_in_text_no_command_places_is_nothing_to_check(tmp_path):
    # The webhook judges such an image by rules and verdicts but never probes it: the
    # probe must not stop a pod whose launch line may never run it (here it says none
    # and a here-document only writes a file).
    root = make_root(tmp_path, PROVEN["cuda-mismatch"])
    script = (
        "cat > /tmp/other.sh <<'EOF'\n"
        "python3 -m sglang.launch_server --elastic-ep-backend mooncake\nEOF\n"
        "exec python3 -m sglang.launch_server --elastic-ep-backend none"
    )
    r = probe(tmp_path, root, "--files-only", worker=["sh", "-c", script])
    assert r.rc == 0 and r.report["verdict"] == "not-requested"
    assert "text no command places" in r.lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", [_clear, _unconfirmed, PROVEN["cuda-mismatch"]])
def test_the_message_fits_max_message_bytes(tmp_path, change):
    root = make_root(tmp_path, change)
    full = probe(tmp_path, root, "--files-only")
    r = probe(tmp_path, root, "--files-only", "--max-message-bytes", "200")
    assert len(full.message.encode()) > 200  # the limit really cuts something
    assert len(r.message.encode()) <= 200
    assert r.lines[0][:40] == full.lines[0][:40]
    assert r.lines[-1].startswith("fix: ")
    assert VERSIONS_RE.match(r.lines[1]), r.message


@pytest.mark.timeout(120)
def test_a_verdict_about_the_image_carries_no_text_the_pod_chose(tmp_path: Path) -> None:
    """Found by a review helper: the pod's variable names (any printable text since
    Kubernetes 1.32) were listed in a message that becomes an ImageVerdict every tenant
    reads, and a pod value found in the text was replaced by ``$`` + its name."""
    bad = make_root(tmp_path, PROVEN["cuda-mismatch"], "bad")
    alone = probe(tmp_path, bad, "--files-only")
    assert alone.rc == 1 and alone.lines[0].startswith(UNUSABLE), alone.message
    word = "libcudart.so.12"
    assert word in alone.lines[0], alone.message
    said = "the image is fine ask your admin"
    # (And a value the probe writes itself, as many pods set: EP_BACKEND=mooncake.)
    pod = {f"EPGUARD_POD_{said}": word, "EPGUARD_POD_EP_BACKEND": "mooncake"}
    r = probe(tmp_path, bad, "--files-only", **pod)
    assert r.rc == 1 and r.lines[0].startswith(UNUSABLE), r.message
    assert said not in r.message and "EPGUARD_POD" not in r.message, r.message
    assert "$POD_VARIABLE" in r.lines[0], r.message  # the value, not the name
    assert "without the pod's 2 variables:" in r.message, r.message
    assert r.lines[1] == alone.lines[1] and r.lines[1].startswith("versions: "), r.message
    assert "request: --elastic-ep-backend mooncake" in r.message, r.message


@pytest.mark.timeout(60)
def test_no_termination_log_still_says_it_on_stderr(tmp_path):
    root = make_root(tmp_path, _clear)
    r = probe(tmp_path, root, "--files-only", "--termination-log", "")
    assert r.rc == 0 and r.message == ""
    assert r.stderr.startswith(FILES_CLEAR)


@pytest.mark.timeout(120)
def test_the_pods_variables_are_not_used_and_it_says_so(tmp_path):
    bad = make_root(tmp_path, PROVEN["cuda-mismatch"], "bad")
    clear = make_root(tmp_path, _clear, "clear")
    alone = probe(tmp_path, bad, "--files-only")
    # The pod's PYTHONPATH would hide the bad mooncake behind a clear one: not used.
    r = probe(
        tmp_path,
        bad,
        "--files-only",
        EPGUARD_POD_PYTHONPATH=str(clear),
        EPGUARD_POD_HF_HOME="/models/cache",
    )
    assert r.rc == 1 and r.lines[0] == alone.lines[0]
    said = (
        "environment: judged in the image's own environment, without the pod's 2 variables: "
        "--files-only judges the image, not a pod"
    )
    assert said in r.lines and "HF_HOME" not in r.message, r.message  # counted, not named
    assert r.report["pod_variables"] == ["HF_HOME", "PYTHONPATH"]
    # And the other way: a pod PYTHONPATH with a bad mooncake does not fail a clear image.
    r = probe(tmp_path, clear, "--files-only", EPGUARD_POD_PYTHONPATH=str(bad))
    assert r.rc == 0 and r.lines[0].startswith(FILES_CLEAR)
    assert said.replace("2 variables", "1 variable") in r.lines


@pytest.mark.timeout(120)
def test_files_not_read_within_timeout_decide_nothing(tmp_path):
    # The static path's deadline, patched to have passed: a proven image is then unjudged.
    copied = patched_probe(
        tmp_path,
        "deadline.py",
        "def static_until(timeout, now=None):\n",
        "def static_until(timeout, now=None):\n    return 0.0\n",
    )
    root = make_root(tmp_path, PROVEN["cuda-mismatch"])
    r = probe(tmp_path, root, "--files-only", probe_dir=copied)
    assert r.rc == 0, r.message + r.stderr
    assert r.lines[0].startswith(FILES_CLEAR)
    assert (
        "files: the image's files were not read within --timeout: decided by the import" in r.lines
    )
    assert not any(ln.startswith("versions: ") for ln in r.lines)  # nothing known
    assert r.report["checks"][0]["ok"] is False
    assert probe(tmp_path, root, "--files-only").rc == 1  # unpatched: proven


@pytest.mark.waits
@pytest.mark.timeout(120)
def test_the_whole_run_deadline_in_files_only_decides_nothing(tmp_path):
    # The files' reading blocks (patched): the run's own deadline (16 x --timeout) ends it.
    # The init container calls that a hang in this pod (exit 1); a files-only run only
    # fails for a cause the files prove.
    copied = patched_probe(
        tmp_path,
        "static.py",
        "def decide(image, request, until):\n",
        "def decide(image, request, until):\n    import time\n    time.sleep(300)\n",
    )
    root = make_root(tmp_path, PROVEN["cuda-mismatch"])
    t = time.monotonic()
    r = probe(tmp_path, root, "--files-only", "--timeout", "0.2", probe_dir=copied)
    assert time.monotonic() - t < 60
    assert r.rc == 0, r.message + r.stderr
    assert r.lines[0].startswith(FILES_CLEAR)
    assert (
        "files: the probe's whole run passed 3.2 s (16 x --timeout): the files decided nothing"
    ) in r.lines
    control = probe(tmp_path, root, "--timeout", "0.2", probe_dir=copied)
    assert control.rc == 1 and control.lines[0].startswith(UNUSABLE_HERE)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("policy", "rc"), [(None, 0), ("allow", 0), ("deny", 1)])
def test_an_internal_error_follows_on_internal_error(tmp_path, policy, rc):
    copied = patched_probe(
        tmp_path,
        "static.py",
        "def decide(image, request, until):\n",
        "def decide(image, request, until):\n    raise KeyError('bug')\n",
    )
    root = make_root(tmp_path, _clear)
    opts = [] if policy is None else [f"--on-internal-error={policy}"]
    r = probe(tmp_path, root, "--files-only", *opts, probe_dir=copied)
    assert r.rc == rc
    assert r.lines[0].startswith("epguard: probe internal error: KeyError")


def _python38() -> str | None:
    found = shutil.which("python3.8")
    if found and subprocess.run([found, "-V"], capture_output=True).returncode == 0:
        return found
    pyenv = sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.8*/bin/python3.8")))
    return pyenv[-1] if pyenv else None


@pytest.mark.timeout(120)
@pytest.mark.skipif(_python38() is None, reason="no Python 3.8 interpreter on this machine")
def test_files_only_runs_on_python_3_8(tmp_path):
    py38 = _python38()
    assert py38 is not None
    # The roots' compiled modules carry the suffix of the interpreter that imports them.
    suffix = subprocess.run(
        [py38, "-c", "import importlib.machinery as m; print(m.EXTENSION_SUFFIXES[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    copied = copy_probe(tmp_path)
    for name, change, rc, head in (
        ("clear", _clear, 0, FILES_CLEAR),
        ("bad", PROVEN["cuda-mismatch"], 1, UNUSABLE),
    ):
        root = make_root(tmp_path, change, name)
        _ext(root).rename(root / "mooncake" / f"pg_2_13_0{suffix}")
        r = probe(tmp_path, root, "--files-only", probe_dir=copied, python=py38)
        assert r.rc == rc, r.stderr
        assert r.lines[0].startswith(head)
        assert not torch_imported(root)
        if rc:
            assert r.message == probe(tmp_path, root, probe_dir=copied, python=py38).message


# --- real wheels ------------------------------------------------------------------------


@pytest.mark.realpkg
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("mooncake", "sglang", "cause"),
    [
        (MTE_CUDA12, SGLANG_PG[0], "cuda-mismatch"),
        (MTE_CUDA13_OLD, SGLANG_PG[0], "no-extension-for-torch"),
        (MTE_NON_CUDA, SGLANG_PG[0], "non-cuda-wheel"),
        (MTE_CUDA12, SGLANG_EP[0], "cuda-mismatch"),
    ],
)
def test_real_wheels_the_files_prove_unusable_give_the_init_containers_cause(
    tmp_path, mooncake, sglang, cause
):
    env = clean_env([overlay(mooncake), overlay(sglang)])
    files = run_probe(tmp_path, env=env, opts=["--files-only"])
    full = run_probe(tmp_path, env=env)
    assert full.report["decided_from"] == "files"
    assert full.report["classification"] == cause
    assert_the_init_containers_cause_without_the_driver(files, full)


@pytest.mark.realpkg
@pytest.mark.timeout(300)
def test_real_cuda13_wheel_is_left_for_the_gpu_node(tmp_path):
    # cuda13 0.3.13.post1 over torch 2.13.0+cu130: the files prove nothing (a missing
    # rdma-core library is for the import to confirm), the init container imports.
    env = clean_env([overlay(MTE_CUDA13), overlay(SGLANG_PG[0])])
    r = run_probe(tmp_path, env=env, opts=["--files-only"])
    assert r.rc == 0, r.message
    assert r.lines[0].startswith(FILES_CLEAR + "left for the GPU node: the import of mooncake.pg")
    assert (
        "versions: torch=2.13.0+cu130 sglang=0.5.18 mooncake-transfer-engine-cuda13=0.3.13.post1"
    ) in r.lines
    assert r.report["verdict"] == "unjudged"
    assert run_probe(tmp_path, env=env).report["decided_from"] == "import"


def _as_root_and_nobody(
    request: pytest.FixtureRequest,
    hidden: str | None,
    *,
    files_only: bool = True,
    prepare: Callable[[Path], None] | None = None,
    home: str | None = None,
    path: str = "/usr/bin:/bin",
) -> dict[str, tuple[int, str]]:
    """The probe run on the crafted root (hostile_roots.write_root) as root and as uid
    65534, with ``hidden`` (a path under the root) made root-only (0700): (exit, message)
    of each. ``prepare`` changes the root first; ``home`` is the image's HOME."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another uid")
    # The system's interpreter: another uid cannot reach one under root's home (pyenv).
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs a system python3 that any uid can run")
    # Not under tmp_path: pytest's own directories are root-only, so another uid could
    # not reach the probe there.
    holder = tempfile.TemporaryDirectory(prefix="epguard-rau-", dir="/tmp")
    request.addfinalizer(holder.cleanup)
    base = Path(holder.name)
    root = hostile_roots.write_root(base / "site")
    if prepare is not None:
        prepare(root)
    probe_dir = base / "probe"
    shutil.copytree(PROBE_DIR, probe_dir, ignore=shutil.ignore_patterns("__pycache__"))
    for p in (base, probe_dir, *probe_dir.rglob("*")):
        p.chmod(0o755 if p.is_dir() else 0o644)
    if hidden != "":
        root.chmod(0o755)
        for p in root.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
    if hidden is not None:
        (root / hidden).chmod(0o700 if (root / hidden).is_dir() else 0o600)
    env = {"PATH": path, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    if home is not None:
        env["HOME"] = home
    results = {}
    for who, prefix in (
        ("root", []),
        ("nobody", ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]),
    ):
        log = base / f"log-{who}"
        log.touch()
        log.chmod(0o666)
        mode = ["--files-only"] if files_only else ["--timeout", "30"]
        r = subprocess.run(
            [*prefix, python, "-I", str(probe_dir), *mode,
             "--termination-log", str(log), "--", *hostile_roots.WORKER],
            env=env, capture_output=True, text=True, cwd="/tmp", timeout=100,
        )  # fmt: skip
        results[who] = (r.returncode, log.read_text())
    return results


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize(
    ("hidden", "said"),
    [
        # The whole sys.path entry: it once proved "torch is not installed".
        ("", "cannot be listed as this user"),
        # Each of the folders the files are read from: nothing the user cannot read is
        # absent (mooncake's own once proved the package held no extension).
        ("mooncake", "/mooncake/__init__.py' cannot be read as this user"),
        ("torch", "/torch/__init__.py' cannot be read as this user"),
        ("sglang", "/sglang/__init__.py' cannot be read as this user"),
        ("mooncake_transfer_engine-0.3.13.post1.dist-info", ".dist-info/METADATA' cannot be read"),
    ],
    ids=["site-packages", "mooncake-folder", "torch", "sglang", "mooncake-dist-info"],
)
def test_a_runasuser_that_cannot_list_the_packages_proves_nothing(
    request: pytest.FixtureRequest, hidden: str, said: str
) -> None:
    """An image that keeps its packages root-only (0700), read as the uid a pod chose: the
    files it cannot list are not absent (a cause proven from them, scope image, would be
    a verdict for the image's digest: for every tenant, steered by one)."""
    results = _as_root_and_nobody(request, hidden)
    # As root the crafted image's files decide (here: a cause or nothing, as they say);
    # as a uid that cannot list them, nothing is proven about the image.
    code, text = results["nobody"]
    assert code == 0 and text.startswith(FILES_CLEAR), text
    assert said in text and "the files decide nothing" in text, text
    assert "torch is not installed" not in text
    assert results["root"][1] != text  # the uid changed what was read, not what was proven


def _mooncake_through_a_pth(root: Path) -> None:
    """mooncake and its dist-info moved to a folder of their own, named by a .pth."""
    (root / "extra").mkdir()
    for name in ("mooncake", "mooncake_transfer_engine-0.3.13.post1.dist-info"):
        shutil.move(str(root / name), str(root / "extra" / name))
    (root / "mooncake.pth").write_text("extra\n")


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize("hidden", ["mooncake.pth", "extra"])
def test_a_pth_file_or_its_folder_kept_from_the_user_proves_nothing(
    request: pytest.FixtureRequest, hidden: str
) -> None:
    # Python's site skips an unreadable .pth, and a folder it cannot stat, without a
    # word: mooncake would look "not installed" to this user alone.
    results = _as_root_and_nobody(request, hidden, prepare=_mooncake_through_a_pth)
    assert results["root"][0] == 1 and results["root"][1].startswith(UNUSABLE)
    code, text = results["nobody"]
    assert code == 0 and text.startswith(FILES_CLEAR), text
    assert "cannot read" in text and f"/{hidden}'" in text, text


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_a_user_site_the_user_cannot_reach_proves_nothing(request: pytest.FixtureRequest) -> None:
    # The child imports without -s: packages under HOME/.local count, and a HOME this uid
    # may not enter hides them.
    home = Path(tempfile.mkdtemp(prefix="epguard-home-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(home, ignore_errors=True))
    home.chmod(0o700)
    results = _as_root_and_nobody(request, None, home=str(home))
    assert results["root"][0] == 1 and results["root"][1].startswith(UNUSABLE)
    code, text = results["nobody"]
    assert code == 0 and text.startswith(FILES_CLEAR), text
    # The message names HOME as $HOME (probe/message.py keeps paths short).
    assert "cannot read '$HOME/.local/lib/python" in text, text


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_the_import_as_a_user_refused_the_package_is_this_pods_failure(
    request: pytest.FixtureRequest,
) -> None:
    """The init-container probe: the files prove nothing (mooncake's folder is root-only
    to this uid), so the import decides, and Python reads that folder as an empty
    namespace package: `No module named 'mooncake.pg'`. That is this pod's user's, never
    the image's (it was learned as the image's, for every tenant)."""
    results = _as_root_and_nobody(request, "mooncake", files_only=False)
    assert results["root"][0] == 1 and results["root"][1].startswith(UNUSABLE), results["root"]
    code, text = results["nobody"]
    assert code == 1 and text.startswith(UNUSABLE_HERE), text
    assert "scope: environment (this pod's user (uid 65534) cannot read" in text, text
    assert "scope: image" not in text


def test_packages_in_the_user_site_of_the_images_home_are_read(tmp_path: Path) -> None:
    """An image built with ``pip install --user``: torch, mooncake and SGLang in the user
    site-packages of its HOME, which the worker's python3 (no -I) adds to sys.path. The
    probe (run with -I) reads them there too; before, its files said "torch is not
    installed", scope image: a verdict for every tenant on an image that works."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs a system python3 (a venv's has no user site)")
    version = subprocess.run(
        [python, "-c", "import sys; print('python%d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    home = tmp_path / "home"
    hostile_roots.write_root(home / ".local" / "lib" / version / "site-packages")
    log = tmp_path / "log"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    r = subprocess.run(
        [python, "-I", str(PROBE_DIR), "--files-only", "--termination-log", str(log),
         "--", *hostile_roots.WORKER],
        env=env, capture_output=True, text=True, timeout=100, cwd=str(tmp_path),
    )  # fmt: skip
    text = log.read_text()
    assert "not installed" not in text, text
    # What the crafted root's files prove (hostile_roots: the CUDA 12 build beside a
    # CUDA 13 torch), as they would in site-packages.
    assert r.returncode == 1 and text.startswith(UNUSABLE), text
    assert "is built for CUDA 12" in text.splitlines()[0], text


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_a_path_folder_the_user_cannot_search_proves_nothing_about_the_image(
    request: pytest.FixtureRequest,
) -> None:
    """The runtime looks python3 up in the image's PATH as the pod's user: past a folder
    it may not search (a venv under a root-only folder) another interpreter runs, without
    the image's packages. What that one finds is no fact about the image."""
    private = Path(tempfile.mkdtemp(prefix="epguard-venv-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(private, ignore_errors=True))
    private.chmod(0o700)
    results = _as_root_and_nobody(request, None, path=f"{private}:/usr/bin:/bin")
    assert results["root"][0] == 1 and results["root"][1].startswith(UNUSABLE)
    code, text = results["nobody"]
    assert code == 0 and text.startswith(FILES_CLEAR), text
    # (The message names a path from the environment by its variable.)
    assert "cannot search '$PATH', a folder of PATH, so another python3 may run" in text, text


def test_packages_in_a_user_site_that_follows_the_pods_user_are_no_image_fact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image that installed its packages with ``pip install --user`` as its own user and
    sets no HOME: the runtime gives each uid its passwd HOME (``/`` for one it does not
    name), so a pod's runAsUser chose which user site the probe read, and "torch is not
    installed", scope image, was learned for every tenant (found by a review helper).
    Here in-process, with the homes given (the host's /etc/passwd is not the image's)."""
    from epguard.probe import access

    monkeypatch.setattr(access, "_venv_isolated", lambda: False)  # an image's python3
    app = tmp_path / "home" / "app"
    site = Path(access.user_site_of(str(app), {}))
    homes = ["/", "/root", str(app)]
    runtime = {"PATH": "/usr/bin:/bin", "HOME": "/"}  # a uid passwd does not name
    assert access.another_users_site(runtime, homes, "/") is None  # no user site holds anything
    site.mkdir(parents=True)
    (site / "requests").mkdir()  # packages the probe never imports: the same answer
    assert access.another_users_site(runtime, homes, "/") is None
    (site / "torch-2.13.0.dist-info").mkdir()
    assert access.another_users_site(runtime, homes, "/") == (str(site), str(app))
    # The image's own user, HOME from the runtime: still one user's packages.
    mine = {**runtime, "HOME": str(app)}
    assert access.another_users_site(mine, homes, str(app)) == (str(site), str(app))
    # A HOME or PYTHONUSERBASE the image sets is every user's.
    assert access.another_users_site(mine, homes, "/root") is None
    assert access.another_users_site({**runtime, "PYTHONUSERBASE": "/opt/u"}, homes, "/") is None


def test_a_refusal_met_looking_for_a_library_or_a_toolchain_is_no_image_fact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dependency walk (a RUNPATH folder) and the JIT toolchain check (CUDA_HOME)
    stat through files.LIVE, which keeps the first path this user was refused; nothing
    read it, so a root-only RUNPATH folder made "missing libibverbs.so.1", scope image,
    for any other uid (found by a review helper). In-process: the refusal is given."""
    from epguard.probe import cli, files, sandbox

    # An image's plain environment, not this runner's (whose PATH may hold folders a
    # non-root runner cannot search).
    environ = {"PATH": "/usr/bin:/bin", "HOME": "/"}
    monkeypatch.setattr(sandbox, "image_environment", lambda: environ)
    # (Not this test's.)
    monkeypatch.setattr(cli, "_users_site", lambda environ, unknown_holds=False: None)
    monkeypatch.setattr(files.LIVE, "denied", None)
    assert cli._refused_to_this_user(deep=False, libraries=True) is None
    monkeypatch.setattr(files.LIVE, "denied", "/opt/rdma/lib")
    said = cli._refused_to_this_user(deep=False, libraries=True)
    assert said is not None and "cannot read '/opt/rdma/lib'" in said
    assert "the image is not judged as this user" in said
    assert cli._refused_to_this_user(deep=False, cause="jit-prerequisites") == said
    # A mismatch the files show whole is no absence a refusal could hide.
    assert cli._refused_to_this_user(deep=False, cause="abi-mismatch") is None


def test_an_image_cause_read_through_one_users_site_is_this_pods(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's check before a failure is called the image's: a user site that
    follows the pod's user makes it this pod's (in-process, the homes and the runtime's
    HOME given: the host's /etc/passwd is not the image's)."""
    from epguard.probe import access, cli, files, inventory, sandbox

    monkeypatch.setattr(access, "_venv_isolated", lambda: False)
    monkeypatch.setattr(files.LIVE, "denied", None)
    app = tmp_path / "app"
    environ = {"PATH": "/usr/bin:/bin", "HOME": "/"}
    monkeypatch.setattr(sandbox, "image_environment", lambda: environ)
    monkeypatch.setattr(inventory, "user_homes", lambda environs, fs=None: (["/", str(app)], None))
    monkeypatch.setattr(cli, "_runtime_home", lambda: "/")
    assert cli._refused_to_this_user(deep=False) is None
    (Path(access.user_site_of(str(app), environ)) / "torch").mkdir(parents=True)
    said = cli._refused_to_this_user(deep=False)
    assert said is not None and f"the user site of HOME {str(app)!r}" in said, said


def test_a_package_walk_cut_by_its_budget_judges_nothing_for_another_user(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past 200,000 entries the access walk stops; a refusal past it was taken for none
    (found by a review helper). In-process: the cut walk and the uid are given."""
    import os

    from epguard.probe import access, cli, files, sandbox

    environ = {"PATH": "/usr/bin:/bin", "HOME": "/"}  # an image's, not this runner's
    monkeypatch.setattr(sandbox, "image_environment", lambda: environ)
    monkeypatch.setattr(cli, "_users_site", lambda environ, unknown_holds=False: None)
    monkeypatch.setattr(files.LIVE, "denied", None)
    monkeypatch.setattr(access, "refused", lambda path, environ, deep=True: (None, True))
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    said = cli._refused_to_this_user(deep=True)
    assert said is not None and "more than 200000 entries" in said and "uid 1000" in said
    monkeypatch.setattr(access, "refused", lambda path, environ, deep=True: (None, False))
    assert cli._refused_to_this_user(deep=True) is None


def test_a_user_site_this_user_may_not_list_may_hold_the_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review helper: an image's packages in ``/home/app/.local`` (0700, as
    ``useradd -m`` makes it), read by a pod with another runAsUser (or by a preflight's
    root without CAP_DAC_OVERRIDE), was "holds nothing": "torch is not installed", scope
    image, for every tenant. The refusal is a stand-in (this test's root is refused
    nothing): os.scandir raises as the kernel does for such a user. A HOME with a NUL
    (from the image's /etc/passwd) is real: it crashed the probe, exit 0."""
    from epguard.probe import access

    monkeypatch.setattr(access, "_venv_isolated", lambda: False)
    app = tmp_path / "home" / "app"
    site = access.user_site_of(str(app), {})
    runtime = {"PATH": "/usr/bin:/bin", "HOME": "/"}
    homes = ["/", str(app)]
    assert access.another_users_site(runtime, homes, "/") is None  # not there: holds nothing
    real = os.scandir

    def refused(path: Any) -> Any:
        if str(path) == site:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(access.os, "scandir", refused)
    # Before an absence is called the image's: it may hold them.
    assert access.another_users_site(runtime, homes, "/", unknown_holds=True) == (site, str(app))
    # For a pass: this process imported nothing from a folder it cannot list (/root is
    # 0700: as "may hold" every non-root pod's pass was "usable in this pod", found by
    # the next review).
    assert access.another_users_site(runtime, homes, "/") is None
    monkeypatch.setattr(access.os, "scandir", real)
    evil = "/x\0y"
    assert access.another_users_site(runtime, ["/", evil], "/", unknown_holds=True) == (
        access.user_site_of(evil, {}),
        evil,
    )
    assert access.another_users_site(runtime, ["/", evil], "/") is None


def test_a_launch_line_naming_another_interpreter_proves_nothing_about_the_image(
    tmp_path: Path,
) -> None:
    """Found by a review helper: the worker runs ``/opt/venv/bin/python -m
    sglang.launch_server`` (its venv holds torch) while the image's PATH finds a python3
    without it; the probe, in that python3, said "torch is not installed", scope image: a
    verdict for every tenant on an image that works. Here the system python3 (without
    torch, checked first) and a real venv of it (a different sys.path, the same file)."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs a system python3")
    has_torch = subprocess.run([python, "-c", "import torch"], capture_output=True)
    if has_torch.returncode == 0:
        pytest.skip("the system python3 has torch: nothing is missing from it")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}

    def files_only(program: str, mode: str = "--files-only") -> tuple[int, str]:
        log = tmp_path / "log"
        r = subprocess.run(
            [python, "-I", str(PROBE_DIR), mode, "--termination-log", str(log),
             "--", program, "-m", "sglang.launch_server", "--elastic-ep-backend", "mooncake"],
            env=env, capture_output=True, text=True, timeout=100, cwd=str(tmp_path),
        )  # fmt: skip
        return r.returncode, log.read_text()

    code, text = files_only("python3")  # the interpreter the probe runs in: a fact
    assert code == 1 and text.startswith(UNUSABLE) and "torch is not installed" in text, text
    code, text = files_only(python)  # the same one, named by its path
    assert code == 1 and text.startswith(UNUSABLE), text
    code, text = files_only(str(venv / "bin" / "python"))
    assert code == 0 and text.startswith(FILES_CLEAR), text
    # (Paths from the environment are named by their variable.)
    assert "the worker runs $HOME/venv/bin/python, not $PATH/python3" in text, text
    # A name without a path is found on the worker's PATH, against the python3 found
    # there (review helper): a venv's `python-sgl` beside the system's python3.
    (venv / "bin" / "python-sgl").symlink_to("python")
    env["PATH"] = f"/usr/bin:/bin:{venv}/bin"
    code, text = files_only("python-sgl")
    assert code == 0 and text.startswith(FILES_CLEAR), text
    assert "python-sgl, not" in text, text
    env["PATH"] = "/usr/bin:/bin"
    # The init container (the import in a child of the probe's interpreter): this pod's.
    code, text = files_only(str(venv / "bin" / "python"), "--timeout=60")
    assert code == 1 and text.startswith(UNUSABLE_HERE), text
    assert "scope: environment (the worker runs $HOME/venv/bin/python" in text, text
    assert "scope: image" not in text


def test_a_launch_line_that_changes_what_the_launch_finds_proves_nothing_about_the_image(
    tmp_path: Path,
) -> None:
    """Found by a review helper: ``bash -c 'source /opt/venv/bin/activate && python3 -m
    sglang.launch_server …'`` (or ``PATH=… python3``, ``conda run``) runs the venv's
    python3 though the word is the same as the image's; the probe, in the image's own
    python3 (no torch), said "torch is not installed", scope image: a verdict for every
    tenant on an image that works. Control: the same line without the change proves it."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs a system python3")
    if subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("the system python3 has torch: nothing is missing from it")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    launch = "python3 -m sglang.launch_server --elastic-ep-backend mooncake"

    def run(argv: list[str], mode: str = "--files-only") -> tuple[int, str]:
        log = tmp_path / "log"
        r = subprocess.run(
            [python, "-I", str(PROBE_DIR), mode, "--termination-log", str(log), "--", *argv],
            env=env, capture_output=True, text=True, timeout=100, cwd=str(tmp_path),
        )  # fmt: skip
        return r.returncode, log.read_text()

    code, text = run(["bash", "-c", launch])  # control: the image's own python3
    assert code == 1 and text.startswith(UNUSABLE) and "torch is not installed" in text, text
    for argv, said in (
        (["bash", "-c", f"source /opt/venv/bin/activate && {launch}"], "source /opt/venv"),
        (["sh", "-c", f". /opt/conda/etc/profile.d/conda.sh; {launch}"], ". /opt/conda"),
        (["bash", "-c", f"PATH=/opt/venv/bin:$PATH {launch}"], "PATH="),
        (["bash", "-c", f"export PYTHONPATH=/opt/site; {launch}"], "PYTHONPATH="),
        (["env", "LD_LIBRARY_PATH=/opt/lib", *launch.split()], "LD_LIBRARY_PATH="),
        (["conda", "run", "-n", "sgl", *launch.split()], "conda run"),
    ):
        code, text = run(argv)
        assert code == 0 and text.startswith(FILES_CLEAR), (argv, text)
        assert f"runs '{said}" in text and "the files decide nothing" in text, (argv, text)
    # The init container (the import in a child of the probe's interpreter): this pod's.
    code, text = run(["bash", "-c", f"source /opt/venv/bin/activate && {launch}"], "--timeout=60")
    assert code == 1 and text.startswith(UNUSABLE_HERE), text
    assert "scope: environment (the worker's command line runs 'source" in text, text
    assert "scope: image" not in text


# --- where the worker's python finds packages this reading does not see ------------------
# Each made "torch is not installed" (or "has no mooncake.pg"), scope image, of an image
# that works: found by a review helper. Control: the same root without the twist proves
# the cause (test_a_cause_the_files_prove_is_the_init_containers_without_the_gpu_nodes_driver).


def _decides_nothing(r: Result, why: str) -> None:
    assert r.rc == 0 and r.lines[0].startswith(FILES_CLEAR), r.message + r.stderr
    assert why in r.message and "the files decide nothing" in r.message, r.message


@pytest.mark.timeout(120)
def test_an_image_pythonhome_is_not_read_past(tmp_path: Path) -> None:
    root = make_root(tmp_path, _no_torch)
    # (The probe itself runs here without -I: a PYTHONHOME it can start with.)
    r = probe(tmp_path, root, "--files-only", PYTHONHOME=sys.base_prefix)
    _decides_nothing(r, "the image sets PYTHONHOME")


@pytest.mark.timeout(120)
def test_a_working_directory_holding_the_package_is_not_read_past(tmp_path: Path) -> None:
    root = make_root(tmp_path, _no_torch)
    (tmp_path / "torch").mkdir()  # the probe's working directory, as the worker's
    # A folder without __init__.py (a checkout, as /sgl-workspace/sglang) is a namespace
    # portion: the cause stands.
    r = probe(tmp_path, root, "--files-only")
    assert r.rc == 1 and "torch is not installed" in r.lines[0], r.message
    (tmp_path / "torch" / "__init__.py").write_text("")
    r = probe(tmp_path, root, "--files-only")
    _decides_nothing(r, "holds torch, which python -m imports before sys.path")


@pytest.mark.timeout(120)
def test_an_editable_install_hook_is_not_read_past(tmp_path: Path) -> None:
    root = make_root(tmp_path, _no_torch)
    # setuptools' own hook, in most site-packages, names none of them: the cause stands.
    (root / "distutils-precedence.pth").write_text(
        "import os; var = 'SETUPTOOLS_USE_DISTUTILS'; enabled = os.environ.get(var, 'local')"
        " == 'local'; enabled and __import__('_distutils_hack').add_shim();\n"
    )
    r = probe(tmp_path, root, "--files-only")
    assert r.rc == 1 and "torch is not installed" in r.lines[0], r.message
    (root / "_mooncake_editable.pth").write_text("import _mooncake_editable_loader\n")
    r = probe(tmp_path, root, "--files-only")  # scikit-build-core's, for mooncake
    _decides_nothing(r, "installs an import hook (an editable install)")
    (root / "_mooncake_editable.pth").unlink()
    (root / "__editable__.torch-2.13.0.pth").write_text(
        "import __editable___torch_2_13_0_finder; __editable___torch_2_13_0_finder.install()\n"
    )
    r = probe(tmp_path, root, "--files-only")
    _decides_nothing(r, "installs an import hook (an editable install)")
    # A path-style editable install (a folder line) is on sys.path: read as any other.
    (root / "__editable__.torch-2.13.0.pth").write_text(str(tmp_path / "src") + "\n")
    r = probe(tmp_path, root, "--files-only")
    assert r.rc == 1 and "torch is not installed" in r.lines[0], r.message


@pytest.mark.timeout(120)
def test_a_package_extended_over_several_folders_is_read_in_all_of_them(tmp_path: Path) -> None:
    root = make_root(tmp_path, _clear)
    more = tmp_path / "more" / "mooncake"
    more.mkdir(parents=True)
    _ext(root).rename(more / _ext(root).name)  # the extension in the second folder only
    env = {"PYTHONPATH": f"{root}:{more.parent}"}
    r = probe(tmp_path, root, "--files-only", **env)
    assert r.rc == 1, r.message  # without extend_path, the second folder is not mooncake's
    (root / "mooncake" / "__init__.py").write_text(
        "from pkgutil import extend_path\n__path__ = extend_path(__path__, __name__)\n"
    )
    r = probe(tmp_path, root, "--files-only", **env)
    assert r.rc == 0 and r.lines[0].startswith(FILES_CLEAR), r.message
    # A folder of that name before the regular package (a namespace portion) is one of
    # them too, as extend_path makes it (review helper).
    r = probe(tmp_path, root, "--files-only", PYTHONPATH=f"{more.parent}:{root}")
    assert r.rc == 0 and r.lines[0].startswith(FILES_CLEAR), r.message


@pytest.mark.timeout(120)
def test_a_module_of_too_many_identifiers_proves_no_missing_name(tmp_path: Path) -> None:
    """Review helper: 64 MiB of distinct 4-letter identifiers took 2.2 GB as a set, and a
    MemoryError (a smaller node) turned the proven cause into none. Past
    files.MAX_IDENTIFIERS (a real pg_* has ~1,500) the names it defines are unknown."""
    from epguard.probe import files

    limit = files.MAX_IDENTIFIERS
    names = b"".join(b"\0n%d" % i for i in range(limit)) + b"\0"
    assert len(files.identifier_strings(names) or ()) == limit
    assert files.identifier_strings(names + b"xy\0") is None
    root = make_root(tmp_path, _missing_names)
    assert probe(tmp_path, root, "--files-only").rc == 1  # the name is proven missing
    _ext(root).write_bytes(hostile_roots.elf_bytes(["libc.so.6"]) + names + b"xy\0")
    r = probe(tmp_path, root, "--files-only")
    assert r.rc == 0 and r.lines[0].startswith(FILES_CLEAR), r.message


@pytest.mark.timeout(120)
def test_torch_library_folders_are_read_once_and_in_bounds(tmp_path: Path) -> None:
    """Review helper: torch/lib with 100,000 files behind 50 linked sys.path entries took
    603 MB as paths (about 12 GB at the 1,024-entry limit). Each folder is now read once;
    past static.MAX_PROVIDED libraries, what torch maps is unknown: no cause proven."""
    from epguard.probe import static

    root = make_root(tmp_path, _missing_names)
    links = []
    for i in range(50):
        link = tmp_path / f"link{i}"
        link.symlink_to(root)
        links.append(str(link))
    env = {"PYTHONPATH": ":".join([str(root), *links])}
    r = probe(tmp_path, root, "--files-only", **env)
    assert r.rc == 1 and r.report["classification"] == "missing-names", r.message
    lib = root / "torch" / "lib"
    lib.mkdir()
    for i in range(static.MAX_PROVIDED + 1):
        (lib / f"lib{i}.so").touch()
    r = probe(tmp_path, root, "--files-only", **env)
    assert r.rc == 0 and r.lines[0].startswith(FILES_CLEAR), r.message
    assert f"more than {static.MAX_PROVIDED} libraries" in r.message


@pytest.mark.timeout(60)
def test_a_value_the_shell_makes_as_it_runs_is_said_to_be_unchecked(tmp_path):
    # ${V,,} is computed by bash at launch; the reader computes no case conversion. The
    # probe said "does not request mooncake" although the webhook told the tenant the
    # probe would check it: now it says the image was not checked, and why.
    root = make_root(tmp_path, PROVEN["cuda-mismatch"])
    script = "V=MOONCAKE; exec python3 -m sglang.launch_server --elastic-ep-backend ${V,,}"
    r = probe(tmp_path, root, "--files-only", worker=["bash", "-c", script])
    assert r.rc == 0 and r.report["verdict"] == "not-requested"
    assert "cannot be read before the worker runs (${V,,})" in r.lines[0]
    assert "the image was not checked" in r.lines[0]
    assert "does not request" not in r.lines[0]
