"""The probe on hostile image files (issue 21 point 10, and the probe's share of 8-9).

Every test builds a root in tmp_path (tests/probe/hostile_roots.py: a fake torch
2.13.0+cu130, a mooncake 0.3.13-shaped package whose pg_2_13_0 needs libcudart.so.12,
SGLang 0.5.18's import), which the files prove unusable (cuda-mismatch), then changes
one file. The probe runs as the init container runs it, in its own process, under a
wall-clock timeout (a hang fails the test instead of the suite) and, where the old
code ate memory, under RLIMIT_AS. No real torch is needed.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from epguard.probe import elf, files, static
from tests.probe import hostile_roots

REPO = Path(__file__).resolve().parents[2]
PROBE_DIR = REPO / "probe"
# Far above what the probe needs (~20 MiB RSS, ~300 MiB of address space for an
# interpreter), far below what the old ELF reader took (1.6 GiB).
AS_LIMIT = 768 << 20


@dataclass
class Probe:
    rc: int
    report: dict
    message: str
    stderr: str


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def run_probe(tmp_path: Path, root: Path, extra: dict[str, str] | None = None,
              opts: tuple[str, ...] = (), timeout: float = 60) -> Probe:
    log = tmp_path / "termination-log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update({"PYTHONPATH": str(root), "PYTHONNOUSERSITE": "1"}, **(extra or {}))
    proc = subprocess.run(
        [sys.executable, str(PROBE_DIR), "--json", "--termination-log", str(log),
         "--timeout", "20", *opts, "--", *hostile_roots.WORKER],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=timeout,
        preexec_fn=_limit_memory,
    )
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return Probe(proc.returncode, report, log.read_text() if log.exists() else "",
                 proc.stderr)


def hostile_root(tmp_path: Path, variant: str | None) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "root"
    return root, hostile_roots.make(root, variant)


def assert_proven_cuda_mismatch(r: Probe) -> None:
    assert "internal error" not in r.message + r.stderr, r.stderr
    assert r.rc == 1, r.message
    assert r.report["classification"] == "cuda-mismatch", r.message
    assert r.report["decided_from"] == "files"


@pytest.mark.timeout(90)
def test_the_crafted_root_is_proven_unusable_from_its_files(tmp_path):
    # The control: what every hostile variant below must still say.
    root, extra = hostile_root(tmp_path, None)
    assert_proven_cuda_mismatch(run_probe(tmp_path, root, extra))


ELF_VARIANTS = [v for v in hostile_roots.VARIANTS if v.startswith("elf ")]
FIFO_VARIANTS = [v for v in hostile_roots.VARIANTS if v.startswith("fifo ")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("variant", ELF_VARIANTS)
def test_a_malformed_libmooncake_cannot_turn_a_proven_cause_into_exit_0(tmp_path, variant):
    # d5affd9: MemoryError / OverflowError -> "probe internal error", exit 0 (the worker
    # starts unchecked), 1.6 GiB for the 400 names, or a hang for 65,535 PT_LOAD.
    root, extra = hostile_root(tmp_path, variant)
    assert_proven_cuda_mismatch(run_probe(tmp_path, root, extra))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("variant", FIFO_VARIANTS)
def test_a_fifo_among_the_image_files_does_not_hang_the_probe(tmp_path, variant):
    # d5affd9: open() of the FIFO waited for a writer forever, --timeout or not.
    root, extra = hostile_root(tmp_path, variant)
    r = run_probe(tmp_path, root, extra)
    assert "internal error" not in r.message + r.stderr
    assert r.rc == 1, r.message
    if variant != "fifo torch/version.py":
        # Nothing the diagnosis needs is in the FIFO: the files still decide.
        assert_proven_cuda_mismatch(r)


@pytest.mark.timeout(90)
def test_a_4_mib_sglang_source_with_many_aliases_is_read_in_linear_time(tmp_path):
    # 20,000 `from mooncake import pg as mN` and their uses, then an import whose
    # parenthesis never closes, repeated to 4 MiB: d5affd9 did not end in 30 s.
    root, extra = hostile_root(tmp_path, "4 MiB sglang source, 20k aliases")
    r = run_probe(tmp_path, root, extra)
    assert_proven_cuda_mismatch(r)
    assert r.report["required_modules"] == ["mooncake.pg"]


@pytest.mark.timeout(90)
def test_a_loader_over_the_text_limit_is_not_read_so_the_files_decide_nothing(tmp_path):
    # The scan skips a loader over files.MAX_TEXT_BYTES; d5affd9's probe read its first
    # MiB and decided from that. Now both read it whole or not at all: the import decides.
    root, extra = hostile_root(tmp_path, None)
    pg = root / "mooncake" / "pg.py"
    pg.write_text(pg.read_text() + "#" * 99 + ("\n" + "#" * 99) * (files.MAX_TEXT_BYTES // 100))
    assert pg.stat().st_size > files.MAX_TEXT_BYTES
    r = run_probe(tmp_path, root, extra)
    assert "internal error" not in r.message + r.stderr
    assert r.rc == 1
    assert r.report["decided_from"] == "import"


@pytest.mark.timeout(90)
def test_a_compiled_module_too_large_to_read_proves_no_missing_name(tmp_path):
    # d5affd9 read the first 64 MiB of pg_2_13_0, did not find set_transfer_engine in
    # it, and proved "missing-names" from what it had not read.
    root, extra = hostile_root(tmp_path, None)
    ext = root / "mooncake" / f"pg_2_13_0{hostile_roots.ext_suffix()}"
    ext.write_bytes(hostile_roots.elf_bytes(["libc.so.6"]))
    os.truncate(ext, files.MAX_STRINGS_BYTES + 1)  # sparse: nothing is written
    r = run_probe(tmp_path, root, extra)
    assert "internal error" not in r.message + r.stderr
    assert r.report["decided_from"] == "import"
    assert r.report["classification"] != "missing-names"


@pytest.mark.timeout(90)
def test_a_loader_naming_18000_modules_is_bounded_and_decides_nothing(tmp_path):
    # d5affd9 searched for the next `raise ImportError` from each of the 18,000
    # import_module calls (18,000 scans of 1 MiB), then walked 18,000 roots, and decided
    # from that. Past static.MAX_LOADER_TARGETS the loader is unreadable and the import
    # decides.
    root, extra = hostile_root(tmp_path, None)
    line = 'importlib.import_module("mooncake.pg" + version_suffix)\n'
    (root / "mooncake" / "pg.py").write_text(
        hostile_roots.PG_LOADER.split("try:")[0] + line * (files.MAX_TEXT_BYTES // len(line)))
    r = run_probe(tmp_path, root, extra)
    assert "internal error" not in r.message + r.stderr
    assert r.rc == 1
    assert r.report["decided_from"] == "import"
    assert files.MAX_TEXT_BYTES // len(line) > static.MAX_LOADER_TARGETS


# --- the ELF reader and the dependency walk, in a process of their own -----------------

_READ = textwrap.dedent("""
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    sys.path.insert(0, {repo!r})
    from epguard.probe import elf
    d = elf.read_dynamic(sys.argv[1])
    print(json.dumps(None if d is None else d.needed))
