"""Where 0.3.14 may find a prebuilt JIT adapter for any user of an image
(probe/inventory.py): read before a missing toolchain is called the image's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from epguard.probe import inventory
from tests.probe.probe_harness import PROBE_DIR


class Passwd:
    """The one file jit_cache_roots reads, as an image's would hold it."""

    def __init__(self, text: str | None, there: bool = False) -> None:
        self.text = text
        self.there = there or text is not None

    def read_text(self, path: str, limit: int) -> str | None:
        assert path == "/etc/passwd" and limit == inventory.MAX_PASSWD_BYTES
        return self.text

    def exists(self, path: str) -> bool:
        assert path == "/etc/passwd"
        return self.there


def test_every_users_default_cache_and_every_jit_dir_is_a_place_to_look() -> None:
    passwd = Passwd(
        "root:x:0:0:root:/root:/bin/sh\n"
        "builder:x:1000:1000::/home/builder:/bin/sh\n"
        "broken line without fields\n"
        "svc:x:1001:1001::/srv/svc:/bin/sh\n"
    )
    image = {"HOME": "/data/home", "MOONCAKE_PG_JIT_DIR": "/opt/adapter/"}
    worker = {"HOME": "/data/home", "MOONCAKE_PG_JIT_DIR": "~//jit"}  # ~: every HOME's
    roots, undecided = inventory.jit_cache_roots([image, worker], passwd)
    assert undecided is None
    assert roots == [
        "/opt/adapter",
        "/data/home/jit",
        "/jit",  # HOME is / for a uid /etc/passwd does not name
        "/root/jit",
        "/home/builder/jit",
        "/srv/svc/jit",
        "/data/home/.cache/mooncake/pg_jit",
        "/.cache/mooncake/pg_jit",
        "/root/.cache/mooncake/pg_jit",
        "/home/builder/.cache/mooncake/pg_jit",
        "/srv/svc/.cache/mooncake/pg_jit",
    ]
    # An unreadable passwd still leaves the environments' places, /'s and root's.
    assert inventory.jit_cache_roots([image], Passwd(None)) == (
        ["/opt/adapter", "/data/home/.cache/mooncake/pg_jit", "/.cache/mooncake/pg_jit",
         "/root/.cache/mooncake/pg_jit"],
        None,
    )  # fmt: skip


@pytest.mark.parametrize("value", ["jit", "./jit", "~builder/jit"])
def test_a_jit_dir_the_working_folder_or_a_named_user_decides_is_undecided(value: str) -> None:
    """mooncake takes MOONCAKE_PG_JIT_DIR through Path.expanduser(), relative to the
    working folder (the pod's workingDir): no list of users says where that is."""
    _, undecided = inventory.jit_cache_roots([{"MOONCAKE_PG_JIT_DIR": value}], Passwd(None))
    assert undecided == f"MOONCAKE_PG_JIT_DIR {value!r} is relative or ~name"


@pytest.mark.parametrize("users", [200, 5000])
def test_a_list_cut_short_is_undecided(users: int) -> None:
    """Past MAX_HOMES places (users, or ~/x under each of them), the place not looked
    at may hold the adapter: no absence is proven."""
    many = "".join(f"u{i}:x:{i}:{i}::/home/u{i}:/bin/sh\n" for i in range(users))
    roots, undecided = inventory.jit_cache_roots([{"MOONCAKE_PG_JIT_DIR": "~/zz"}], Passwd(many))
    assert len(roots) == inventory.MAX_HOMES
    assert undecided is not None and undecided.startswith("more than 256")


@pytest.mark.parametrize(
    ("passwd", "environ"),
    [
        (Passwd(None, there=True), {}),  # there, not read whole (over 1 MiB, or refused)
        (Passwd("svc:x:1:1::relative/home:/bin/sh\n"), {}),
        (Passwd(None), {"HOME": "home"}),
    ],
)
def test_homes_no_one_can_list_are_undecided(passwd: Passwd, environ: dict[str, str]) -> None:
    _, undecided = inventory.jit_cache_roots([environ], passwd)
    assert undecided is not None


