"""probe/access.py as the uid a pod chose: what it reports refused (a package may be
hidden from this user, so no failure is the image's) and what it must not (what the
import does not need, or what is the same for every user). Run as uid 65534 through
setpriv, on a tree root owns; probe/access.py needs nothing but the standard library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.probe.probe_harness import PROBE_DIR

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"),
]


@pytest.fixture
def site() -> Iterator[Path]:
    # Not under tmp_path: pytest's own directories are root-only.
    base = Path(tempfile.mkdtemp(prefix="epguard-access-", dir="/tmp"))
    base.chmod(0o755)
    root = base / "site"
    for folder in ("mooncake", "mooncake/__pycache__", "torch/lib", "mooncake-0.3.dist-info"):
        (root / folder).mkdir(parents=True)
    for f in (
        "mooncake/__init__.py",
        "mooncake/pg.py",
        "torch/__init__.py",
        "torch/lib/libtorch.so.2",
        "mooncake-0.3.dist-info/METADATA",
        "mooncake-0.3.dist-info/RECORD",
        "mooncake/__pycache__/pg.cpython-311.pyc",
    ):
        (root / f).write_text("x")  # fmt: skip
    for module in ("access.py", "elf.py"):
        shutil.copy(PROBE_DIR / module, base / module)
    for p in (base / "access.py", base / "elf.py", root, *root.rglob("*")):
        p.chmod(0o755 if p.is_dir() else 0o644)
    yield root
    shutil.rmtree(base, ignore_errors=True)


def refused_as_nobody(
    root: Path, environ: dict[str, str] | None = None, deep: bool = True
) -> str | None:
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs a system python3 that any uid can run")
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import access; "
        "print(json.dumps(access.refused([sys.argv[2]], json.loads(sys.argv[3]), "
        "deep=sys.argv[4] == 'deep')[0]))"
    )
    r = subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-I",
         "-c", code, str(root.parent), str(root), json.dumps(environ or {}),
         "deep" if deep else "shallow"],
        capture_output=True, text=True, timeout=60, cwd="/tmp",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    found: str | None = json.loads(r.stdout)
    return found


Change = Callable[[Path], None]


def _root_only_pth(root: Path) -> None:
    (root / "x.pth").write_text("extra\n")
    (root / "x.pth").chmod(0o600)


def _link_to_root_only(root: Path) -> None:
    private = Path(str(root) + "-private")
    private.mkdir(mode=0o700)
    (root / "torch/private").symlink_to(private)


REFUSED: dict[str, tuple[Change, str]] = {
    "package folder": (lambda r: (r / "mooncake").chmod(0o700), "mooncake"),
    "a module": (lambda r: (r / "mooncake/pg.py").chmod(0o600), "mooncake/pg.py"),
    "a library": (lambda r: (r / "torch/lib/libtorch.so.2").chmod(0o600), "libtorch.so.2"),
    "a deeper folder": (lambda r: (r / "torch/lib").chmod(0o700), "torch/lib"),
    "METADATA": (lambda r: (r / "mooncake-0.3.dist-info/METADATA").chmod(0o600), "METADATA"),
    "a .pth": (_root_only_pth, "x.pth"),
    "a link to a root-only folder": (_link_to_root_only, "torch/private"),
}
NOT_REFUSED: dict[str, Change] = {
    "nothing changed": lambda r: None,
    "a root-only __pycache__": lambda r: (r / "mooncake/__pycache__").chmod(0o700),
    "a root-only RECORD": lambda r: (r / "mooncake-0.3.dist-info/RECORD").chmod(0o600),
    "a .pth that points nowhere": lambda r: (r / "gone.pth").symlink_to(r / "no-such"),
    "an unrelated root-only package": lambda r: (r / "other").mkdir(mode=0o700),
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_what_could_hide_a_package_is_reported(site: Path, case: str) -> None:
    change, said = REFUSED[case]
    change(site)
    found = refused_as_nobody(site)
    assert found is not None and found.endswith(said), found


@pytest.mark.parametrize("case", list(NOT_REFUSED), ids=list(NOT_REFUSED))
def test_what_the_import_does_not_need_is_not(site: Path, case: str) -> None:
    NOT_REFUSED[case](site)
    assert refused_as_nobody(site) is None


def test_a_home_the_user_cannot_enter_counts_unless_no_user_site_is_read(site: Path) -> None:
    home = Path(tempfile.mkdtemp(prefix="epguard-home-", dir="/tmp"))
    try:
        home.chmod(0o700)
        found = refused_as_nobody(site, {"HOME": str(home)})
        assert found is not None and found.startswith(f"{home}/.local/lib/python")
        assert refused_as_nobody(site, {"HOME": str(home), "PYTHONNOUSERSITE": "1"}) is None
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_after_a_reading_of_the_files_only_the_package_folders_are_looked_at(
    site: Path,
) -> None:
    # The reading (static.py) notes every refusal it meets itself; what it did not read
    # need not be walked file by file (a CUDA torch is ~16,000 entries).
    (site / "mooncake/pg.py").chmod(0o600)
    assert refused_as_nobody(site, deep=False) is None
    assert str(refused_as_nobody(site)).endswith("mooncake/pg.py")
    (site / "torch").chmod(0o700)
    assert str(refused_as_nobody(site, deep=False)).endswith("/torch")


def test_a_library_folder_the_user_cannot_search_is_reported(site: Path) -> None:
    """refused_folder over the loader's search path, as uid 65534: a root-only folder is
    reported (a library in it is missing for this user alone); a folder anyone may
    search, or one that does not exist, is not."""
    libs = site.parent / "libs"
    libs.mkdir(mode=0o755)
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs a system python3 that any uid can run")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import access; "
            "print(json.dumps(access.refused_folder(sys.argv[2:])))")  # fmt: skip

    def refused(*folders: str) -> str | None:
        r = subprocess.run(
            ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", python,
             "-I", "-c", code, str(site.parent), *folders],
            capture_output=True, text=True, timeout=60, cwd="/tmp",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        found: str | None = json.loads(r.stdout)
        return found

    assert refused("", "/no/such/folder", str(libs), "/usr/lib") is None
    libs.chmod(0o700)
    assert refused("/usr/lib", str(libs)) == str(libs)
    (libs / "inner").mkdir()
    assert refused(str(libs / "inner")) == str(libs / "inner")  # not even stat-able


def test_a_pth_that_is_a_fifo_or_names_a_million_folders_is_read_in_bounds(
    tmp_path: Path,
) -> None:
    """Found by a review helper: a FIFO named ``zz.pth`` (site never reads a PYTHONPATH
    folder's .pth, so the worker starts) held the probe until its outer deadline, 16
    times --timeout; 40 .pth files of 512k lines each took 133 s of stat calls."""
    site = tmp_path / "site"
    site.mkdir()
    os.mkfifo(site / "zz.pth")
    (site / "many.pth").write_text("".join(f"d{i}\n" for i in range(300_000)))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import access; "
        "print(access.refused([sys.argv[2]], {}, budget=50_000))"
    )
    r = subprocess.run([sys.executable, "-I", "-c", code, str(PROBE_DIR), str(site)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    # Root is refused nothing; the folders named were charged to the walk, which was cut.
    assert r.stdout.strip() == "(None, True)", r.stdout
