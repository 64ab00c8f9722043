"""Hostile archives (issue 21, points 7, 8, 9 and 11): each ends in bounded time and
memory, with exit 2 and one line where it cannot be judged, and never a traceback.

Every case runs the real command in a child process with a wall-clock limit and an
address-space limit (RLIMIT_AS), so that a regression to the old behaviour (a loop
that never ends, memory that grows until OOM) fails the test instead of hanging it
or the machine. The archives are small, built here from crafted bytes
(tests/scan/hostile.py). The figures at the audit's sizes (seconds, peak RSS, exit,
before and after) are printed by bench/scan_hostile_bench.py.
"""

from __future__ import annotations

import io
import resource
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from epguard.probe import cmdline, files, static
from epguard.webhook import command
from epguard.webhook.scan import scanner, tarstream, tree
from tests.scan import hostile
from tests.scan.scan_harness import EPGUARD, Scan

pytestmark = pytest.mark.timeout(300)

GiB = 1 << 30
NO_REQUEST = ("--argv", "python3", "-c", "pass")  # judge the files, ask for nothing


def limited(image: Path, *args: str, seconds: float = 60, memory: int = GiB) -> Scan:
    """`epguard scan` under a deadline and an address-space limit."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    proc = subprocess.run([str(EPGUARD), "scan", str(image), *args], capture_output=True,
                          text=True, timeout=seconds, preexec_fn=limit)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return Scan(proc.returncode, proc.stdout, proc.stderr)


def _bad_input(r: Scan, *said: str) -> None:
    assert r.rc == 2, (r.rc, r.stdout[-500:], r.stderr[-500:])
    assert r.stderr.startswith("epguard: cannot scan: ") and r.stderr.count("\n") == 1
    for s in said:
        assert s in r.stderr


# --- point 7: negative sizes ------------------------------------------------------------

def test_a_negative_pax_size_in_a_layer_is_refused_not_read_forever(tmp_path):
    r = limited(hostile.one_layer(tmp_path, hostile.pax_negative_size_tar()), seconds=30)
    _bad_input(r, "layer 0", "the PAX size", "not a non-negative decimal number")


def test_a_negative_base256_size_in_a_layer_is_refused_not_read_forever(tmp_path):
    r = limited(hostile.one_layer(tmp_path, hostile.base256_negative_size_tar()), seconds=30)
    _bad_input(r, "layer 0", "is negative (base-256)")


@pytest.mark.parametrize("member", ["pax", "base256"])
def test_a_negative_size_in_the_outer_archive_is_refused_without_growing_memory(
        tmp_path, member):
    tar = (hostile.pax_negative_size_tar() if member == "pax"
           else hostile.base256_negative_size_tar())
    r = limited(hostile.outer_archive_with(tmp_path, tar), seconds=30, memory=GiB // 2)
    _bad_input(r, "not a tar archive")


def test_a_pax_header_that_makes_tarfile_backtrack_is_refused_in_linear_time(tmp_path):
    # 512 KiB of records with no '=' but one at the end: quadratic in d5affd9's regex.
    r = limited(hostile.one_layer(tmp_path, hostile.backtracking_pax_tar(512 << 10)),
                seconds=30)
    _bad_input(r, "a PAX record without '='")


# --- the budgets: wall clock and decompressed bytes ------------------------------------

def test_a_zstd_bomb_listed_twenty_times_ends_at_the_decompressed_bytes_budget(tmp_path):
    # A 512 KB frame inflating to 16 GiB, as 20 layers: 320 GiB to read.
    layout = hostile.zstd_bomb_layout(tmp_path, 16 * GiB, 20)
    r = limited(layout, "--max-bytes", "1G", seconds=120)
    _bad_input(r, f"more than {GiB} bytes of tar (decompressed)", "--max-bytes")


def test_the_whole_scan_ends_at_its_timeout(tmp_path):
    layout = hostile.zstd_bomb_layout(tmp_path, 16 * GiB, 20)
    r = limited(layout, "--timeout", "2", "--max-bytes", "1T", seconds=60)
    _bad_input(r, "the scan took more than 2 s", "--timeout")


def test_the_budget_counts_every_byte_read_out_of_a_layer():
    data = hostile.regular(b"etc/a", b"x" * 5000) + hostile.END
    budget = tarstream.Budget(max_bytes=1 << 20)
    reader = tarstream.TarReader(io.BytesIO(data), budget, seekable=False)
    assert [e.name for e in reader] == ["etc/a"]
    assert budget.used == len(data) - len(hostile.END) + tarstream.BLOCK


# --- point 8: sizes checked before they are read; names and notes charged --------------

def test_a_pax_header_over_its_limit_is_refused_before_it_is_read(tmp_path):
    # 1 GiB of PAX header, gzip-compressed to a few MB: refused on its size field.
    layer = hostile.huge_pax_header_layer(GiB)
    r = limited(hostile.one_layer(tmp_path, layer, "gzip"), seconds=60, memory=GiB)
    _bad_input(r, f"a PAX header of {GiB} bytes", f"over the {tarstream.MAX_PAX_BYTES} read")


def test_a_gnu_long_name_over_path_max_is_refused_before_it_is_read(tmp_path):
    layer = hostile.huge_long_name_layer(512 << 20)
    r = limited(hostile.one_layer(tmp_path, layer, "gzip"), seconds=60, memory=GiB // 2)
    _bad_input(r, f"a GNU long name of {512 << 20} bytes",
               f"over the {tarstream.MAX_LONGNAME_BYTES} read")


def test_a_run_of_pax_headers_keeps_only_the_records_the_scan_reads(tmp_path):
    # 3,000 PAX headers of 100 KB each before one member: 300 MB of records.
    layer = hostile.pax_run_layer(3000, 100_000)
    r = limited(hostile.one_layer(tmp_path, layer, "gzip"), "--json", *NO_REQUEST,
                seconds=60, memory=GiB // 2)
    assert r.rc == 0, r.stderr
    assert r.doc["entries"] == 2  # /etc and /etc/a


def test_names_are_charged_to_the_tree_budget(tmp_path, monkeypatch):
    # 2,000 names of 4,000 bytes: ~8 MB of names, over a 4 MiB budget.
    monkeypatch.setattr(tree, "MAX_TREE_BYTES", 4 << 20)
    layer = hostile.many_long_names_layer(2000, 4000)
    layout = hostile.one_layer(tmp_path, layer, "gzip")
    with pytest.raises(scanner.ScanError, match="names, link targets and nodes take more "
                                                "than 4 MiB"):
        scanner.scan(str(layout))


def test_link_targets_are_charged_to_the_tree_budget():
    t = tree.Tree()
    target = "x/" * 1000
    for i in range(100):
        t.apply(tarstream.Entry(f"l{i}", b"2", 0, target), None, 0)
    assert t.tree_bytes >= 100 * len(target)


def test_notes_are_capped_in_the_report(tmp_path):
    # 1,000 sparse libraries, each claiming 1 TiB: each one a note, never expanded.
    layer = hostile.sparse_members_layer(1000, 1 << 40)
    r = limited(hostile.one_layer(tmp_path, layer, "gzip"), "--json", *NO_REQUEST,
                seconds=60)
    assert r.rc == 0, r.stderr
    notes = r.doc["notes"]
    assert len(notes) == tree.MAX_NOTES + 1
    assert "nothing to check" in notes[0]  # the scan's own note comes first
    assert "/usr/lib/lib0.so: a sparse file in the layer; its contents are not read" \
        in notes[1]
    assert notes[-1] == "901 more notes not shown"
    assert len(r.stdout) < 256 * 1024


# --- point 9: linear in what the image claims ------------------------------------------

def test_a_symlink_target_over_path_max_is_refused(tmp_path):
    r = limited(hostile.one_layer(tmp_path, hostile.long_symlink_tar(100_000)), seconds=30)
    _bad_input(r, "link target of 100000 bytes", "over PATH_MAX (4096)")


def test_an_image_config_path_of_100k_entries_is_searched_once_each(tmp_path):
    site = "usr/local/lib/python3.11/dist-packages"
    tar = hostile.tar_of([(f"{site}/torch/__init__.py", b""), ("opt/d5/x", b"")])
    layout = hostile.one_layer(tmp_path, tar, config=hostile.long_path_config(100_000))
    r = limited(layout, "--json", seconds=60)
    assert r.rc == 0, r.stderr  # torch's version unreadable: left to a pod
    # PYTHONPATH: only the entry that exists in the image, then the site directory.
    assert r.doc["site"] == ["/opt/d5", "/" + site]
    assert len(r.stdout) < 256 * 1024


# --- point 11: no crash is exit 1 -------------------------------------------------------

def test_a_deep_directory_under_an_opaque_whiteout_does_not_crash(tmp_path):
    r = limited(hostile.deep_whiteout_layers(tmp_path, 2000), "--json", *NO_REQUEST,
                seconds=60)
    assert r.rc == 0, r.stderr
    assert r.doc["entries"] >= 2000


def test_names_that_are_not_utf8_are_printed_escaped(tmp_path):
    r = limited(hostile.one_layer(tmp_path, hostile.non_utf8_names_tar()), *NO_REQUEST,
                seconds=60)
    assert r.rc == 0, r.stderr
    assert "mooncake/\\xff\\xfe.py: 1048586 bytes; only the first 1048576 read" in r.stdout


def test_an_elf_with_dt_strsz_of_2_64_is_read_without_crashing(tmp_path):
    tar = hostile.tar_of([("usr/lib/libbad.so", hostile.elf_with_strsz(2**64 - 1))])
    r = limited(hostile.one_layer(tmp_path, tar), "--json", *NO_REQUEST, seconds=60,
                memory=GiB)
    assert r.rc == 0, r.stderr
    assert r.doc["verdict"] == "no-image-cause"


def test_an_internal_failure_is_exit_2_in_one_line_not_a_traceback(tmp_path, monkeypatch,
                                                                     capsys):
    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(scanner, "scan", broken)
    assert command.main(["scan", str(tmp_path)]) == command.EXIT_ERROR
    err = capsys.readouterr().err
    assert err == ("epguard: cannot scan: internal error: KeyError: 'a bug' (a bug in "
                   "epguard, not a cause in the image)\n")


# --- point 11: digests ------------------------------------------------------------------

def test_a_docker_archive_whose_config_is_named_after_another_digest_is_refused(tmp_path):
    forged = "ab" * 32
    r = limited(hostile.docker_archive(tmp_path, forge_name=forged), seconds=30)
    _bad_input(r, f"is named after sha256:{forged} but its content is sha256:")


def test_record_refuses_a_docker_archive_it_has_no_digest_to_name(tmp_path):
    archive = hostile.docker_archive(tmp_path)
    r = limited(archive, "--json", *NO_REQUEST, seconds=30)
    assert (r.rc, r.doc["digest"]) == (0, None)
    assert r.doc["config_digest"].startswith("sha256:")
    r = limited(archive, "--record", "--image", "registry.example/x:1",
                "--kubeconfig", "/nonexistent", seconds=30)
    _bad_input(r, "--record needs the image's manifest digest, and a docker-archive has "
                  "none")


def test_a_multi_platform_image_is_named_by_its_index_digest(tmp_path):
    layout, index, amd64 = hostile.multi_platform_layout(tmp_path)
    r = limited(layout, "--json", *NO_REQUEST, seconds=30)
    assert r.rc == 0, r.stderr
    assert (r.doc["digest"], r.doc["platform_digest"]) == (index, amd64)
    pinned = limited(layout, "--record", "--image", f"registry.example/x@{amd64}",
                     "--kubeconfig", "/nonexistent", seconds=30)
    _bad_input(pinned, f"--image pins {amd64}", f"image index {index}", f"pin {index}")
    other = limited(layout, "--platform", "linux/s390x", seconds=30)
    _bad_input(other, "the image index has no linux/s390x image (it holds linux/amd64, "
                      "linux/arm64)")


# --- point 11: the scan and the probe read the same bytes -------------------------------

_LOADER = b'''import importlib
import re

import torch

torch_version = re.match(r"\\d+(?:\\.\\d+)*", torch.__version__).group()
version_suffix = "_" + torch_version.replace(".", "_")

try:
    backend_module = importlib.import_module("mooncake.pg" + version_suffix)
except ModuleNotFoundError:
    raise ImportError(
        f"Mooncake PG was not built against torch=={torch_version}."
    )
'''
_SITE = "usr/local/lib/python3.11/dist-packages"


def _oversized_loader_files() -> list[tuple[str, bytes]]:
    return [
        (f"{_SITE}/torch-2.13.0.dist-info/METADATA", b"Name: torch\nVersion: 2.13.0\n"),
        (f"{_SITE}/torch/__init__.py", b""),
        (f"{_SITE}/torch/version.py", b"__version__ = '2.13.0+cu130'\ncuda = '13.0'\n"),
        (f"{_SITE}/mooncake_transfer_engine-0.3.10.dist-info/METADATA",
         b"Name: mooncake-transfer-engine\nVersion: 0.3.10\n"),
        (f"{_SITE}/mooncake/__init__.py", b""),
        (f"{_SITE}/mooncake/pg_2_9_0.cpython-311-x86_64-linux-gnu.so", b""),
        # The loader, padded past the 1 MiB both read: its import is in the first bytes.
        (f"{_SITE}/mooncake/pg.py", _LOADER + b"#" * (files.MAX_TEXT_BYTES + 4096)),
    ]


class _Under(files.Live):
    """The probe's own file access (probe/files.py), under ``root`` instead of ``/``."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = str(root)

    def _p(self, path: str) -> str:
        return self.root + path

    def listdir(self, path):
        return super().listdir(self._p(path))

    def isdir(self, path):
        return super().isdir(self._p(path))

    def isfile(self, path):
        return super().isfile(self._p(path))

    def exists(self, path):
        return super().exists(self._p(path))

    def realpath(self, path):
        return super().realpath(self._p(path))[len(self.root):] or "/"

    def read_text(self, path, limit=files.MAX_TEXT_BYTES):
        return super().read_text(self._p(path), limit)

    def dynamic(self, path):
        return super().dynamic(self._p(path))

    def strings(self, path):
        return super().strings(self._p(path))


