"""A tar reader that cannot loop, and the budget every scan runs under.

The interpreter's ``tarfile`` trusts a header's size: a member whose size is negative
(a PAX ``size=-1536`` record, or a base-256 size field with its sign bit set) makes it
read the same header again, forever (issue 21: a 2 KB archive spins a CPU in a layer
and grows memory to OOM in the outer archive), and it reads a PAX header or a GNU long
name whole, whatever size it claims. So ``epguard scan`` reads tar itself. Every header
is checked before it is used: checksum, type, each numeric field parsed as the digits
it may hold (linear, no regular expression), a size that is never negative, a PAX
header and a GNU long name no larger than their limits *before* a byte of them is
read, PAX records parsed by their length prefix. Every header moves the reader
forward by at least 512 bytes, so a finite archive has a finite number of them, and
every byte read is charged to :class:`Budget` (decompressed bytes and a deadline).

Which members carry data follows Go's ``archive/tar``, the reader container runtimes
use: directories, links, devices and FIFOs are header only, whatever size they claim.
A sparse member (GNU ``S``, PAX ``GNU.sparse.*``) is never expanded: its holes are not
read, and the scan keeps nothing of its contents.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

BLOCK = 512
# PATH_MAX on Linux, with its NUL: no longer name or symlink target can exist in a
# running container (symlink(2) and open(2) fail with ENAMETOOLONG).
MAX_NAME_BYTES = 4096
# A PAX extended header holds a path, a link target, times and a few xattrs (an
# SELinux label, file capabilities): a few KB. 1 MiB is far above that, and bounds
# what one header can make us hold; the size is checked before the header is read.
MAX_PAX_BYTES = 1 << 20
# A GNU ././@LongLink record holds one name and its NUL.
MAX_LONGNAME_BYTES = MAX_NAME_BYTES + 1
# Extension headers of one old-GNU sparse member: 21 regions each, so 2 million holes.
MAX_SPARSE_BLOCKS = 100_000
# One read of member data or of skipped bytes; bounds a read's memory.
CHUNK = 1 << 20
# Whole-scan defaults (epguard scan --timeout / --max-bytes). The real worker image
# (5.4 GB, 48,000 entries) scans in 8 s and reads ~5 GB of tar; the largest CUDA
# images hold ~30 GB uncompressed. 64 GiB and 10 minutes are far above both, and end
# a decompression bomb (a 4 KB zstd frame that inflates to 16 GiB, listed 20 times)
# or any other runaway input in bounded time, as bad input (exit 2).
DEFAULT_MAX_BYTES = 64 << 30
DEFAULT_TIMEOUT = 600.0

# Regular files: "0", the old "\0" (read as "0"), contiguous "7", GNU sparse "S".
_REGULAR = frozenset((b"0", b"7", b"S"))


class TarError(Exception):
    """Not a tar stream we will read: the message says which header and why."""


class BudgetError(Exception):
    """The scan went past its time or decompressed-bytes budget (exit 2)."""


class Budget:
    """What one scan may spend: bytes read out of layer tar streams (decompressed,
    headers and contents, read or skipped by reading) and wall-clock time."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.used = 0

    def charge(self, n: int) -> None:
        self.used += n
        if self.used > self.max_bytes:
            raise BudgetError(
                f"the layers hold more than {self.max_bytes} bytes of tar (decompressed): "
                f"over the --max-bytes budget (a decompression bomb, or raise the budget)")
        self.check()

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetError(f"the scan took more than {self.timeout:g} s: over the "
                              "--timeout budget")


def unlimited() -> Budget:
    return Budget(1 << 62, 1e9)


@dataclass(slots=True)
class Entry:
    """One member, with the attributes and tests of ``tarfile.TarInfo`` the tree uses."""

    name: str
    type: bytes  # one byte, as in the header ("0", "5", ...)
    size: int  # the file's size (a sparse file's real size)
    linkname: str = ""
    offset_data: int = 0  # where its stored bytes start in the stream
    stored: int = 0  # how many bytes are stored after the header
    sparse: bool = False

    def isreg(self) -> bool:
        return self.type in _REGULAR

    def isdir(self) -> bool:
        return self.type in (b"5", b"D")

    def issym(self) -> bool:
        return self.type == b"2"

    def islnk(self) -> bool:
        return self.type == b"1"


def octal(field: bytes, what: str) -> int:
    """A numeric header field: octal digits padded with spaces/NULs, or base-256
    (first byte 0x80). Negative base-256 (0xff) is refused. Linear in the field."""
    if field and field[0] & 0x80:
        if field[0] != 0x80:
            raise TarError(f"{what} is negative (base-256)")
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\x00", 1)[0].strip(b" ")
    if not digits:
        return 0
    for c in digits:
        if not 0x30 <= c <= 0x37:
            raise TarError(f"{what} is not an octal number: {digits[:24]!r}")
    return int(digits, 8)


def decimal(value: bytes, what: str) -> int:
    """A PAX number (``size``, ``GNU.sparse.realsize``): decimal digits, nothing else."""
    if not value or len(value) > 20 or not value.isdigit():
        raise TarError(f"{what} is not a non-negative decimal number: {value[:24]!r}")
    return int(value)


