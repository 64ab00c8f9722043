"""Which mooncake module and names SGLang imports, read from its sources as text."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from epguard.probe import requirement
from tests.probe.probe_harness import REPO, SGLANG_EP, SGLANG_PG, clean_env, overlay


def scan(src: str) -> dict[str, set[str]]:
    return requirement.scan_source(textwrap.dedent(src))


# --- both spellings ---------------------------------------------------------------------


def test_reads_from_mooncake_import_ep_as_alias_and_its_attributes():
    # SGLang <= 0.5.16: `from mooncake import ep as mooncake_ep` then mooncake_ep.set_host_ip(...)
    found = scan("""
        def init():
            from mooncake import ep as mooncake_ep
            mooncake_ep.set_host_ip("1.2.3.4")
            mooncake_ep.set_device_filter(["mlx5_0"])
    """)
    assert found == {"mooncake.ep": {"set_host_ip", "set_device_filter"}}


def test_reads_from_mooncake_pg_import_names_including_parenthesised_lists():
    found = scan("""
        from mooncake.pg import (
            get_peer_state,
            recover_ranks as _recover,
        )
        from mooncake.pg import set_transfer_engine
    """)
    assert found == {"mooncake.pg": {"get_peer_state", "recover_ranks", "set_transfer_engine"}}


def test_reads_plain_import_of_the_dotted_module():
    found = scan("""
        import mooncake.pg
        import mooncake.ep as mep
        mooncake.pg.join_group(g)
        mep.MooncakeBackendOptions
    """)
    assert found == {"mooncake.pg": {"join_group"}, "mooncake.ep": {"MooncakeBackendOptions"}}


def test_other_mooncake_modules_are_not_the_elastic_ep_requirement():
    found = scan("""
        from mooncake.engine import TransferEngine
        from mooncake import store
        from mooncake.mooncake_ep_buffer import Buffer
    """)
    assert found == {}


def test_reads_imports_even_when_the_whole_file_does_not_parse():
    found = scan("""
        from mooncake.pg import set_transfer_engine, join_group
        def broken(:
    """)
    assert found == {"mooncake.pg": {"set_transfer_engine", "join_group"}}


# --- real SGLang releases and odd installs -------------------------------------------------


def requirement_in(pythonpath) -> dict:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from probe import requirement; "
        "r = requirement.requirement(); print(json.dumps(dict(version=r.version, "
        "modules=r.modules, names=r.names, either=r.either, source=r.source)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO)],
        capture_output=True,
        text=True,
        check=True,
        env=clean_env(pythonpath),
    ).stdout
    return json.loads(out)


@pytest.mark.realpkg
@pytest.mark.parametrize("sglang", SGLANG_EP + SGLANG_PG)
def test_real_releases_switch_from_ep_to_pg_at_0_5_17(sglang):
    r = requirement_in([overlay(sglang)])
    assert r["version"] == sglang.split("-", 1)[1]
    assert not r["either"]
    if sglang in SGLANG_EP:
        assert r["modules"] == ["mooncake.ep"]
        assert {"MooncakeBackendOptions", "set_host_ip"} <= set(r["names"]["mooncake.ep"])
    else:
        assert r["modules"] == ["mooncake.pg"]
        assert {"MooncakeBackendOptions", "set_transfer_engine", "join_group"} <= set(
            r["names"]["mooncake.pg"]
        )


def test_unreadable_sglang_sources_accept_either_module(tmp_path):
    # A stripped image (only .pyc) or an unknown layout: fall back like Dynamo does.
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    info = tmp_path / "sglang-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 9.9.9\n\n")
    r = requirement_in([tmp_path])
    assert r["version"] == "9.9.9"
    assert r["either"]
    assert r["modules"] == ["mooncake.pg", "mooncake.ep"]
    assert "unreadable" in r["source"]


def test_no_sglang_accepts_either_module(tmp_path):
    r = requirement_in([tmp_path])
    assert r["version"] is None
    assert r["either"]


def test_never_imports_sglang(tmp_path):
    # SGLang's import is slow and may be the broken part: only its files are read.
    marker = tmp_path / "sglang-was-imported"
    pkg = tmp_path / "sglang"
    (pkg / "srt" / "distributed").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "srt" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "srt" / "distributed" / "parallel_state.py").write_text(
        "def f():\n    from mooncake.pg import MooncakeBackendOptions\n"
    )
    r = requirement_in([tmp_path])
    assert r["modules"] == ["mooncake.pg"]
    assert r["names"] == {"mooncake.pg": ["MooncakeBackendOptions"]}
    assert not marker.exists()
