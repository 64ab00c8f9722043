"""Outcomes no published wheel can reach on this machine, with small test doubles.

A healthy mooncake needs the NVIDIA driver's libcuda.so.1 to load, so on a machine
without a GPU no real wheel gets as far as registering its torch backends. These
doubles are plain ``mooncake`` packages run with the real torch 2.13.0: they
register through torch's real ``Backend.register_backend`` and are checked through
the real ``Backend.backend_capability``. Each test says which real case it stands for.
"""

from __future__ import annotations

import pytest

from tests.probe.probe_harness import (
    PG_NAMES,
    REGISTER_BOTH,
    SGLANG_EP,
    SGLANG_PG,
    clean_env,
    overlay,
    run_probe,
    write_double,
)

pytestmark = pytest.mark.realpkg


def probe(tmp_path, double, *overlays, **kw):
    return run_probe(tmp_path, pythonpath=[double, *(overlay(o) for o in overlays)], **kw)


# --- usable -------------------------------------------------------------------------------


def test_says_usable_when_the_module_imports_and_registers_both_backends(tmp_path):
    # Stands for mooncake-transfer-engine-cuda13 0.3.13.post1 on a GPU node with rdma-core.
    double = write_double(tmp_path / "img", pg=REGISTER_BOTH + PG_NAMES)
    r = probe(tmp_path, double, SGLANG_PG[0])
    assert r.rc == 0, r.stderr
    assert r.lines[0].startswith(
        "epguard: mooncake elastic EP is usable: mooncake.pg imports with torch 2.13.0+cu130"
    )
    assert r.lines[-1] == "fix: nothing to fix"
    assert "backends: mooncake=cuda mooncake-cpu=cpu" in r.lines
    assert (
        "versions: torch=2.13.0+cu130 sglang=0.5.18 "
        "mooncake-transfer-engine-cuda13=0.0.0.double" in r.lines
    )
    assert r.report["verdict"] == "usable"
    assert all(c["ok"] for c in r.report["checks"])


def test_without_sglang_the_first_module_that_works_is_enough(tmp_path):
    # Stands for an image with mooncake but no SGLang (e.g. a Dynamo base layer).
    double = write_double(tmp_path / "img", pg=REGISTER_BOTH + PG_NAMES)
    r = probe(tmp_path, double)
    assert r.rc == 0, r.message
    assert [c["name"] for c in r.report["checks"] if c["name"].startswith("import ")] == [
        "import mooncake.pg",
        "import mooncake.ep",
    ]
    ep = next(c for c in r.report["checks"] if c["name"] == "import mooncake.ep")
    assert ep["detail"] == "not attempted"


# --- registrations ------------------------------------------------------------------------


def test_half_a_registration_is_unusable(tmp_path):
    # Stands for F11: a broken wheel that registers "mooncake" but not "mooncake-cpu";
    # SGLang creates both groups, so startup would fail.
    half = REGISTER_BOTH.replace(
        'dist.Backend.register_backend("mooncake-cpu"', '# dist.Backend.register_backend("x"'
    )
    double = write_double(tmp_path / "img", pg=half + PG_NAMES)
    r = probe(tmp_path, double, SGLANG_PG[0])
    assert r.rc == 1
    assert r.classification == "half-registration"
    assert "mooncake.pg registers only mooncake; SGLang needs both" in r.lines[0]
    assert "backends: mooncake=cuda mooncake-cpu=absent" in r.lines


def test_an_import_that_registers_nothing_is_unusable(tmp_path):
    # Stands for a mooncake.ep of 0.3.14 (torch-independent _ep, no PG) under SGLang <= 0.5.16.
    double = write_double(
        tmp_path / "img",
        ep=PG_NAMES + "\ndef set_host_ip(*a): pass\ndef set_device_filter(*a): pass\n",
    )
    r = probe(tmp_path, double, SGLANG_EP[1])
    assert r.rc == 1
    assert r.classification == "backends-missing"
    assert "registers no mooncake torch backend" in r.lines[0]


# --- names the engine imports -------------------------------------------------------------