def text(raw: bytes) -> str:
    """A name as the scan keeps it: UTF-8, other bytes as ``\\xNN`` (printable, and
    never two different names merged into one)."""
    return raw.decode("utf-8", "backslashreplace")


def _cstr(raw: bytes) -> bytes:
    return raw.split(b"\x00", 1)[0]


def pax_records(buf: bytes) -> Iterator[tuple[bytes, bytes]]:
    """``"<len> <key>=<value>\\n"`` records, each read from its length prefix."""
    pos, n = 0, len(buf)
    while pos < n:
        if buf[pos] == 0:  # NUL padding after the last record
            break
        space = buf.find(b" ", pos, min(n, pos + 21))
        if space < 0:
            raise TarError("a PAX record without a length")
        length = decimal(buf[pos:space], "a PAX record's length")
        end = pos + length
        if length <= space - pos + 1 or end > n or buf[end - 1] != 0x0A:
            raise TarError("a PAX record whose length does not match its text")
        key, eq, value = buf[space + 1:end - 1].partition(b"=")
        if not eq:
            raise TarError("a PAX record without '='")
        yield key, value
        pos = end


# The PAX keywords the scan reads; any GNU.sparse.* one marks a sparse member. Only
# these are kept, so a run of PAX headers (or of global ones, which last to the end of
# the archive) holds at most these few values, each under MAX_PAX_BYTES.
_USED = frozenset((b"path", b"linkpath", b"size", b"GNU.sparse.realsize",
                   b"GNU.sparse.size", b"GNU.sparse.name"))
_SPARSE = b"GNU.sparse."


def _used(body: bytes) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    for key, value in pax_records(body):
        if key in _USED:
            out[key] = value
        elif key.startswith(_SPARSE):
            out[_SPARSE] = b""
    return out


