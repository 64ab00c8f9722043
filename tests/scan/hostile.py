"""Hostile image archives for `epguard scan`, built from crafted bytes (issue 21).

Each builder writes a real OCI layout (or archive) whose one bad part is what its name
says; the rest is a valid image. Python's ``tarfile`` cannot write most of these (a
negative size, a PAX header of 512 MiB, a sparse member claiming 1 TiB), so the tar
headers are written here by hand: :func:`header` is a ustar header with its checksum.
Used by tests/scan/test_hostile.py (small sizes) and bench/scan_hostile_bench.py
(the sizes of the audit).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import struct
import tarfile
import zlib
from pathlib import Path

from tests.scan.imagebuild import ImageSpec, pack, write_docker, write_layout

BLOCK = 512
END = b"\x00" * (2 * BLOCK)


def _octal(n: int, width: int) -> bytes:
    return f"{n:0{width - 1}o}".encode() + b"\x00"


def header(name: bytes, size: int = 0, kind: bytes = b"0", *, size_field: bytes | None = None,
           link: bytes = b"", extra: dict[int, bytes] | None = None) -> bytes:
    """One ustar header block; ``size_field`` overrides the 12-byte size as written."""
    h = bytearray(BLOCK)
    h[0:len(name[:100])] = name[:100]
    h[100:108] = _octal(0o644, 8)
    h[108:116] = _octal(0, 8)
    h[116:124] = _octal(0, 8)
    h[124:136] = size_field if size_field is not None else _octal(size, 12)
    h[136:148] = _octal(0, 12)
    h[156:157] = kind
    h[157:157 + len(link[:100])] = link[:100]
    h[257:263] = b"ustar\x00"
    h[263:265] = b"00"
    for at, raw in (extra or {}).items():
        h[at:at + len(raw)] = raw
    h[148:156] = b" " * 8
    h[148:156] = f"{sum(h):06o}".encode() + b"\x00 "
    return bytes(h)


def pad(data: bytes) -> bytes:
    return data + b"\x00" * (-len(data) % BLOCK)


def pax(records: dict[bytes, bytes], kind: bytes = b"x") -> bytes:
    body = b""
    for k, v in records.items():
        rec = b" " + k + b"=" + v + b"\n"
        n = len(rec) + 1
        while len(str(n).encode()) + len(rec) != n:
            n += 1
        body += str(n).encode() + rec
    return header(b"././@PaxHeader", len(body), kind) + pad(body)


def regular(name: bytes, data: bytes) -> bytes:
    """A regular file; a name over ustar's 100 bytes goes in a PAX ``path`` record."""
    long = pax({b"path": name}) if len(name) > 100 else b""
    return long + header(name, len(data)) + pad(data)


# --- images around one layer ------------------------------------------------------------

def layout_of(root: Path, layers: list[tuple[Path, str]], config: dict | None = None,
              ref: str = "hostile:1") -> Path:
    write_layout(root, [ImageSpec(ref, layers, config or {})])
    return root


def layer_file(path: Path, tar_bytes: bytes, how: str = "none") -> tuple[Path, str]:
    """A layer blob; ``how="gzip"`` compresses ``tar_bytes`` unless they already are."""
    if how == "gzip" and not tar_bytes.startswith(b"\x1f\x8b"):
        path.write_bytes(gzip.compress(tar_bytes, compresslevel=1, mtime=0))
    else:  # plain, or compressed already
        path.write_bytes(tar_bytes)
    return path, how


def one_layer(root: Path, tar_bytes: bytes, how: str = "none",
              config: dict | None = None) -> Path:
    (root / "l").mkdir(parents=True, exist_ok=True)
    layer = layer_file(root / "l" / "layer.tar", tar_bytes, how)
    return layout_of(root / "layout", [layer], config)


def gzip_stream(parts: list[tuple[bytes, int]]) -> bytes:
    """A gzip member of ``parts``: (bytes, repeat count), compressed chunk by chunk so
    that 512 MiB of one byte never sits in memory."""
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    out = io.BytesIO()
    for data, times in parts:
        for _ in range(times):
            out.write(z.compress(data))
    out.write(z.flush())
    return out.getvalue()


