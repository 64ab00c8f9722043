"""Every archive format and layer compression reads to the same verdict.

The image: Debian python3, torch 2.13.0 (CUDA 13), SGLang 0.5.18 and the real
mooncake-transfer-engine-cuda13 0.3.10 wheel, which ships pg_* for torch 2.9/2.10
only: one image cause, no-extension-for-torch, whatever the packaging.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from tests.scan.imagebuild import ImageSpec, compress, pack, write_docker, write_layer, write_layout
from tests.scan.scan_harness import Pieces, mooncake_spec, scan

pytestmark = [pytest.mark.realpkg, pytest.mark.bulk]

REF = "registry.example/team/sglang:0.5.18-mte-cuda13-0.3.10"
CONFIG = {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
          "Cmd": ["python3", "-m", "sglang.launch_server", "--model-path", "/models/m",
                  "--elastic-ep-backend", "mooncake"]}
UNUSABLE = "epguard: mooncake elastic EP is unusable in this image: "


@pytest.fixture(scope="module")
def layers(pieces: Pieces, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    d = tmp_path_factory.mktemp("formats")
    mooncake = write_layer(d / "mooncake.tar", mooncake_spec("mte-cuda13-0.3.10"))
    plain = [pieces.base, pieces.torch, pieces.sglang_pg, mooncake]
    out = {"none": plain}
    for how in ("gzip", "zstd"):
        out[how] = [compress(_copy(p, d / f"{how}-{i}.tar"), how) for i, p in enumerate(plain)]
    return out


def _copy(src: Path, dst: Path) -> Path:
    if not dst.exists():
        dst.hardlink_to(src)
    return dst


def _image(layers: list[Path], how: str) -> ImageSpec:
    return ImageSpec(REF, [(p, how) for p in layers], CONFIG)


def _assert_no_extension(r) -> None:
    assert r.rc == 1, r.stderr
    doc = r.doc
    assert [c["classification"] for c in doc["causes"]] == ["no-extension-for-torch"]
    assert doc["versions"] == {"torch": "2.13.0+cu130", "sglang": "0.5.18",
                               "mooncake-transfer-engine-cuda13": "0.3.10"}
    assert doc["argv_from"] == "image config"
    assert "has no PG extension for torch 2.13.0 (it ships pg_* for torch 2.9.0, 2.9.1, " \
           "2.10.0)" in doc["causes"][0]["cause"]
    assert doc["message"].startswith(UNUSABLE)


@pytest.mark.parametrize("how", ["none", "gzip", "zstd"])
def test_oci_layout_directory_in_each_compression(tmp_path, layers, how):
    digests = write_layout(tmp_path / "layout", [_image(layers[how], how)])
    r = scan(tmp_path / "layout", "--json")
    _assert_no_extension(r)
    assert r.doc["kind"] == "oci-layout"
    assert r.doc["digest"] == digests[REF]
    assert r.doc["layers"] == ["none" if how == "none" else how] * 4


@pytest.mark.parametrize("how", ["none", "gzip", "zstd"])
def test_oci_archive_in_each_compression(tmp_path, layers, how):
    digests = write_layout(tmp_path / "layout", [_image(layers[how], how)])
    archive = pack(tmp_path / "layout", tmp_path / "image.oci.tar")
    r = scan(archive, "--json")
    _assert_no_extension(r)
    assert (r.doc["kind"], r.doc["digest"], r.doc["ref"]) == ("oci-archive", digests[REF], REF)


@pytest.mark.parametrize("how", ["none", "gzip"])
def test_docker_save_archive_and_directory(tmp_path, layers, how):
    root = write_docker(tmp_path / "docker", _image(layers[how], how))
    archive = pack(root, tmp_path / "image.docker.tar")
    for target in (archive, root):
        r = scan(target, "--json")
        _assert_no_extension(r)
        assert r.doc["kind"] == "docker-archive"
        assert r.doc["ref"] == REF


def test_unpacked_root_filesystem(tmp_path, layers):
    root = tmp_path / "rootfs"
    root.mkdir()
    for layer in layers["none"]:
        with tarfile.open(layer) as tar:
            tar.extractall(root, filter="tar")
    r = scan(root, "--json", "--argv", "python3", "-m", "sglang.launch_server",
             "--elastic-ep-backend", "mooncake")
    assert r.rc == 1, r.stderr
    assert r.classes == ["no-extension-for-torch"]
    assert (r.doc["kind"], r.doc["argv_from"]) == ("rootfs", "--argv")


def test_one_archive_of_several_images_is_read_by_ref(tmp_path, layers, pieces):
    other = ImageSpec("registry.example/team/base:1", [(pieces.base, "none")], {})
    write_layout(tmp_path / "layout", [other, _image(layers["none"], "none")])
    archive = pack(tmp_path / "layout", tmp_path / "two.oci.tar")
    r = scan(archive)
    assert r.rc == 2
    assert "2 images here; name one with --ref" in r.stderr
    assert "registry.example/team/base:1" in r.stderr
    _assert_no_extension(scan(archive, "--json", "--ref", REF))
    bare = scan(archive, "--json", "--ref", "registry.example/team/base:1")
    assert (bare.rc, bare.classes) == (1, ["torch-not-installed"])


def test_text_output_is_the_probe_message_format(tmp_path, layers):
    write_layout(tmp_path / "layout", [_image(layers["none"], "none")])
    r = scan(tmp_path / "layout")
    lines = r.stdout.splitlines()
    assert r.rc == 1
    assert lines[0].startswith(UNUSABLE + "mooncake-transfer-engine-cuda13 0.3.10 has no PG ")
    assert lines[1] == ("versions: torch=2.13.0+cu130 sglang=0.5.18 "
                        "mooncake-transfer-engine-cuda13=0.3.10")
    assert "scope: image (in the image's files: the same on every node)" in lines
    gpu = "checked only on a GPU node: driver: libcuda.so.1"
    assert any(line.startswith(gpu) for line in lines)
    assert lines[-1].startswith("fix: install mooncake-transfer-engine-cuda13==0.3.13.post1")


def test_github_format_annotates_each_cause(tmp_path, layers):
    write_layout(tmp_path / "layout", [_image(layers["none"], "none")])
    r = scan(tmp_path / "layout", "--format", "github")
    lines = r.stdout.splitlines()
    assert r.rc == 1
    assert lines[0].startswith(
        "::error title=epguard scan%3A no-extension-for-torch in " + REF.replace(":", "%3A")
        + "::mooncake-transfer-engine-cuda13 0.3.10 has no PG extension")
    assert "Fix: install mooncake-transfer-engine-cuda13==0.3.13.post1" in lines[0]
    assert any(line.startswith("::notice title=epguard scan%3A left to a GPU node::driver")
               for line in lines)