def test_a_loader_over_1_mib_is_judged_by_the_scan_as_the_probes_import_meets_it(tmp_path):
    """The pod's verdict on this image is the import's: Python reads the whole loader and
    raises its ImportError (exit 1). The probe's fast path reads no text over
    MAX_TEXT_BYTES and leaves the verdict to that import; the scan has no import, so it
    reads the loader's first MAX_TEXT_BYTES (the probe's own constant), where the
    import sits, and says what the import says. At d5affd9 it skipped the loader: exit
    0, "no image cause"."""
    entries = _oversized_loader_files()
    root = tmp_path / "root"
    for name, data in entries:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    layout = hostile.one_layer(tmp_path / "img", hostile.tar_of(entries))
    r = limited(layout, "--json", seconds=60)
    assert r.rc == 1, r.stderr
    assert [c["classification"] for c in r.doc["causes"]] == ["no-extension-for-torch"]
    assert "ImportError: Mooncake PG was not built against torch==2.13.0." in r.doc["message"]
    assert any("only the first 1048576 read, as the probe reads it" in n
               for n in r.doc["notes"])
    # The probe's fast path on the same files decides nothing else (no contrary
    # finding): the import, which the scan has just worded, decides in the pod.
    request = cmdline.read(list(scanner.ANY_LAUNCH), env={}, release=None)
    image = static.Image(_Under(root), ["/" + _SITE], scanner.suffixes("3.11", {}),
                         {"PATH": "/usr/bin"}, driver_mounted=True)
    fast = [f.verdict.classification for f in static.read(image, request).findings]
    assert fast in ([], ["no-extension-for-torch"])


