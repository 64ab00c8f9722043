"""Bad input: exit 2, a message that says what is wrong, and nothing left behind.

Every case runs the real command with TMPDIR and the working directory set to empty
directories, and checks that they are still empty afterwards: the scan unpacks
nothing and writes nothing.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import zstandard

from epguard.webhook.scan import scanner, tree
from tests.scan.imagebuild import ImageSpec, compress, pack, write_layer, write_layout
from tests.scan.scan_harness import Pieces, mooncake_spec, scan

pytestmark = pytest.mark.realpkg


def _clean_scan(tmp_path: Path, target: Path, *args: str):
    tmpdir, cwd = tmp_path / "tmpdir", tmp_path / "cwd"
    tmpdir.mkdir(exist_ok=True)
    cwd.mkdir(exist_ok=True)
    r = scan(target, *args, env={**os.environ, "TMPDIR": str(tmpdir)}, cwd=cwd)
    assert list(tmpdir.iterdir()) == [] and list(cwd.iterdir()) == []
    return r


@pytest.fixture(scope="module")
def archive(pieces: Pieces, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    mooncake = write_layer(d / "m.tar", mooncake_spec("mte-cuda13-0.3.10"))
    gz = compress(mooncake, "gzip")
    write_layout(d / "layout", [ImageSpec("t:1", [(pieces.torch, "none"), (gz, "gzip")], {})])
    return pack(d / "layout", d / "image.oci.tar")


def _layer_offset(archive: Path) -> tuple[int, int]:
    """Offset and size of the largest blob (the gzip mooncake layer) in the archive."""
    with tarfile.open(archive) as tar:
        m = max(tar.getmembers(), key=lambda m: m.size)
        return m.offset_data, m.size


def test_a_truncated_archive_is_bad_input(tmp_path, archive):
    start, size = _layer_offset(archive)
    cut = tmp_path / "cut.oci.tar"
    with open(archive, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(start + size // 2))
    r = _clean_scan(tmp_path, cut)
    assert r.rc == 2
    assert r.stdout == ""
    assert r.stderr.startswith("epguard: cannot scan: ")
    assert "truncated" in r.stderr


def test_a_corrupt_gzip_layer_is_bad_input(tmp_path, archive):
    start, size = _layer_offset(archive)
    bad = tmp_path / "bad.oci.tar"
    data = bytearray(archive.read_bytes())
    data[start + size // 2: start + size // 2 + 4096] = os.urandom(4096)
    bad.write_bytes(bytes(data))
    r = _clean_scan(tmp_path, bad, "--format", "github")
    assert r.rc == 2
    assert r.stdout.startswith("::error title=epguard scan%3A bad input::epguard: cannot scan: ")
    assert "layer 1" in r.stdout and "corrupt or truncated" in r.stdout


def test_a_cut_zstd_layer_is_bad_input_even_when_its_digest_matches(tmp_path):
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        data = os.urandom(1 << 16)
        ti = tarfile.TarInfo("usr/lib/libx.so.1")
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
    # A builder that died half way: the digest matches the bytes, the frame is cut.
    z = zstandard.ZstdCompressor().compress(layer.getvalue())
    blob = tmp_path / "layer.tar.zst"
    blob.write_bytes(z[: len(z) // 2])
    write_layout(tmp_path / "layout", [ImageSpec("z:1", [(blob, "zstd")], {})])
    r = _clean_scan(tmp_path, tmp_path / "layout", "--json")
    assert r.rc == 2
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "error" and "(zstd tar) is corrupt or truncated" in doc["error"]


@pytest.mark.parametrize(("make", "said"), [
    (lambda p: p.write_bytes(b"not an archive at all" * 100), "not a tar archive"),
    (lambda p: p.write_bytes(gzip.compress(b"x" * 1000)), "is a compressed file"),
    (lambda p: p.mkdir(), "no oci-layout, no manifest.json and no root filesystem"),
    (lambda p: None, "no such file or directory"),
])
def test_what_is_not_an_image_is_named(tmp_path, make, said):
    target = tmp_path / "input"
    make(target)
    r = _clean_scan(tmp_path, target)
    assert r.rc == 2
    assert said in r.stderr


def test_a_tar_that_is_no_image_archive(tmp_path):
    t = tmp_path / "plain.tar"
    with tarfile.open(t, "w") as tar:
        tar.addfile(tarfile.TarInfo("hello"), io.BytesIO(b""))
    r = _clean_scan(tmp_path, t)
    assert r.rc == 2
    assert "without oci-layout/index.json or manifest.json" in r.stderr


def test_a_blob_that_does_not_match_its_digest(tmp_path, pieces):
    write_layout(tmp_path / "layout", [ImageSpec("t:1", [(pieces.torch, "none")], {})])
    index = json.loads((tmp_path / "layout" / "index.json").read_text())
    manifest = tmp_path / "layout" / "blobs" / "sha256" / index["manifests"][0]["digest"][7:]
    doc = json.loads(manifest.read_text())
    (tmp_path / "layout" / "blobs" / "sha256" / doc["config"]["digest"][7:]).write_text("{}")
    r = _clean_scan(tmp_path, tmp_path / "layout")
    assert r.rc == 2
    assert "image config: content does not match its digest" in r.stderr


def test_malformed_index_json(tmp_path):
    (tmp_path / "layout").mkdir()
    (tmp_path / "layout" / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (tmp_path / "layout" / "index.json").write_text('{"manifests": [{"digest": 5}]')
    r = _clean_scan(tmp_path, tmp_path / "layout")
    assert r.rc == 2
    assert "index.json is not JSON" in r.stderr


def _one_layer_image(tmp_path: Path, entries: list[tarfile.TarInfo]) -> Path:
    blob = tmp_path / "layer.tar"
    with tarfile.open(blob, "w") as tar:
        for ti in entries:
            tar.addfile(ti, io.BytesIO(b"x" * ti.size))
    write_layout(tmp_path / "layout", [ImageSpec("h:1", [(blob, "none")], {})])
    return tmp_path / "layout"


def test_an_entry_that_leaves_the_root_is_refused(tmp_path):
    ti = tarfile.TarInfo("usr/../../etc/cron.d/x")
    ti.size = 1
    r = _clean_scan(tmp_path, _one_layer_image(tmp_path, [ti]))
    assert r.rc == 2
    assert "leaves the root" in r.stderr


def test_too_many_entries_is_refused_not_held(tmp_path, monkeypatch):
    monkeypatch.setattr(tree, "MAX_ENTRIES", 50)
    entries = []
    for i in range(80):
        ti = tarfile.TarInfo(f"many/f{i}")
        entries.append(ti)
    image = _one_layer_image(tmp_path, entries)
    with pytest.raises(scanner.ScanError, match="more than 50 entries"):
        scanner.scan(str(image))


def test_an_oversized_metadata_file_is_noted_and_read_only_as_far_as_the_probe_reads(tmp_path):
    ti = tarfile.TarInfo("usr/local/lib/python3.11/dist-packages/torch-9.dist-info/METADATA")
    ti.size = tree.TEXT_BYTES + 1
    r = _clean_scan(tmp_path, _one_layer_image(tmp_path, [ti]), "--json")
    assert r.rc in (0, 1)
    assert any("only the first 1048576 read, as the probe reads it" in n
               for n in r.doc["notes"])