def test_an_adapter_is_an_elf_file_under_a_key_folder(tmp_path: Path) -> None:
    root = tmp_path / "pg_jit"
    key = root / "0123456789abcdef0123"
    key.mkdir(parents=True)
    assert inventory.prebuilt_adapter([str(tmp_path / "absent"), str(root)]) == (None, None)
    name = "_mooncake_pg_jit_cuda.cpython-311-x86_64-linux-gnu.so"
    (key / name).write_bytes(b"not an ELF file")  # a build killed before it wrote
    os.mkfifo(key / "_mooncake_pg_jit_musa.so")  # must not block the probe
    (key / "lock").write_text("")
    assert inventory.prebuilt_adapter([str(root)]) == (None, None)
    (key / name).write_bytes(b"\x7fELF" + bytes(60))
    assert inventory.prebuilt_adapter([str(root)]) == (str(key / name), None)
    # Directly in the cache root (no key folder) is not where mooncake looks.
    (key / name).unlink()
    (root / name).write_bytes(b"\x7fELF" + bytes(60))
    assert inventory.prebuilt_adapter([str(root)]) == (None, None)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize(
    "hide", ["key folder", "key folder listed, not searched", "adapter", "key linked behind"]
)
def test_an_adapter_hidden_from_this_user_is_said_hidden(hide: str) -> None:
    """As uid 65534 (a pod's runAsUser): a key folder it may not list, or an adapter it
    may not read (an image built with a tight umask), hides the adapter from this user's
    mooncake too, not from root's; said hidden, never "no adapter"."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs a system python3 that any uid can run")
    # Not under tmp_path: pytest's own directories are root-only.
    base = Path(tempfile.mkdtemp(prefix="epguard-jit-", dir="/tmp"))
    try:
        base.chmod(0o755)
        for module in ("inventory.py", "elf.py", "files.py"):
            shutil.copy(PROBE_DIR / module, base / module)
            (base / module).chmod(0o644)
        key = base / "pg_jit" / "0123456789abcdef0123"
        key.mkdir(parents=True)
        adapter = key / "_mooncake_pg_jit_cuda.so"
        adapter.write_bytes(b"\x7fELF" + bytes(60))
        for folder in (base / "pg_jit", key):
            folder.chmod(0o755)
        adapter.chmod(0o644)
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import inventory; "
                "print(json.dumps(inventory.prebuilt_adapter([sys.argv[2]])))")  # fmt: skip

        def as_nobody() -> list[str | None]:
            r = subprocess.run(
                ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", python,
                 "-I", "-c", code, str(base), str(base / "pg_jit")],
                capture_output=True, text=True, timeout=60, cwd="/tmp",
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
            found: list[str | None] = json.loads(r.stdout)
            return found

        assert as_nobody() == [str(adapter), None]
        hidden = adapter if hide == "adapter" else key
        if hide == "key linked behind":
            # The key is a link into a folder this user may not search.
            behind = base / "private"
            behind.mkdir(mode=0o700)
            shutil.move(key, behind / key.name)
            key.symlink_to(behind / key.name)
        else:
            hidden.chmod({"key folder": 0o700, "adapter": 0o600}.get(hide, 0o744))
        assert as_nobody() == [None, str(hidden)]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_runtimes_home_for_a_uid_is_its_passwd_entrys() -> None:
    passwd = Passwd("root:x:0:0:root:/root:/bin/sh\nbuilder:x:1000:1000::/home/builder:/bin/sh\n")
    assert inventory.passwd_home(1000, passwd) == "/home/builder"
    assert inventory.passwd_home(0, passwd) == "/root"
    assert inventory.passwd_home(4242, passwd) is None  # the runtime's HOME is then /
    assert inventory.passwd_home(0, Passwd(None)) is None