def test_names_the_symbols_the_engine_imports_that_are_missing(tmp_path):
    # Stands for F3: mooncake 0.3.9-0.3.10.post2 has pg.py without set_transfer_engine,
    # which SGLang >= 0.5.17 imports.
    names = PG_NAMES.replace("def set_transfer_engine", "def _no_set_transfer_engine")
    double = write_double(tmp_path / "img", pg=REGISTER_BOTH + names)
    r = probe(tmp_path, double, SGLANG_PG[1])
    assert r.rc == 1
    assert r.classification == "missing-names"
    assert "mooncake.pg lacks set_transfer_engine, which SGLang 0.5.23 imports" in r.lines[0]
    assert "mooncake-transfer-engine-cuda13==0.3.13.post1" in r.lines[-1]
    assert "0.3.11" in r.lines[-1]


def test_says_which_module_works_when_sglang_wants_the_other_one(tmp_path):
    # Stands for SGLang >= 0.5.17 beside mooncake <= 0.3.8, which has only mooncake.ep (F4).
    double = write_double(tmp_path / "img", ep=REGISTER_BOTH + PG_NAMES)
    r = probe(tmp_path, double, SGLANG_PG[0])
    assert r.rc == 1
    assert r.classification == "module-missing"
    assert "has no mooncake.pg (SGLang 0.5.18 imports it); mooncake.ep imports" in r.lines[0]
    assert "other module: mooncake.ep imports" in r.lines


# --- crashes and hangs --------------------------------------------------------------------

SEGFAULT = "import torch\nimport ctypes\nctypes.string_at(0)\n"


def test_reports_a_segfault_on_import_instead_of_dying(tmp_path):
    # Stands for F16: native init conflicts that segfault on import.
    double = write_double(tmp_path / "img", pg=SEGFAULT)
    r = probe(tmp_path, double, SGLANG_PG[0])
    assert r.rc == 1
    assert r.classification == "crash"
    assert "crashed with SIGSEGV while importing mooncake.pg" in r.lines[0]
    site = next(line for line in r.lines if line.startswith("crash site: "))
    assert "mooncake/pg.py" in site


@pytest.mark.waits
def test_reports_a_hang_on_import_after_the_step_timeout(tmp_path):
    # Stands for an import that blocks (a lock, a network call, a device); also what
    # 0.3.14 does while it JIT-builds its adapter for minutes.
    double = write_double(tmp_path / "img", pg="import time\ntime.sleep(3600)\n")
    # 10 s: the real torch must import inside one step's timeout on a loaded 2-core VM.
    r = probe(tmp_path, double, SGLANG_PG[0], opts=["--timeout", "10"])
    assert r.rc == 1
    assert r.classification == "timeout"
    assert "timed out after 10 s while importing mooncake.pg" in r.lines[0]


def test_falls_back_to_a_fresh_child_after_a_crash(tmp_path):
    # Without SGLang either module will do: when mooncake.pg kills the child, a new
    # child still tries mooncake.ep (a 0.3.9-0.3.13 wheel exposes the PG under both).
    double = write_double(tmp_path / "img", pg=SEGFAULT, ep=REGISTER_BOTH + PG_NAMES)
    r = probe(tmp_path, double)
    assert r.rc == 0, r.message
    checks = {c["name"]: c for c in r.report["checks"]}
    assert checks["import mooncake.pg"] == {
        "name": "import mooncake.pg",
        "ok": False,
        "detail": "crashed with SIGSEGV",
    }
    assert checks["import mooncake.ep"]["ok"]


# --- --level smoke ----------------------------------------------------------------------------


def test_smoke_level_reports_a_process_group_that_cannot_be_created(tmp_path):
    # Stands for a wheel that imports and registers but whose backend fails when
    # SGLang creates the groups (e.g. no usable transport in the pod). The double's
    # backend constructor raises, through torch's real init_process_group.
    double = write_double(tmp_path / "img", pg=REGISTER_BOTH + PG_NAMES)
    r = probe(tmp_path, double, SGLANG_PG[0], opts=["--level", "smoke"])
    assert r.rc == 1
    assert r.classification == "smoke-failed"
    assert "one-rank process group on mooncake-cpu failed" in r.lines[0]
    assert "test double: no transport" in r.lines[0]


