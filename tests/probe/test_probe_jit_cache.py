"""Where 0.3.14 may find a prebuilt JIT adapter for any user of an image
(probe/inventory.py): read before a missing toolchain is called the image's."""

from __future__ import annotations

import os
from pathlib import Path

from epguard.probe import inventory


class Passwd:
    """The one file jit_cache_roots reads, as an image's would hold it."""

    def __init__(self, text: str | None) -> None:
        self.text = text

    def read_text(self, path: str, limit: int) -> str | None:
        assert path == "/etc/passwd" and limit == inventory.MAX_PASSWD_BYTES
        return self.text


def test_every_users_default_cache_and_every_jit_dir_is_a_place_to_look() -> None:
    passwd = Passwd(
        "root:x:0:0:root:/root:/bin/sh\n"
        "builder:x:1000:1000::/home/builder:/bin/sh\n"
        "broken line without fields\n"
        "svc:x:1001:1001::relative/home:/bin/sh\n"
    )
    image = {"HOME": "/", "MOONCAKE_PG_JIT_DIR": "/opt/adapter/"}
    worker = {"HOME": "/data/home", "MOONCAKE_PG_JIT_DIR": "cache"}  # relative: no place
    roots = inventory.jit_cache_roots([image, worker], passwd)
    assert roots == [
        "/opt/adapter",
        "/.cache/mooncake/pg_jit",
        "/data/home/.cache/mooncake/pg_jit",
        "/root/.cache/mooncake/pg_jit",
        "/home/builder/.cache/mooncake/pg_jit",
    ]
    # An unreadable passwd still leaves the environments' places and root's.
    assert inventory.jit_cache_roots([image], Passwd(None)) == [
        "/opt/adapter",
        "/.cache/mooncake/pg_jit",
        "/root/.cache/mooncake/pg_jit",
    ]


def test_a_huge_passwd_gives_a_bounded_list() -> None:
    many = "".join(f"u{i}:x:{i}:{i}::/home/u{i}:/bin/sh\n" for i in range(5000))
    roots = inventory.jit_cache_roots([{}], Passwd(many))
    assert len(roots) == inventory.MAX_HOMES
    assert roots[0] == "/root/.cache/mooncake/pg_jit"


def test_an_adapter_is_an_elf_file_under_a_key_folder(tmp_path: Path) -> None:
    root = tmp_path / "pg_jit"
    key = root / "0123456789abcdef0123"
    key.mkdir(parents=True)
    assert inventory.prebuilt_adapter([str(tmp_path / "absent"), str(root)]) is None
    name = "_mooncake_pg_jit_cuda.cpython-311-x86_64-linux-gnu.so"
    (key / name).write_bytes(b"not an ELF file")  # a build killed before it wrote
    os.mkfifo(key / "_mooncake_pg_jit_musa.so")  # must not block the probe
    (key / "lock").write_text("")
    assert inventory.prebuilt_adapter([str(root)]) is None
    (key / name).write_bytes(b"\x7fELF" + bytes(60))
    assert inventory.prebuilt_adapter([str(root)]) == str(key / name)
    # Directly in the cache root (no key folder) is not where mooncake looks.
    (key / name).unlink()
    (root / name).write_bytes(b"\x7fELF" + bytes(60))
    assert inventory.prebuilt_adapter([str(root)]) is None
