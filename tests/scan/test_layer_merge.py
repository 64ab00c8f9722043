"""Layers merge as a runtime merges them: later wins, whiteouts delete, opaque
directories hide what is below, and a package split across layers is one package."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import pytest

from epguard.webhook.scan.tree import Tree
from tests.scan.imagebuild import ImageSpec, LayerSpec, write_layer, write_layout
from tests.scan.scan_harness import SITE, Pieces, mooncake_spec, scan

pytestmark = pytest.mark.realpkg

CUDA12 = "mte-0.3.13.post1"
CUDA13 = "mte-cuda13-0.3.13.post1"
PG = "mooncake/pg_2_13_0.cpython-311-x86_64-linux-gnu.so"


def _scan(tmp_path: Path, pieces: Pieces, *top: Path):
    img = ImageSpec("t:1", [(p, "none") for p in (pieces.base, pieces.torch,
                                                  pieces.sglang_pg, *top)], {})
    write_layout(tmp_path / "layout", [img])
    return scan(tmp_path / "layout", "--json")


def test_cuda12_wheel_over_cuda13_torch_is_a_cuda_mismatch(tmp_path, pieces):
    r = _scan(tmp_path, pieces, write_layer(tmp_path / "m.tar", mooncake_spec(CUDA12)))
    assert r.rc == 1
    assert r.classes[0] == "cuda-mismatch"
    assert "libcudart.so.12" in r.doc["causes"][0]["missing_libraries"]


def test_a_whiteout_removes_the_wheel_a_lower_layer_installed(tmp_path, pieces):
    low = write_layer(tmp_path / "low.tar", mooncake_spec(CUDA12))
    info = next(p.name for p in (Path(mooncake_spec(CUDA12).trees[0][0])).glob("*.dist-info"))
    spec = mooncake_spec(CUDA13)
    spec.whiteouts = [f"{SITE}/.wh.mooncake", f"{SITE}/.wh.{info}"]
    r = _scan(tmp_path, pieces, low, write_layer(tmp_path / "high.tar", spec))
    assert "cuda-mismatch" not in r.classes
    assert r.doc["versions"]["mooncake-transfer-engine-cuda13"] == "0.3.13.post1"
    assert "mooncake-transfer-engine" not in r.doc["versions"]
    # What stays is the base image's lack of rdma-core: the cuda13 wheel's only fault.
    assert r.classes == ["missing-libraries"]
    assert {"libibverbs.so.1", "libmlx5.so.1"} <= set(r.doc["causes"][0]["missing_libraries"])


def test_without_the_whiteout_both_dist_infos_remain(tmp_path, pieces):
    low = write_layer(tmp_path / "low.tar", mooncake_spec(CUDA12))
    high = write_layer(tmp_path / "high.tar", mooncake_spec(CUDA13))
    r = _scan(tmp_path, pieces, low, high)
    assert {"mooncake-transfer-engine", "mooncake-transfer-engine-cuda13"} <= set(r.doc["versions"])
    # The cuda13 files overwrote the cuda12 ones of the same name: no CUDA 12 link left.
    assert "cuda-mismatch" not in r.classes


def test_a_mooncake_package_split_across_layers_is_one_package(tmp_path, pieces):
    no_pg = mooncake_spec(CUDA13, skip=lambda rel: rel == PG)
    only_pg = mooncake_spec(CUDA13, skip=lambda rel: rel != PG)
    alone = _scan(tmp_path / "a", pieces, write_layer(tmp_path / "lo.tar", no_pg))
    assert alone.classes[0] == "no-extension-for-torch"
    both = _scan(tmp_path / "b", pieces, tmp_path / "lo.tar",
                 write_layer(tmp_path / "hi.tar", only_pg))
    assert "no-extension-for-torch" not in both.classes
    assert both.classes == ["missing-libraries"]


def test_a_later_layer_wins_over_an_earlier_file(tmp_path, pieces):
    low = write_layer(tmp_path / "m.tar", mooncake_spec(CUDA12))
    text = "__version__ = '2.13.0+cu128'\ncuda: Optional[str] = '12.8'\n"
    patch = write_layer(tmp_path / "v.tar", LayerSpec(files={
        f"{SITE}/torch/version.py": text.encode()}))
    r = _scan(tmp_path, pieces, low, patch)
    assert r.doc["versions"]["torch"] == "2.13.0+cu128"
    assert "cuda-mismatch" not in r.classes


def _tree(*layers: list[tuple[str, str, bytes | str | None]]) -> Tree:
    """A tree from hand-made layers of (kind, name, data-or-link)."""
    tree = Tree()
    for i, entries in enumerate(layers):
        for kind, name, data in entries:
            ti = tarfile.TarInfo(name)
            if kind == "d":
                ti.type = tarfile.DIRTYPE
                tree.apply(ti, None, i)
            elif kind == "l":
                ti.type, ti.linkname = tarfile.SYMTYPE, str(data)
                tree.apply(ti, None, i)
            else:
                raw = data if isinstance(data, bytes) else b""
                ti.size = len(raw)
                tree.apply(ti, io.BytesIO(raw), i)
    return tree


def test_an_opaque_directory_hides_lower_layers_but_not_its_own_layer():
    tree = _tree(
        [("f", "opt/x/mooncake/pg.py", b"low"), ("f", "opt/x/mooncake/old.py", b"old")],
        [("f", "opt/x/mooncake/new.py", b"new"), ("f", "opt/x/mooncake/.wh..wh..opq", b""),
         ("f", "opt/x/mooncake/pg.py", b"high")],
    )
    assert sorted(tree.listdir("/opt/x/mooncake")) == ["new.py", "pg.py"]
    assert tree.read_text("/opt/x/mooncake/pg.py") == "high"


def test_symlinks_resolve_inside_the_image_never_on_this_machine():
    tree = _tree([
        ("f", "opt/real/mooncake/pg.py", b"x = 1"),
        ("l", "usr/lib/site/mooncake", "/opt/real/mooncake"),
        ("l", "usr/lib/site/escape", "../../../../../../etc"),
        ("l", "loop/a", "b"), ("l", "loop/b", "a"),
    ])
    assert tree.read_text("/usr/lib/site/mooncake/pg.py") == "x = 1"
    assert tree.realpath("/usr/lib/site/mooncake/pg.py") == "/opt/real/mooncake/pg.py"
    # `..` stops at the image's root: /etc of the image, which this one has not.
    assert not tree.exists("/usr/lib/site/escape/hostname")
    assert not tree.exists("/loop/a")


def test_only_the_files_the_diagnosis_reads_are_kept():
    tree = _tree([("f", "usr/lib/python3/dist-packages/torch/version.py", b"__version__='1'"),
                  ("f", "usr/lib/python3/dist-packages/torch/big.py", b"x" * 1000),
                  ("f", "etc/passwd", b"root:x:0:0")])
    assert tree.read_text("/usr/lib/python3/dist-packages/torch/version.py") == "__version__='1'"
    assert tree.read_text("/usr/lib/python3/dist-packages/torch/big.py") is None
    assert tree.read_text("/etc/passwd") is None
    # Charged what the kept str costs in memory (its object header included).
    assert tree.kept_bytes == sys.getsizeof("__version__='1'")