# --- point 7: negative sizes ------------------------------------------------------------

def pax_negative_size_tar() -> bytes:
    """A PAX ``size=-1536`` record before a regular member: tarfile moves its offset
    back over the header and reads it again, forever (a member first: at offset 0
    it would stop)."""
    return regular(b"etc/a", b"a") + pax({b"size": b"-1536"}) + header(b"usr/x", 0) + END


def base256_negative_size_tar() -> bytes:
    """A size field in base-256 with the sign byte set: -512, back onto its own header."""
    field = b"\xff" * 10 + (-512 & 0xFFFF).to_bytes(2, "big")
    return regular(b"etc/a", b"a") + header(b"usr/x", size_field=field) + END


def backtracking_pax_tar(size: int) -> bytes:
    r"""A PAX header of ``size`` bytes of 5-byte records ``"5 a\n\n"`` and one ``=`` at
    its end: the regular expression d5affd9's ``tarfile`` parses records with,
    ``(\d+) ([^=]+)=``, scans to that ``=`` for every record (quadratic)."""
    body = b"5 a\n\n" * ((size - 8) // 5) + b"8 a=b\n\n"[: 8]
    return (regular(b"etc/a", b"a") + header(b"././@PaxHeader", len(body), b"x") + pad(body)
            + header(b"usr/x", 0) + END)


def outer_archive_with(root: Path, member: bytes) -> Path:
    """An OCI archive (a valid layout packed as tar) with ``member`` tar bytes put in
    front of its members."""
    (root / "l").mkdir(parents=True, exist_ok=True)
    layer = layer_file(root / "l" / "layer.tar", regular(b"etc/hostname", b"x\n") + END)
    layout = layout_of(root / "layout", [layer])
    plain = pack(layout, root / "plain.tar").read_bytes()
    out = root / "image.oci.tar"
    out.write_bytes(member[:-len(END)] + plain if member.endswith(END) else member + plain)
    return out


# --- point 8: sizes claimed before they are read ---------------------------------------

def huge_pax_header_layer(size: int) -> bytes:
    """A gzip layer whose PAX header holds ``size`` bytes of one record's value."""
    key = b" comment="
    n = size
    head = str(n).encode() + key
    body_len = n - len(head) - 1
    filler = b"a" * (1 << 20)
    full, rest = divmod(body_len, len(filler))
    trailer = b"\n" + b"\x00" * (-n % BLOCK)
    return gzip_stream([(header(b"././@PaxHeader", n, b"x") + head, 1), (filler, full),
                        (filler[:rest] + trailer, 1),
                        (header(b"usr/x", 0) + END, 1)])


def huge_long_name_layer(size: int) -> bytes:
    """A gzip layer whose GNU ././@LongLink name is ``size`` bytes."""
    filler = b"n" * (1 << 20)
    full, rest = divmod(size, len(filler))
    return gzip_stream([(header(b"././@LongLink", size, b"L"), 1), (filler, full),
                        (filler[:rest] + b"\x00" * (-size % BLOCK), 1),
                        (header(b"usr/x", 0) + END, 1)])


def pax_run_layer(count: int, value: int) -> bytes:
    """``count`` PAX headers in a row before one member, each with its own keyword and
    a ``value``-byte value (a reader that keeps every record holds count x value)."""
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    out = io.BytesIO()
    filler = b"v" * value
    for i in range(count):
        out.write(z.compress(pax({b"SCHILY.xattr.user.k%d" % i: filler})))
    out.write(z.compress(regular(b"etc/a", b"a") + END))
    out.write(z.flush())
    return out.getvalue()


def many_long_names_layer(count: int, length: int) -> bytes:
    """``count`` files, each with a distinct GNU long name of ``length`` bytes."""
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    out = io.BytesIO()
    stem = b"d/" + b"n" * (length - 12)
    for i in range(count):
        name = stem + b"%010d" % i
        out.write(z.compress(header(b"././@LongLink", len(name) + 1, b"L")
                             + pad(name + b"\x00") + header(b"x", 0)))
    out.write(z.compress(END))
    out.write(z.flush())
    return out.getvalue()


def sparse_members_layer(count: int, realsize: int, name: bytes = b"usr/lib/lib%d.so"
                         ) -> bytes:
    """``count`` GNU sparse members claiming ``realsize`` bytes each, storing none: each
    is a library the diagnosis would read."""
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    out = io.BytesIO()
    real = b"\x80" + realsize.to_bytes(11, "big")
    for i in range(count):
        n = name % i
        long = pax({b"path": n}) if len(n) > 100 else b""
        out.write(z.compress(long + header(n, 0, b"S", extra={483: real})))
    out.write(z.compress(END))
    out.write(z.flush())
    return out.getvalue()


# --- point 9: zstd bomb, long link targets, huge PATH ----------------------------------

def zstd_zeros_frame(size: int, head: bytes) -> bytes:
    """A zstd frame: ``head`` as a raw block, then ``size`` zero bytes as RLE blocks of
    128 KiB (4 bytes each: 16 GiB is a 512 KB frame), then the tar's end blocks."""
    block = 1 << 17
    out = io.BytesIO()
    out.write(b"\x28\xb5\x2f\xfd" + bytes([0x00, 0x38]))  # no content size, 128 KiB window

    def block_header(kind: int, n: int, last: bool) -> bytes:
        return (int(last) | kind << 1 | n << 3).to_bytes(3, "little")

    for at in range(0, len(head), block):
        chunk = head[at:at + block]
        out.write(block_header(0, len(chunk), False) + chunk)
    rle = block_header(1, block, False) + b"\x00"
    full, rest = divmod(size + len(END), block)
    out.write(rle * full)
    out.write(block_header(1, rest, True) + b"\x00")
    return out.getvalue()


def zstd_bomb_layout(root: Path, inflated: int, listed: int) -> Path:
    """One zstd layer holding a file of ``inflated`` zero bytes, listed ``listed``
    times in the manifest (the same blob: a registry stores it once)."""
    head = pax({b"size": str(inflated).encode()}) + header(b"usr/share/zeros", 0)
    (root / "l").mkdir(parents=True, exist_ok=True)
    blob = root / "l" / "bomb.tar.zst"
    blob.write_bytes(zstd_zeros_frame(inflated, head))
    return layout_of(root / "layout", [(blob, "zstd")] * listed)


def long_symlink_tar(length: int) -> bytes:
    """A symlink whose target (a PAX linkpath) is ``length`` bytes of ``a/``."""
    target = (b"a/" * (length // 2 + 1))[:length]
    return (pax({b"linkpath": target}) + header(b"usr/local/lib/python3.11", 0, b"2")
            + END)


def long_path_config(entries: int) -> dict:
    dirs = ":".join(f"/opt/d{i}" for i in range(entries))
    return {"Env": [f"PATH={dirs}:/usr/bin", f"LD_LIBRARY_PATH={dirs}",
                    f"PYTHONPATH={dirs}"]}


# --- point 11: crashes and digests ------------------------------------------------------

def deep_whiteout_layers(root: Path, depth: int) -> Path:
    """Layer 0: a directory ``depth`` levels deep; layer 1: an opaque whiteout at its
    top (the merge walked it recursively: RecursionError past ~1,000 levels)."""
    deep = b"/".join([b"a"] * depth)
    (root / "l").mkdir(parents=True, exist_ok=True)
    low = layer_file(root / "l" / "low.tar", regular(deep + b"/f", b"x") + END)
    high = layer_file(root / "l" / "high.tar",
                      regular(b"a/.wh..wh..opq", b"") + regular(b"a/new", b"y") + END)
    return layout_of(root / "layout", [low, high])


def non_utf8_names_tar() -> bytes:
    """Names that are not UTF-8, one of them a loader the diagnosis reads and notes
    (over the probe's 1 MiB read)."""
    site = b"usr/local/lib/python3.11/dist-packages/"
    return (regular(site + b"mooncake/\xff\xfe.py", b"#" * ((1 << 20) + 10))
            + regular(b"usr/lib/lib\xe9.so", b"not an elf") + END)


def elf_with_strsz(strsz: int) -> bytes:
    """An ELF64 shared object whose DT_STRSZ is ``strsz`` (2^64-1: MemoryError or
    OverflowError in a reader that trusts it)."""
    ph_off, dyn_off, str_off = 64, 64 + 2 * 56, 64 + 2 * 56 + 4 * 16
    strtab = b"\x00libfoo.so.1\x00"
    size = str_off + len(strtab)
    ehdr = bytearray(64)
    ehdr[0:16] = b"\x7fELF\x02\x01\x01" + b"\x00" * 9
    struct.pack_into("<HHIQQQIHHHHHH", ehdr, 16, 3, 62, 1, 0, ph_off, 0, 0, 64, 56, 2, 0,
                     0, 0)
    load = struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, size, size, 0x1000)
    dyn = struct.pack("<IIQQQQQQ", 2, 6, dyn_off, dyn_off, dyn_off, 64, 64, 8)
    entries = struct.pack("<qQqQqQqQ", 1, 1, 5, str_off, 10, strsz, 0, 0)
    return bytes(ehdr) + load + dyn + entries + strtab


def docker_archive(root: Path, *, forge_name: str | None = None) -> Path:
    """``docker save``'s layout as a tar; ``forge_name``: the config file renamed to
    that digest (its content unchanged)."""
    (root / "l").mkdir(parents=True, exist_ok=True)
    layer = layer_file(root / "l" / "layer.tar", regular(b"etc/hostname", b"x\n") + END)
    d = write_docker(root / "docker", ImageSpec("registry.example/x:1", [layer], {}))
    if forge_name is not None:
        manifest = json.loads((d / "manifest.json").read_text())
        old = d / manifest[0]["Config"]
        new = d / f"{forge_name}.json"
        old.rename(new)
        manifest[0]["Config"] = new.name
        (d / "manifest.json").write_text(json.dumps(manifest))
    return pack(d, root / "image.docker.tar")


def _blob(layout: Path, data: bytes) -> str:
    hexd = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / hexd).write_bytes(data)
    return f"sha256:{hexd}"


def multi_platform_layout(root: Path) -> tuple[Path, str, str]:
    """A layout whose index.json names one image index (two platforms), as `skopeo copy
    --all` writes it. Returns (layout, index digest, linux/amd64 manifest digest)."""
    (root / "l").mkdir(parents=True, exist_ok=True)
    layer = layer_file(root / "l" / "layer.tar", regular(b"etc/hostname", b"x\n") + END)
    layout = layout_of(root / "layout", [layer], ref="multi:1")
    index = json.loads((layout / "index.json").read_text())
    amd64 = index["manifests"][0]["digest"]
    manifest = (layout / "blobs" / "sha256" / amd64[7:]).read_bytes()
    arm = json.loads(manifest)
    arm["annotations"] = {"platform": "arm64"}
    arm64 = _blob(layout, json.dumps(arm).encode())
    image_index = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": arm64,
             "size": 1, "platform": {"os": "linux", "architecture": "arm64"}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": amd64,
             "size": len(manifest), "platform": {"os": "linux", "architecture": "amd64"}},
        ]}).encode()
    digest = _blob(layout, image_index)
    index["manifests"] = [{"mediaType": "application/vnd.oci.image.index.v1+json",
                           "digest": digest, "size": len(image_index),
                           "annotations": {"org.opencontainers.image.ref.name": "multi:1"}}]
    (layout / "index.json").write_text(json.dumps(index))
    return layout, digest, amd64


def tar_of(entries: list[tuple[str, bytes]]) -> bytes:
    """An ordinary tar of regular files (tarfile writes it)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in entries:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    return out.getvalue()
