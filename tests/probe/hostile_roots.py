"""Crafted image roots for the probe's hostile-input tests and bench/probe_hostile_bench.py.

Each root is a directory put on PYTHONPATH, as the real-package tests compose images:
a fake ``torch`` (its ``version.py`` says 2.13.0+cu130, CUDA 13.0), a ``mooncake``
package laid out like mooncake-transfer-engine 0.3.13 (``pg.py`` loads
``mooncake.pg_<torch>``, whose ELF needs ``libcudart.so.12``, beside
``libmooncake_pg.so``) and SGLang 0.5.18's ``from mooncake.pg import
set_transfer_engine``. From its files alone the probe proves that image unusable
(``cuda-mismatch``: a CUDA 12 extension beside CUDA 13 torch). Each hostile variant
then changes one file: a malformed ELF, a FIFO, an oversized source, a huge PATH.

No real torch is needed: the fake one imports in milliseconds, so the probe's import
path (when the files do not decide) finishes quickly too.
"""

from __future__ import annotations

import importlib.machinery
import os
import struct
from collections.abc import Callable
from pathlib import Path

TORCH_VERSION = "2.13.0+cu130"
PG_LOADER = '''\
"""mooncake/pg.py as 0.3.9 - 0.3.13.post1 ship it (shape only)."""
import importlib

import torch

torch_version = torch.__version__.split("+")[0]
version_suffix = "_" + torch_version.replace(".", "_")
try:
    _pg = importlib.import_module("mooncake.pg" + version_suffix)
except ImportError as exc:
    raise ImportError(f"Mooncake PG was not built against torch=={torch_version}.") from exc
globals().update({k: getattr(_pg, k) for k in dir(_pg) if not k.startswith("__")})
'''
SGLANG_SOURCE = "srt/distributed/parallel_state.py"
SGLANG_TEXT = "def init():\n    from mooncake.pg import set_transfer_engine\n"
WORKER = ["python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "mooncake"]

# ELF64 little-endian layout of :func:`elf_bytes`.
_EHDR = 64
_PHDR = 56
_DYN = 16
DT_NEEDED, DT_STRTAB, DT_STRSZ = 1, 5, 10
PT_LOAD, PT_DYNAMIC = 1, 2


def elf_bytes(
    needed: list[str],
    *,
    strsz: int | None = None,
    strtab: bytes | None = None,
    offsets: list[int] | None = None,
    loads: int = 1,
    extra_dynamic: list[tuple[int, int]] | None = None,
) -> bytes:
    """A minimal ELF64 shared object: program headers (``loads`` PT_LOAD, one
    PT_DYNAMIC), a dynamic section (DT_STRTAB, DT_STRSZ, one DT_NEEDED per name, then
    ``extra_dynamic``) and its string table. ``strsz`` overrides DT_STRSZ, ``strtab``
    the string table bytes and ``offsets`` the DT_NEEDED offsets into it."""
    if strtab is None:
        strtab = b"\x00"
        offsets = []
        for name in needed:
            offsets.append(len(strtab))
            strtab += name.encode() + b"\x00"
    assert offsets is not None
    dyn_entries = [(DT_STRTAB, 0), (DT_STRSZ, len(strtab) if strsz is None else strsz)]
    dyn_entries += [(DT_NEEDED, off) for off in offsets]
    dyn_entries += extra_dynamic or []
    dyn_entries.append((0, 0))
    phnum = loads + 1
    dyn_off = _EHDR + _PHDR * phnum
    str_off = dyn_off + _DYN * len(dyn_entries)
    # DT_STRTAB is a virtual address: every PT_LOAD maps vaddr 0x10000 to str_off.
    vaddr = 0x10000
    dyn_entries[0] = (DT_STRTAB, vaddr)
    ehdr = b"\x7fELF" + bytes([2, 1, 1, 0]) + b"\x00" * 8
    ehdr += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, _EHDR, 0, 0, _EHDR, _PHDR, phnum,
                        64, 0, 0)
    phdrs = b"".join(
        struct.pack("<IIQQQQQQ", PT_LOAD, 4, str_off, vaddr, vaddr, len(strtab), len(strtab),
                    0x1000)
        for _ in range(loads)
    )
    dyn_size = _DYN * len(dyn_entries)
    phdrs += struct.pack("<IIQQQQQQ", PT_DYNAMIC, 6, dyn_off, 0, 0, dyn_size, dyn_size, 8)
    dyn = b"".join(struct.pack("<qQ", t, v) for t, v in dyn_entries)
    return ehdr + phdrs + dyn + strtab


