"""The probe against real wheels from PyPI laid over real torch 2.13.0 (CUDA 13 build).

Each case is an image someone could build. Expected texts are the facts of the
wheels (domain-facts.md, Table 2) and of this OS: whether rdma-core and the NVIDIA
driver are present is asked of the dynamic loader here (ctypes), not assumed.
"""

from __future__ import annotations

import ctypes
import posixpath
import re
import shutil
import subprocess

import pytest

from tests.probe.probe_harness import (
    MTE_CUDA12,
    MTE_CUDA13,
    MTE_CUDA13_OLD,
    MTE_JIT,
    MTE_NON_CUDA,
    SGLANG_EP,
    SGLANG_PG,
    clean_env,
    overlay,
    run_probe,
)

pytestmark = pytest.mark.realpkg

UNUSABLE = "epguard: mooncake elastic EP is unusable in this image: "
UNUSABLE_HERE = "epguard: mooncake elastic EP is unusable in this pod: "
VERSIONS_RE = re.compile(r"^versions: torch=\S+ sglang=\S+( [a-z0-9-]+=\S+)+$")


def loads(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


# What libmooncake_pg.so needs from the OS / the container runtime, and whether the
# loader finds it on this machine.
SYSTEM_LIBS = ("libcuda.so.1", "libibverbs.so.1", "libmlx5.so.1", "libnuma.so.1", "libcurl.so.4")
ABSENT = {lib for lib in SYSTEM_LIBS if not loads(lib)}


def probe(tmp_path, *names, **kw):
    return run_probe(tmp_path, pythonpath=[overlay(n) for n in names], **kw)


def assert_contract(r, rc=1, here=False):
    """``here``: the cause is the pod's or the node's (said "in this pod"), not the image's."""
    assert r.rc == rc, r.stderr
    head = (
        (UNUSABLE_HERE if here else UNUSABLE) if rc else "epguard: mooncake elastic EP is usable: "
    )
    assert r.lines[0].startswith(head), r.message
    assert r.lines[-1].startswith("fix: ")
    assert sum(bool(VERSIONS_RE.match(line)) for line in r.lines) == 1, r.message
    assert len(r.message.encode()) <= 2048
    assert r.report["verdict"] == ("unusable" if rc else "usable")
    assert r.report["cause"] in r.lines[0]


# --- which module SGLang needs, from its real sources -------------------------------------


@pytest.mark.parametrize("sglang", SGLANG_EP + SGLANG_PG)
def test_requires_the_module_the_installed_sglang_imports(tmp_path, sglang):
    r = probe(tmp_path, MTE_CUDA13, sglang)
    version = sglang.split("-", 1)[1]
    expected = "mooncake.ep" if sglang in SGLANG_EP else "mooncake.pg"
    assert r.report["required_modules"] == [expected]
    assert r.report["versions"]["sglang"] == version
    assert f"sglang={version}" in r.message
    needs = next(line for line in r.lines if line.startswith("needs: "))
    assert needs.startswith(f"needs: {expected} (SGLang {version} imports {expected}")
    if sglang in SGLANG_PG:
        assert "set_transfer_engine" in needs
    else:
        assert "set_host_ip" in needs and "set_transfer_engine" not in needs


# --- CUDA 12 wheel over CUDA 13 torch -----------------------------------------------------


@pytest.mark.parametrize("sglang", [SGLANG_PG[0], SGLANG_EP[1]])
def test_names_libcudart_12_when_cuda12_wheel_meets_cuda13_torch(tmp_path, sglang):
    r = probe(tmp_path, MTE_CUDA12, sglang)
    assert_contract(r)
    assert r.classification == "cuda-mismatch"
    assert "libcudart.so.12" in r.report["missing_libraries"]
    assert (
        "built for CUDA 12 (needs libcudart.so.12) but torch 2.13.0+cu130 uses CUDA 13"
        in r.lines[0]
    )
    assert "mooncake-transfer-engine=0.3.13.post1" in r.message
    assert "install mooncake-transfer-engine-cuda13==0.3.13.post1" in r.lines[-1]


# --- CUDA 13 wheel on a node without the driver (and maybe without rdma-core) -------------


@pytest.mark.parametrize("sglang", [SGLANG_PG[0], SGLANG_EP[1]])
def test_names_every_missing_system_library_not_only_the_first(tmp_path, sglang):
    r = probe(tmp_path, MTE_CUDA13, sglang)
    if not ABSENT:
        pytest.skip("this machine has the driver and rdma-core: the wheel can load")
    # With rdma-core installed only the driver is missing: a cause of the node, not the
    # image (the expectation follows what this machine has).
    assert_contract(r, here={"libcuda.so.1"} == ABSENT)
    assert set(r.report["missing_libraries"]) == ABSENT
    for lib in ABSENT:
        assert lib in r.lines[0]
    expected = "no-driver" if {"libcuda.so.1"} == ABSENT else "missing-libraries"
    assert r.classification == expected
    assert ("nvidia.com/gpu" in r.lines[-1]) == ("libcuda.so.1" in ABSENT)
    assert ("libibverbs1" in r.lines[-1]) == bool(ABSENT & {"libibverbs.so.1", "libmlx5.so.1"})


def test_the_loader_error_alone_names_one_library_the_probe_names_all(tmp_path):
    r = probe(tmp_path, MTE_CUDA13, SGLANG_PG[0])
    if len(ABSENT) < 2:
        pytest.skip("needs at least two absent libraries to show the difference")
    error = next(line for line in r.lines if line.startswith("error (mooncake.pg): "))
    named_by_loader = [lib for lib in ABSENT if lib in error]
    assert len(named_by_loader) == 1
    assert len(r.report["missing_libraries"]) == len(ABSENT)


# --- wheel without an extension for this torch --------------------------------------------


@pytest.mark.parametrize(
    ("sglang", "said"),
    [
        (SGLANG_PG[0], "Mooncake PG was not built against torch==2.13.0."),
        (SGLANG_EP[1], "Mooncake EP was not built against torch==2.13.0."),
    ],
)
def test_names_torch_and_shipped_versions_when_no_extension_matches(tmp_path, sglang, said):
    r = probe(tmp_path, MTE_CUDA13_OLD, sglang)
    assert_contract(r)
    assert r.classification == "no-extension-for-torch"
    assert "has no PG extension for torch 2.13.0" in r.lines[0]
    assert "2.9.0, 2.9.1, 2.10.0" in r.lines[0]
    assert said in r.message
    assert "mooncake-transfer-engine-cuda13=0.3.10" in r.message
    assert "mooncake-transfer-engine-cuda13==0.3.13.post1" in r.lines[-1]


# --- the -non-cuda wheel ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sglang", "said"),
    [
        (SGLANG_PG[0], "Mooncake PG was not built against torch==2.13.0."),
        (SGLANG_EP[1], "Mooncake EP was not built. Please rebuild Mooncake with WITH_EP=ON."),
    ],
)
def test_recognises_the_non_cuda_wheel_that_ships_loaders_only(tmp_path, sglang, said):
    r = probe(tmp_path, MTE_NON_CUDA, sglang)
    assert_contract(r)
    assert r.classification == "non-cuda-wheel"
    assert "ships mooncake's loaders but no compiled PG extension" in r.lines[0]
    assert said in r.message
    assert "extensions: none" in r.lines
    assert (
        "install mooncake-transfer-engine-cuda13==0.3.13.post1 instead of "
        "mooncake-transfer-engine-non-cuda" in r.lines[-1]
    )