class TarReader:
    """Members of one tar stream, in order. ``seekable`` streams (an uncompressed
    layer or archive on disk, of known ``length``) skip contents by seeking; others
    read and drop them, charged to the budget."""

    def __init__(self, f: IO[bytes], budget: Budget, *, seekable: bool,
                 length: int | None = None, what: str = "the archive") -> None:
        self._f = f
        self._budget = budget
        self._seekable = seekable
        self._length = length
        self._what = what
        self._pos = 0  # offset of the next unread byte of the stream
        self._next = 0  # offset of the next header
        self._globals: dict[bytes, bytes] = {}

    # --- raw reads --------------------------------------------------------------------

    def _read(self, n: int) -> bytes:
        """Exactly ``n`` bytes at the current position (fewer only at the end)."""
        self._budget.charge(n)
        parts, got = [], 0
        while got < n:
            chunk = self._f.read(min(CHUNK, n - got))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        self._pos += got
        return b"".join(parts)

    def _skip_to(self, offset: int) -> None:
        if offset < self._pos:
            raise TarError("internal: a backward skip")  # never: members are in order
        if self._seekable:
            if self._length is not None and offset > self._length:
                raise TarError(f"{self._what} is truncated: a member's contents run past "
                               "its end")
            self._f.seek(offset)
            self._pos = offset
            self._budget.check()
            return
        while self._pos < offset:
            want = min(CHUNK, offset - self._pos)
            self._budget.charge(want)
            chunk = self._f.read(want)
            if not chunk:
                raise TarError(f"{self._what} is truncated: it ends inside a member")
            self._pos += len(chunk)

    def _exact(self, n: int, what: str) -> bytes:
        data = self._read(n)
        if len(data) != n:
            raise TarError(f"{self._what} is truncated: it ends inside {what}")
        return data

    # --- members ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Entry]:
        while True:
            entry = self._header()
            if entry is None:
                return
            yield entry

    def _block(self) -> bytes | None:
        """The next header block; None at the end of the archive."""
        self._skip_to(self._next)
        block = self._read(BLOCK)
        if not block:
            # Every tar writer (Go's archive/tar, GNU tar, Python's tarfile) ends with
            # zero blocks; a stream that stops at a header boundary was cut there (a
            # zstd frame cut inside its first block decompresses to nothing at all).
            raise TarError(f"{self._what} is truncated: it ends without the end-of-archive "
                           "blocks")
        if block == bytes(len(block)):
            return None  # end-of-archive
        if len(block) < BLOCK:
            raise TarError(f"{self._what} is truncated: it ends inside a header")
        stored = octal(block[148:156], "a header's checksum")
        rest = block[:148] + block[156:]
        unsigned = sum(rest) + 8 * 0x20  # the checksum field counts as spaces
        signed = unsigned - 256 * (len(rest) - len(rest.translate(None, _HIGH)))
        if stored not in (unsigned, signed):
            raise TarError(f"{self._what}: a header at offset {self._pos - BLOCK} has a bad "
                           "checksum (not a tar stream, or corrupt)")
        return block

    def _header(self) -> Entry | None:
        longname: bytes | None = None
        longlink: bytes | None = None
        pax: dict[bytes, bytes] = {}
        while True:
            block = self._block()
            if block is None:
                return None
            at = self._pos - BLOCK
            kind = block[156:157]
            size = octal(block[124:136], f"the size of the header at offset {at}")
            data_at = self._pos
            if kind in (b"x", b"g", b"L", b"K"):
                limit = MAX_PAX_BYTES if kind in (b"x", b"g") else MAX_LONGNAME_BYTES
                name = "PAX header" if kind in (b"x", b"g") else "GNU long name"
                if size > limit:
                    raise TarError(f"{self._what}: a {name} of {size} bytes at offset {at}, "
                                   f"over the {limit} read")
                body = self._exact(size, f"a {name}")
                self._next = data_at + _padded(size)
                if kind == b"x":
                    pax.update(_used(body))
                elif kind == b"g":
                    self._globals.update(_used(body))
                elif kind == b"L":
                    longname = _cstr(body)
                else:
                    longlink = _cstr(body)
                continue
            if kind == b"S" and block[482]:
                data_at = self._sparse_extensions()
            return self._entry(block, kind, size, data_at, {**self._globals, **pax},
                               longname, longlink)

    def _sparse_extensions(self) -> int:
        """Skip an old GNU sparse member's extension headers (21 regions each, a flag
        at byte 504 says another follows); returns where its data starts."""
        for _ in range(MAX_SPARSE_BLOCKS):
            ext = self._exact(BLOCK, "a sparse header")
            if not ext[504]:
                return self._pos
        raise TarError(f"{self._what}: a sparse member with more than "
                       f"{MAX_SPARSE_BLOCKS} extension headers")

    def _entry(self, block: bytes, kind: bytes, size: int, data_at: int,
               pax: dict[bytes, bytes], longname: bytes | None,
               longlink: bytes | None) -> Entry:
        at = data_at - BLOCK
        if kind == b"M":
            raise TarError(f"{self._what}: a multi-volume member at offset {at}")
        raw_name = _cstr(block[0:100])
        if block[257:263] == b"ustar\x00":  # POSIX: a prefix field before the name
            prefix = _cstr(block[345:500])
            if prefix:
                raw_name = prefix + b"/" + raw_name
        if longname is not None:
            raw_name = longname
        raw_link = longlink if longlink is not None else _cstr(block[157:257])
        if b"path" in pax:
            raw_name = pax[b"path"]
        if b"linkpath" in pax:
            raw_link = pax[b"linkpath"]
        for what, raw in (("name", raw_name), ("link target", raw_link)):
            if len(raw) > MAX_NAME_BYTES:
                raise TarError(f"{self._what}: an entry's {what} of {len(raw)} bytes at "
                               f"offset {at}, over PATH_MAX ({MAX_NAME_BYTES})")
        stored = size
        if b"size" in pax:
            stored = decimal(pax[b"size"], f"the PAX size at offset {at}")
        sparse = kind == b"S" or any(k.startswith(b"GNU.sparse.") for k in pax)
        real = stored
        if kind == b"S":
            real = octal(block[483:495], f"the sparse real size at offset {at}")
        for key in (b"GNU.sparse.realsize", b"GNU.sparse.size"):
            if key in pax:
                real = decimal(pax[key], f"the PAX {key.decode()} at offset {at}")
        if b"GNU.sparse.name" in pax:
            raw_name = pax[b"GNU.sparse.name"]
            if len(raw_name) > MAX_NAME_BYTES:
                raise TarError(f"{self._what}: an entry's name over PATH_MAX at offset {at}")
        if kind in (b"1", b"2", b"3", b"4", b"5", b"6"):
            stored = 0  # header only, as Go's archive/tar reads them
        self._next = data_at + _padded(stored)
        if self._seekable and self._length is not None and data_at + stored > self._length:
            raise TarError(f"{self._what} is truncated: {text(raw_name[:200])!r} runs past "
                           "its end")
        entry_type = b"0" if kind == b"\x00" else kind
        return Entry(text(raw_name), entry_type, real, text(raw_link), data_at, stored, sparse)

    def data(self, entry: Entry) -> IO[bytes]:
        """The stored contents of ``entry`` (the current member), read forward only."""
        if entry.offset_data != self._pos and not self._seekable:
            raise TarError("internal: contents of a member already passed")
        if self._seekable:
            self._f.seek(entry.offset_data)
            self._pos = entry.offset_data
        return io.BufferedReader(_Contents(self, entry.stored), buffer_size=CHUNK)


_HIGH = bytes(range(0x80, 0x100))


def _padded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


class _Contents(io.RawIOBase):
    """At most ``size`` bytes of the member at the reader's position; every read is
    charged to the budget and no read is larger than :data:`CHUNK`."""

    def __init__(self, reader: TarReader, size: int) -> None:
        self._r = reader
        self._left = size

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._left, CHUNK)
        if n <= 0:
            return 0
        data = self._r._read(n)
        if not data:
            raise TarError(f"{self._r._what} is truncated: it ends inside a member")
        b[:len(data)] = data
        self._left -= len(data)
        return len(data)