def ext_suffix() -> str:
    """The compiled-module suffix of the interpreter that runs the probe in the tests."""
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def write_root(root: Path) -> Path:
    """The healthy-looking root the files prove unusable (cuda-mismatch)."""
    torch = root / "torch"
    torch.mkdir(parents=True)
    (torch / "__init__.py").write_text("from .version import __version__, cuda  # noqa\n")
    (torch / "version.py").write_text(f'__version__ = "{TORCH_VERSION}"\ncuda = "13.0"\n')
    info = root / "torch-2.13.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n\n")
    pkg = root / "mooncake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pg.py").write_text(PG_LOADER)
    (pkg / f"pg_2_13_0{ext_suffix()}").write_bytes(elf_bytes(["libcudart.so.12", "libc.so.6"]))
    (pkg / "libmooncake_pg.so").write_bytes(elf_bytes(["libc.so.6"]))
    info = root / "mooncake_transfer_engine-0.3.13.post1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: mooncake-transfer-engine\nVersion: 0.3.13.post1\n\n")
    sglang = root / "sglang"
    (sglang / "srt" / "distributed").mkdir(parents=True)
    (sglang / "__init__.py").write_text("")
    (sglang / SGLANG_SOURCE).write_text(SGLANG_TEXT)
    info = root / "sglang-0.5.18.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.18\n\n")
    return root


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def libpg(root: Path) -> Path:
    return root / "mooncake" / "libmooncake_pg.so"


# name -> what it does to a root made by write_root; the extra environment it needs.
Variant = Callable[[Path], dict[str, str]]


def _strsz(value: int) -> Variant:
    def make(root: Path) -> dict[str, str]:
        _replace(libpg(root), elf_bytes(["libc.so.6"], strsz=value))
        return {}
    return make


def _needed_no_nul(root: Path) -> dict[str, str]:
    # 400 DT_NEEDED into a 4 MiB string table without a NUL.
    table = b"A" * (4 << 20)
    _replace(libpg(root), elf_bytes([], strtab=table, offsets=[i * 16 for i in range(400)]))
    return {}


def _many_loads(root: Path) -> dict[str, str]:
    # 65,535 program headers (the format's most), 65,535 of them PT_LOAD, and one
    # DT_STRTAB per load: a reader that maps every DT_STRTAB through every PT_LOAD
    # does 4e9 steps.
    _replace(libpg(root), elf_bytes(
        ["libc.so.6"], loads=65534, extra_dynamic=[(DT_STRTAB, 0x10000)] * 65534))
    return {}


def _fifo_at(rel: str) -> Variant:
    def make(root: Path) -> dict[str, str]:
        _fifo(root / rel)
        return {}
    return make


def _big_sglang(root: Path) -> dict[str, str]:
    # A 4 MiB SGLang source: 100,000 aliases of mooncake.pg, each used once, then
    # 4 MiB of an import statement whose parenthesis never closes.
    src = root / "sglang" / SGLANG_SOURCE
    lines = [SGLANG_TEXT]
    lines += [f"from mooncake import pg as m{i}\n" for i in range(20_000)]
    lines += [f"m{i}.set_transfer_engine\n" for i in range(20_000)]
    body = "".join(lines)
    opener = "from mooncake.pg import (\n"
    body += opener * (((4 << 20) - len(body.encode())) // len(opener))
    src.write_text(body[: 4 << 20])
    return {}


def _big_loader(root: Path) -> dict[str, str]:
    # mooncake/pg.py of 1 MiB naming mooncake.pg_<torch> 18,000 times, no raise.
    line = 'importlib.import_module("mooncake.pg" + version_suffix)\n'
    (root / "mooncake" / "pg.py").write_text(
        PG_LOADER.split("try:")[0] + line * ((1 << 20) // len(line)))
    return {}


def short_names(n: int) -> list[str]:
    """``n`` distinct names of 1-4 characters: a process environment string is at most
    128 KiB (MAX_ARG_STRLEN), so a long search path in a pod has short entries."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    out: list[str] = []
    width = 1
    while len(out) < n:
        for i in range(len(alphabet) ** width):
            if len(out) >= n:
                break
            name, k = "", i
            for _ in range(width):
                name, k = alphabet[k % len(alphabet)] + name, k // len(alphabet)
            out.append(name)
        width += 1
    return out


def _ld_library_path(root: Path) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": ":".join(short_names(30_000))}


VARIANTS: dict[str, Variant] = {
    "elf DT_STRSZ 1 TiB": _strsz(1 << 40),
    "elf DT_STRSZ 2^64-1": _strsz((1 << 64) - 1),
    "elf 400 DT_NEEDED, 4 MiB strtab, no NUL": _needed_no_nul,
    "elf 65535 PT_LOAD": _many_loads,
    "fifo torch/version.py": _fifo_at("torch/version.py"),
    "fifo mooncake METADATA": _fifo_at("mooncake_transfer_engine-0.3.13.post1.dist-info/METADATA"),
    "fifo libmooncake_pg.so": _fifo_at("mooncake/libmooncake_pg.so"),
    "fifo sglang source": _fifo_at("sglang/" + SGLANG_SOURCE),
    "4 MiB sglang source, 20k aliases": _big_sglang,
    "1 MiB loader naming 18k modules": _big_loader,
    "30k-entry LD_LIBRARY_PATH": _ld_library_path,
}


def make(root: Path, variant: str | None) -> dict[str, str]:
    """Write the root (then the variant) and return the extra environment."""
    write_root(root)
    return VARIANTS[variant](root) if variant else {}
