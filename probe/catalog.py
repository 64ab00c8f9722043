"""Published mooncake wheels and the torch releases their PG extensions were built for.

Read from the cp311 x86_64 wheels on PyPI (shared/domain-facts.md, Table 2). Used
only to word the fix ("install X==Y, which ships pg_2_13_0 for CUDA 13"); the
verdict itself always comes from what is installed and what the import does.
"""

CUDA12 = "mooncake-transfer-engine"
CUDA13 = "mooncake-transfer-engine-cuda13"

_T9 = ("2.9.0", "2.9.1", "2.10.0")
_T11 = ("2.9.1", "2.10.0", "2.11.0", "2.12.0")
_T12 = ("2.11.0", "2.12.0", "2.12.1")
_T13 = ("2.11.0", "2.12.0", "2.12.1", "2.13.0")

# (distribution, version, torch versions with a prebuilt pg_* module), oldest first.
WHEELS = (
    (CUDA12, "0.3.9", _T9),
    (CUDA12, "0.3.10", _T9),
    (CUDA12, "0.3.10.post2", _T9 + ("2.11.0",)),
    (CUDA12, "0.3.11", _T11),
    (CUDA12, "0.3.11.post1", _T11),
    (CUDA12, "0.3.12", _T12),
    (CUDA12, "0.3.12.post1", _T13),
    (CUDA12, "0.3.13", _T13),
    (CUDA12, "0.3.13.post1", _T13),
    (CUDA13, "0.3.10", _T9),
    (CUDA13, "0.3.11", _T11),
    (CUDA13, "0.3.12.post1", _T13),
    (CUDA13, "0.3.13.post1", _T13),
)
# cuda13 0.3.14 builds its adapter for any torch by JIT on first import.
JIT_WHEEL = (CUDA13, "0.3.14")
# SGLang >= 0.5.17 imports mooncake.pg.set_transfer_engine, added in 0.3.11.
SET_TRANSFER_ENGINE_SINCE = "0.3.11"


def _vkey(v):
    out = []
    for part in v.replace(".post", ".").split("."):
        out.append(int(part) if part.isascii() and part.isdigit() else 0)  # not "²"
    return tuple(out)


def dist_for_cuda(major):
    return CUDA13 if major == 13 else CUDA12


def wheel_for(torch_version, cuda_major, need_set_transfer_engine=False):
    """Newest ``dist==version`` that ships pg_<torch_version> for ``cuda_major``; or None."""
    dist = dist_for_cuda(cuda_major)
    best = None
    for d, v, torches in WHEELS:
        if d != dist or torch_version not in torches:
            continue
        if need_set_transfer_engine and _vkey(v) < _vkey(SET_TRANSFER_ENGINE_SINCE):
            continue
        best = v
    return f"{dist}=={best}" if best else None