""")


def read_needed(path: Path, timeout: float = 30) -> list[str] | None:
    """elf.read_dynamic(path).needed in a child under RLIMIT_AS; None if unreadable."""
    code = _READ.format(limit=AS_LIMIT, repo=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=timeout, check=True)
    result: list[str] | None = json.loads(proc.stdout)
    return result


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strsz", [1 << 40, (1 << 64) - 1])
def test_elf_names_are_read_whatever_dt_strsz_claims(tmp_path, strsz):
    # ld.so reads a name up to its NUL; d5affd9 read DT_STRSZ bytes (OverflowError,
    # MemoryError).
    so = tmp_path / "lib.so"
    so.write_bytes(hostile_roots.elf_bytes(["libc.so.6", "libm.so.6"], strsz=strsz))
    assert read_needed(so) == ["libc.so.6", "libm.so.6"]


@pytest.mark.timeout(60)
def test_elf_with_400_names_without_nul_is_unreadable_in_bounded_memory(tmp_path):
    so = tmp_path / "lib.so"
    so.write_bytes(hostile_roots.elf_bytes(
        [], strtab=b"A" * (4 << 20), offsets=[i * 16 for i in range(400)]))
    assert read_needed(so) is None


@pytest.mark.timeout(60)
def test_elf_with_65535_program_headers_is_read_in_one_pass(tmp_path):
    # 65,534 PT_LOAD and 4,000 DT_STRTAB (a dynamic section under the 64 KiB limit):
    # d5affd9 mapped every DT_STRTAB through every PT_LOAD, 2.6e8 steps.
    so = tmp_path / "lib.so"
    so.write_bytes(hostile_roots.elf_bytes(
        ["libc.so.6"], loads=65534, extra_dynamic=[(hostile_roots.DT_STRTAB, 0x10000)] * 4000))
    assert read_needed(so, timeout=20) == ["libc.so.6"]
    # Past the dynamic-section limit the file is unreadable, at once.
    so.write_bytes(hostile_roots.elf_bytes(
        ["libc.so.6"], loads=65534, extra_dynamic=[(hostile_roots.DT_STRTAB, 0x10000)] * 65534))
    assert read_needed(so, timeout=20) is None


@pytest.mark.timeout(60)
def test_elf_past_its_limits_is_unreadable_not_truncated(tmp_path):
    # A cut list of DT_RUNPATH / DT_NEEDED could make a present library look missing.
    so = tmp_path / "lib.so"
    names = [f"libx{i}.so" for i in range(elf.MAX_DEPENDENCIES + 1)]
    so.write_bytes(hostile_roots.elf_bytes(names))
    assert read_needed(so) is None
    so.write_bytes(hostile_roots.elf_bytes(["lib" + "x" * elf.MAX_NAME_BYTES + ".so"]))
    assert read_needed(so) is None
    # A DT_NEEDED past the end of the string table DT_STRSZ declares.
    so.write_bytes(hostile_roots.elf_bytes([], strtab=b"\0libc.so.6\0", offsets=[1, 500]))
    assert read_needed(so) is None


@pytest.mark.timeout(30)
def test_elf_reader_opens_no_fifo(tmp_path):
    fifo = tmp_path / "libmooncake_pg.so"
    os.mkfifo(fifo)
    assert elf.read_dynamic(str(fifo)) is None
    assert files.LIVE.read_text(str(fifo)) is None
    assert files.LIVE.strings(str(fifo)) is None
    assert files.LIVE.read_text("/dev/zero") is None


@pytest.mark.timeout(60)
def test_a_100k_entry_ld_library_path_is_cut_in_linear_time_and_proves_no_absence(tmp_path):
    # d5affd9 deduplicated with list membership: 100,000 entries took minutes.
    value = ":".join(f"/nonexistent/d{i}" for i in range(100_000))
    search = elf.system_dirs(files.LIVE, {"LD_LIBRARY_PATH": value})
    assert len(search) == elf.MAX_SEARCH_DIRS
    assert search.cut
    so = tmp_path / "libroot.so"
    so.write_bytes(hostile_roots.elf_bytes(["libnowhere.so.1"]))
    walk = elf.missing_libraries([str(so)], search=search, fs=files.LIVE)
    assert [n for n, _ in walk] == ["libnowhere.so.1"]
    assert not walk.complete


@pytest.mark.timeout(60)
def test_the_dependency_walk_stops_at_its_lookup_budget(tmp_path):
    # 200 objects x 1,024 names x 1,024 directories would be 2e8 stats.
    lib = tmp_path / "lib"
    lib.mkdir()
    names = [f"libn{i}.so" for i in range(elf.MAX_DEPENDENCIES)]
    (lib / "libroot.so").write_bytes(hostile_roots.elf_bytes(names))
    search = elf.SearchPath(f"/nonexistent/{i}" for i in range(elf.MAX_SEARCH_DIRS))
    walk = elf.missing_libraries([str(lib / "libroot.so")], search=search, fs=files.LIVE)
    assert not walk.complete
    assert len(walk) <= elf.MAX_LOOKUPS // elf.MAX_SEARCH_DIRS + 1


# --- deadlines -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_static_path_past_its_deadline_decides_nothing(tmp_path):
    root, _ = hostile_root(tmp_path, None)
    from epguard.probe import cmdline

    request = cmdline.read(hostile_roots.WORKER, env={})
    image = static.Image(files.LIVE, [str(root)], [hostile_roots.ext_suffix()], {},
                         driver_mounted=False)
    facts, found, note = static.decide(image, request, time.monotonic() - 1)
    assert (facts, found) == (None, None)
    assert note is not None and "--timeout" in note
    # The same root, in time: proven.
    image = static.Image(files.LIVE, [str(root)], [hostile_roots.ext_suffix()], {},
                         driver_mounted=False)
    facts, found, note = static.decide(image, request, time.monotonic() + 60)
    assert found is not None and found.verdict.classification == "cuda-mismatch"


_BLOCKED = textwrap.dedent("""
    import os, subprocess, sys, time
    sys.path.insert(0, {repo!r})
    from epguard.probe import deadline
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             start_new_session=True)
    r, w = os.pipe()
    t = time.monotonic()
    try:
        with deadline.whole_run(0.05):
            os.read(r, 1)  # blocks: nobody writes
        print("not expired")
    except deadline.Expired:
        print("expired", child.wait(timeout=10), round(time.monotonic() - t, 1))