# --- 0.3.14's JIT loader ------------------------------------------------------------------


def test_reports_the_missing_jit_prerequisites_of_0_3_14(tmp_path):
    r = probe(tmp_path, MTE_JIT, SGLANG_PG[0])
    assert_contract(r)
    assert r.classification == "jit-prerequisites"
    assert "builds its PG torch adapter by JIT" in r.lines[0]
    assert "nvcc" in r.lines[0]
    assert "extensions: JIT adapter sources (0.3.14), no prebuilt pg_*" in r.lines
    assert "python -m mooncake.pg --prebuild" in r.lines[-1]


def _toolchain(root, ninja_says="ninja: build stopped: subcommand failed."):
    """An image's ninja and nvcc (stand-ins: shell scripts that give their version, as
    torch asks first, and fail any build; the real toolkit is 4 GB and the point is that
    the image *has* them)."""
    bin_dir, cuda = root / "bin", root / "cuda"
    (cuda / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    for path, said in ((bin_dir / "ninja", ninja_says), (cuda / "bin" / "nvcc", "nvcc fatal")):
        path.write_text(
            '#!/bin/sh\n[ "$1" = --version ] && { echo 1.11.1; exit 0; }\n'
            f"echo '{said}' >&2\nexit 1\n"
        )
        path.chmod(0o755)
    return bin_dir, cuda


@pytest.mark.parametrize(
    "case",
    ["no GPU and no TORCH_CUDA_ARCH_LIST", "a cache folder it cannot create", "the build fails"],
)
def test_a_jit_build_that_fails_where_the_image_has_ninja_and_nvcc_is_this_pods(tmp_path, case):
    """0.3.14 builds its adapter at import; in an image with ninja and nvcc, a failed build
    (no GPU, a read-only or foreign HOME, the compiler failing or killed) is the pod's or
    the node's: said "in this pod", never a cause of the image (a tenant's GPU-less pod
    would otherwise have taught every tenant that a working image is unusable)."""
    bin_dir, cuda = _toolchain(tmp_path / "tools")
    env = clean_env([overlay(MTE_JIT), overlay(SGLANG_PG[0])],
                    PATH=f"{bin_dir}:/usr/bin:/bin", CUDA_HOME=str(cuda),
                    CUDA_VISIBLE_DEVICES="", HOME=str(tmp_path / "home"))  # fmt: skip
    env.pop("TORCH_CUDA_ARCH_LIST", None)
    env.pop("MOONCAKE_PG_JIT_DIR", None)
    if case != "no GPU and no TORCH_CUDA_ARCH_LIST":
        env["TORCH_CUDA_ARCH_LIST"] = "9.0"
    if case == "a cache folder it cannot create":
        (tmp_path / "a-file").write_text("")
        env["HOME"] = str(tmp_path / "a-file" / "home")  # under a file: not even root can
    r = run_probe(tmp_path, env=env)
    assert_contract(r, here=True)
    assert r.classification == "jit-failed", r.message
    assert r.report["scope"] == "environment"
    assert "the build failed here although the image has ninja and nvcc" in r.lines[0]
    if case == "no GPU and no TORCH_CUDA_ARCH_LIST":
        assert "(missing: a visible GPU or TORCH_CUDA_ARCH_LIST)" in r.lines[0]
    else:
        assert "missing:" not in r.lines[0]
    assert "python -m mooncake.pg --prebuild" in r.lines[-1]


def _with_passwd(tmp_path, homes):
    """A command that runs its argv with ``/etc/passwd`` naming ``homes`` (in a mount
    namespace of its own: the host's file is untouched), as an image's would."""
    passwd = tmp_path / "passwd"
    lines = ["root:x:0:0:root:/root:/bin/sh"]
    lines += [f"user{i}:x:{1000 + i}:{1000 + i}::{h}:/bin/sh" for i, h in enumerate(homes)]
    passwd.write_text("\n".join(lines) + "\n")
    wrap = ["unshare", "--mount", "sh", "-c", f"mount --bind {passwd} /etc/passwd && exec \"$@\"",
            "sh"]  # fmt: skip
    try:
        ok = subprocess.run([*wrap, "true"], capture_output=True, timeout=30).returncode == 0
    except OSError:
        ok = False
    if not ok:
        pytest.skip("needs unshare --mount and mount --bind (root)")
    return wrap


@pytest.mark.parametrize("jit_dir", [None, "~/.mooncake-jit"], ids=["default cache", "~ dir"])
@pytest.mark.parametrize("adapter", [True, False], ids=["adapter built", "no adapter"])
def test_a_prebuilt_adapter_in_another_users_home_makes_a_missing_toolchain_this_pods(
    tmp_path, adapter, jit_dir
):
    """0.3.14 loads a prebuilt adapter from ``$HOME/.cache/mooncake/pg_jit`` (or
    MOONCAKE_PG_JIT_DIR), so an image built as one user may hold it under that user's
    HOME: a pod run as another user (runAsUser, another HOME) then cannot build it
    without ninja and nvcc, but the image works for the user it was built for. Said "in
    this pod", never a cause of the image (which would refuse every tenant's pods);
    with no adapter anywhere, the missing toolchain stays the image's. The image's
    ``MOONCAKE_PG_JIT_DIR=~/…`` is under each user's HOME too (mooncake expands it)."""
    other = tmp_path / "builder-home"
    cache = other / jit_dir[2:] if jit_dir else other / ".cache" / "mooncake" / "pg_jit"
    keyed = cache / "0123456789abcdef0123"
    keyed.mkdir(parents=True)
    if adapter:
        built = keyed / "_mooncake_pg_jit_cuda.cpython-311-x86_64-linux-gnu.so"
        built.write_bytes(b"\x7fELF" + bytes(124))
    env = clean_env([overlay(MTE_JIT), overlay(SGLANG_PG[0])], PATH="/usr/bin:/bin",
                    HOME=str(tmp_path / "pod-home"))  # fmt: skip
    for name in ("MOONCAKE_PG_JIT_DIR", "CUDA_HOME", "CUDA_PATH"):
        env.pop(name, None)
    if jit_dir:
        env["MOONCAKE_PG_JIT_DIR"] = jit_dir
    if shutil.which("nvcc", path=env["PATH"]) and shutil.which("ninja", path=env["PATH"]):
        pytest.skip("this host has ninja and nvcc on /usr/bin: the toolchain is not missing")
    if not adapter:
        # The probe also looks under / and root's HOME, on this host: a machine where
        # mooncake once built its adapter as root holds one there, and no absence holds.
        from epguard.probe import inventory

        here, _ = inventory.prebuilt_adapter(
            [posixpath.join(h, *(jit_dir[2:].split("/") if jit_dir else
                                 inventory.JIT_CACHE_UNDER_HOME)) for h in ("/", "/root")]
        )  # fmt: skip
        if here is not None:
            pytest.skip(f"this host holds a prebuilt adapter ({here})")
    r = run_probe(tmp_path, env=env, wrap=_with_passwd(tmp_path, [str(other)]))
    assert r.classification == "jit-prerequisites", r.message
    if adapter:
        assert_contract(r, here=True)
        assert r.report["scope"] == "environment"
        # The probe writes paths under its working folder (tmp_path) as $PWD.
        said = str(built).replace(str(tmp_path), "$PWD")
        assert f"the image holds a prebuilt JIT adapter, '{said}'" in r.message, r.message
        where = str(cache).replace(str(tmp_path), "$PWD")
        assert f"set MOONCAKE_PG_JIT_DIR to '{where}'" in r.lines[-1]
    else:
        assert_contract(r)
        assert r.report["scope"] == "image"


# --- nothing installed --------------------------------------------------------------------


def test_says_mooncake_none_when_no_mooncake_is_installed(tmp_path):
    r = probe(tmp_path, SGLANG_PG[1])
    assert_contract(r)
    assert r.classification == "mooncake-not-installed"
    assert "mooncake=none" in r.message
    assert r.report["versions"]["mooncake"] == "none"
    assert "mooncake-transfer-engine-cuda13==0.3.13.post1" in r.lines[-1]


def test_without_sglang_either_module_is_tried(tmp_path):
    r = probe(tmp_path, MTE_CUDA13_OLD)
    assert_contract(r)
    assert r.report["required_modules"] == ["mooncake.pg", "mooncake.ep"]
    assert "sglang=none" in r.message
    tried = {c["name"] for c in r.report["checks"] if c["name"].startswith("import ")}
    assert tried == {"import mooncake.pg", "import mooncake.ep"}


# --- facts beside the failure -------------------------------------------------------------


def test_records_torch_and_cuda_facts_beside_a_failed_import(tmp_path):
    # --no-static: the files alone prove this cause, and the probe would stop before torch.
    r = probe(tmp_path, MTE_CUDA13_OLD, SGLANG_PG[0], opts=["--no-static"])
    checks = {c["name"]: c for c in r.report["checks"]}
    assert checks["torch"]["ok"] and checks["torch"]["detail"].startswith("2.13.0+cu130 (CUDA 13")
    assert checks["import mooncake.pg"]["ok"] is False
    assert "backends" not in checks  # never reached: nothing registered anything
    assert checks["cuda"]["detail"] == "available=no devices=0"


def test_warns_that_0_3_14_no_longer_serves_sglang_that_imports_mooncake_ep(tmp_path):
    # F10: 0.3.14's ep.py imports only the torch-independent _ep; SGLang <= 0.5.16
    # would find no PG there even once the libraries are installed.
    r = probe(tmp_path, MTE_JIT, SGLANG_EP[1])
    assert_contract(r)
    assert r.report["required_modules"] == ["mooncake.ep"]
    assert "pin mooncake <= 0.3.13.post1" in r.lines[-1]


# --- the worker's interpreter settings are not facts about the image ---------------------


def test_interpreter_variables_copied_from_the_worker_do_not_change_the_diagnosis(tmp_path):
    # Both once made the genuine probe report "torch does not import" in a good image;
    # the check now runs without them, says so, and still finds the image's real fault.
    env = clean_env([overlay(MTE_CUDA12), overlay(SGLANG_PG[0])])
    env.update(TORCH_LOGS="not_a_component", PYTHONWARNINGS="error")
    r = run_probe(tmp_path, env=env)
    assert_contract(r)
    assert r.classification == "cuda-mismatch"
    assert r.report["scope"] == "image"
    [said] = [line for line in r.lines if line.startswith("environment: checked without ")]
    assert "PYTHONWARNINGS" in said and "TORCH_LOGS" in said
    assert {"PYTHONWARNINGS", "TORCH_LOGS"} <= set(r.report["checked_without"])