def test_import_level_does_not_create_process_groups(tmp_path):
    # The same double is usable when only imports and registrations are checked.
    double = write_double(tmp_path / "img", pg=REGISTER_BOTH + PG_NAMES)
    r = probe(tmp_path, double, SGLANG_PG[0])
    assert r.rc == 0
    assert not any(c["name"].startswith("smoke") for c in r.report["checks"])


def test_a_library_the_loader_found_but_may_not_open_is_this_pods_not_the_images(tmp_path):
    """The loader's "cannot open shared object file: Permission denied": the library is
    there, and this pod's user (runAsUser) may not open it; as a missing library (scope
    image) it would have become a verdict for every tenant on the image."""
    said = "libibverbs.so.1: cannot open shared object file: Permission denied"
    double = write_double(tmp_path / "img", pg=f"raise ImportError({said!r})\n")
    r = probe(tmp_path, double, SGLANG_PG[0])
    assert r.rc == 1, r.stderr
    assert r.lines[0].startswith("epguard: mooncake elastic EP is unusable in this pod: "), (
        r.message
    )
    assert r.report["scope"] == "environment" and r.report["classification"] == "import-error"
    assert r.report["missing_libraries"] == [] and said in r.message
    # The same library absent is the image's.
    absent = "libibverbs.so.1: cannot open shared object file: No such file or directory"
    write_double(tmp_path / "img2", pg=f"raise ImportError({absent!r})\n")
    r = probe(tmp_path, tmp_path / "img2", SGLANG_PG[0])
    assert r.report["scope"] == "image" and "libibverbs.so.1" in r.report["missing_libraries"]


@pytest.mark.parametrize(
    ("symbol", "scope", "classification"),
    [
        ("cuMemGetHandleForAddressRange", "environment", "driver-too-old"),
        ("nvmlDeviceGetNvLinkRemoteDeviceType", "environment", "driver-too-old"),
        ("cudaStreamBeginCaptureToGraph", "image", "abi-mismatch"),  # libcudart: the image's
        ("_ZN3c1010TensorImpl6detachEv", "image", "abi-mismatch"),  # torch's: the image's
    ],
)
def test_an_undefined_driver_symbol_is_the_nodes_and_any_other_the_images(
    tmp_path, symbol, scope, classification
):
    """An old NVIDIA driver on one node pool lacks a cu* or nvml* symbol the build needs:
    no fact about the image (it would have refused the image for every tenant)."""
    said = f"/site/mooncake/libmooncake_pg.so: undefined symbol: {symbol}"
    double = write_double(tmp_path / "img", pg=f"raise ImportError({said!r})\n")
    r = probe(tmp_path, double, SGLANG_PG[0])
    assert r.rc == 1, r.stderr
    assert (r.report["scope"], r.report["classification"]) == (scope, classification), r.message


@pytest.mark.parametrize("there", [True, False], ids=["a file in the image", "absent"])
def test_a_library_the_loader_cannot_open_is_missing_only_when_the_image_lacks_it(tmp_path, there):
    """A library kept from the pod's user (mode 0600, runAsUser): the loader says "No
    such file or directory" of a file it may not read. The dependency walk finds the file
    in the image, so it is no missing library of the image (environment); absent, it is
    (image)."""
    from tests.probe.hostile_roots import elf_bytes

    double = write_double(tmp_path / "img", pg="raise ImportError({!r})\n".format(
        "libfoo.so.1: cannot open shared object file: No such file or directory"))  # fmt: skip
    (double / "mooncake" / "libmooncake_pg.so").write_bytes(elf_bytes(["libfoo.so.1"]))
    libs = tmp_path / "libs"
    libs.mkdir()
    if there:
        (libs / "libfoo.so.1").write_bytes(b"")
    env = clean_env([double, overlay(SGLANG_PG[0])], LD_LIBRARY_PATH=str(libs))
    r = run_probe(tmp_path, env=env)
    assert r.rc == 1, r.stderr
    if there:
        assert r.report["scope"] == "environment", r.message
        assert "libfoo.so.1" not in r.report["missing_libraries"]
    else:
        assert r.report["scope"] == "image", r.message
        assert r.report["missing_libraries"][0] == "libfoo.so.1"