""")


@pytest.mark.timeout(60)
def test_the_whole_run_deadline_ends_a_blocked_system_call_and_kills_the_child():
    from epguard.probe import deadline
    proc = subprocess.run([sys.executable, "-c", _BLOCKED.format(repo=str(REPO))],
                          capture_output=True, text=True, timeout=30)
    words = proc.stdout.split()
    assert words[:2] == ["expired", "-9"], proc.stdout + proc.stderr
    assert float(words[2]) >= deadline.RUN_STEPS * 0.05


@pytest.mark.waits
@pytest.mark.timeout(150)
def test_a_probe_whose_child_never_ends_stops_at_the_whole_run_deadline(tmp_path):
    # Code in the image can write step announcements on the probe's pipe forever: each
    # renews the step timeout, so only the run's own deadline ends it. Without SGLang
    # both modules are tried, each in a child that hangs (d5affd9: 2 x 8 step timeouts,
    # then "timed out while importing").
    root, extra = hostile_root(tmp_path, None)
    hang = textwrap.dedent("""
        import json, os, sys, time
        fd = int(sys.argv[1])
        while True:
            os.write(fd, (json.dumps({"event": "step", "step": "import " + __name__})
                          + "\\n").encode())
            time.sleep(0.05)
    """)
    (root / "mooncake" / "pg.py").write_text(hang)
    (root / "mooncake" / "ep.py").write_text(hang)
    for p in root.glob("sglang*"):
        subprocess.run(["rm", "-rf", str(p)], check=True)
    # --timeout 2: the fake torch's import (the first step) must fit one step even on a
    # loaded machine; the whole run is then 32 s.
    r = run_probe(tmp_path, root, extra, opts=("--timeout", "2"), timeout=100)
    assert r.rc == 1, r.message
    assert r.report["classification"] == "timeout", r.message
    assert r.report.get("scope") == "environment"
    assert "the probe's whole run" in r.report["cause"]