def test_the_scan_reads_texts_with_the_probes_own_limit():
    assert tree.TEXT_BYTES is files.MAX_TEXT_BYTES


def test_a_tarfile_written_archive_reads_the_same_with_the_scans_reader():
    names = ["a", "d/" + "x" * 150 + "/y", "é/ü", "long/" * 60 + "end"]
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            for n in names:
                ti = tarfile.TarInfo(n)
                ti.size = len(n.encode())
                tar.addfile(ti, io.BytesIO(n.encode()))
            link = tarfile.TarInfo("lnk")
            link.type, link.linkname = tarfile.SYMTYPE, "t" * 300
            tar.addfile(link)
        raw = buf.getvalue()
        for seekable in (True, False):
            reader = tarstream.TarReader(io.BytesIO(raw), tarstream.unlimited(),
                                         seekable=seekable, length=len(raw))
            got = [(e.name, e.linkname, reader.data(e).read() if e.isreg() else None)
                   for e in reader]
            assert got == [*[(n, "", n.encode()) for n in names], ("lnk", "t" * 300, None)]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_an_sglang_source_between_1_and_4_mib_is_read_whole_as_the_probe_reads_it(tmp_path):
    """The probe (requirement.py) reads an SGLang source whole up to MAX_SOURCE_BYTES
    (4 MiB); the scan kept only its first MAX_TEXT_BYTES (1 MiB), so an import of
    mooncake.pg past 1 MiB was the probe's finding and not the scan's."""
    from epguard.probe import requirement
    from epguard.webhook.scan import sources

    padding = b"#" * (files.MAX_TEXT_BYTES + 4096) + b"\n"
    source = padding + b"from mooncake.pg import MooncakeBackendOptions\n"
    big = padding * 4 + b"import mooncake.pg\n"  # over 4 MiB: neither reads it
    entries = [
        (f"{_SITE}/sglang-0.5.23.dist-info/METADATA", b"Name: sglang\nVersion: 0.5.23\n"),
        (f"{_SITE}/sglang/__init__.py", b""),
        (f"{_SITE}/sglang/srt/distributed/parallel_state.py", source),
        (f"{_SITE}/sglang/srt/elastic_ep/elastic_ep.py", big),
    ]
    root = tmp_path / "root"
    for name, data in entries:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    layout = hostile.one_layer(tmp_path / "img", hostile.tar_of(entries))
    scanned, _ = scanner.build_tree(sources.open_source(str(layout)))
    path = ["/" + _SITE]
    in_pod = requirement.requirement(_Under(root), path)
    by_scan = requirement.requirement(scanned, path)
    assert in_pod.modules == ["mooncake.pg"] and "MooncakeBackendOptions" in str(in_pod.names)
    assert (by_scan.modules, by_scan.names) == (in_pod.modules, in_pod.names)
    assert any("over 4194304: not read, as the probe does not read it" in n
               for n in scanned.notes)
