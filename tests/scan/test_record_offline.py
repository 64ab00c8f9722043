"""`epguard scan --record` before and without the API server: what is refused as bad
input (exit 2, nothing sent), what the record says, how the webhook words it, and
exit 3 when no API server answers. The path through a real API server, with the
allowed and a forbidden ServiceAccount, is tests/e2e/test_scan_record.py."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from epguard.webhook.engine import policy
from epguard.webhook.engine.imageref import parse
from epguard.webhook.engine.verdicts import (
    MAX_VERSION,
    SOURCE_SCAN,
    VerdictStore,
    verdict_from_object,
)
from epguard.webhook.scan import record, scanner
from tests.scan.imagebuild import ImageSpec, compress, pack, write_layer, write_layout
from tests.scan.scan_harness import Pieces, mooncake_spec, scan

pytestmark = pytest.mark.realpkg

NOW = dt.datetime(2026, 12, 2, 6, 0, tzinfo=dt.UTC)
IMAGE = "registry.example/team/sglang:0.5.18-mte0.3.10"
WHO = "system:serviceaccount:ci:image-scanner"


@pytest.fixture(scope="module")
def bad(pieces: Pieces, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An OCI archive whose mooncake (0.3.10) has no extension for torch 2.13."""
    d = tmp_path_factory.mktemp("record")
    gz = compress(write_layer(d / "m.tar", mooncake_spec("mte-cuda13-0.3.10")), "gzip")
    write_layout(d / "layout", [ImageSpec("t:1", [(pieces.torch, "none"), (gz, "gzip")], {})])
    return pack(d / "layout", d / "bad.oci.tar")


@pytest.fixture(scope="module")
def result(bad: Path) -> scanner.Result:
    return scanner.scan(str(bad))


def test_record_without_image_is_bad_input_and_sends_nothing(bad: Path) -> None:
    r = scan(bad, "--record", "--kubeconfig", "/nonexistent")
    assert r.rc == 2
    assert "--record needs --image REF" in r.stderr


def test_an_image_pinned_to_other_bytes_is_refused(bad: Path, result: scanner.Result) -> None:
    other = "sha256:" + "0" * 64
    r = scan(bad, "--record", "--image", f"{IMAGE}@{other}", "--kubeconfig", "/nonexistent")
    assert r.rc == 2
    assert f"--image pins {other}, but the scanned manifest is {result.digest}" in r.stderr


def test_a_root_filesystem_has_no_digest_to_record(tmp_path: Path) -> None:
    (tmp_path / "usr").mkdir()
    r = scan(tmp_path, "--record", "--image", IMAGE, "--kubeconfig", "/nonexistent")
    assert r.rc == 2
    assert "--record needs the image's manifest digest" in r.stderr


def test_a_malformed_image_reference_is_refused(bad: Path) -> None:
    r = scan(bad, "--record", "--image", "Not A Ref", "--kubeconfig", "/nonexistent")
    assert r.rc == 2 and "--image 'Not A Ref'" in r.stderr


def test_no_api_server_answering_is_exit_3_after_the_report(bad: Path, tmp_path: Path) -> None:
    # A kubeconfig for a port nothing listens on: the scan's report is still printed.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:9', "
        "insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    r = scan(bad, "--record", "--image", IMAGE, "--kubeconfig", str(kubeconfig))
    assert r.rc == 3, r.stderr
    assert r.stdout.startswith("epguard: mooncake elastic EP is unusable in this image")
    assert "epguard scan --record: not recorded: cannot reach the API server" in r.stderr


def test_the_record_names_the_digest_the_cause_and_the_caller(result: scanner.Result) -> None:
    subject = record.target(result, IMAGE)
    assert result.digest is not None
    assert subject.name == "scan-" + result.digest.replace(":", "-")
    assert subject.image == str(parse(IMAGE))
    spec = record.spec(result, subject, WHO, NOW)
    assert spec["verdict"] == "Unusable" and spec["source"] == SOURCE_SCAN
    assert spec["recordedBy"] == WHO and spec["digest"] == result.digest
    assert spec["reason"] == result.causes[0].cause.splitlines()[0]
    assert spec["fix"] and spec["count"] == 1 and spec["firstSeen"] == spec["lastSeen"]
    assert spec["versions"] == {"sglang": "none", "torch": result.versions["torch"],
                                "mooncake": "mooncake-transfer-engine-cuda13 0.3.10"}
    assert spec["report"].startswith("epguard: mooncake elastic EP is unusable in this image")
    again = record.spec(result, subject, WHO, NOW + dt.timedelta(hours=1), spec)
    assert again["count"] == 2 and again["firstSeen"] == spec["firstSeen"]
    assert again["lastSeen"] != spec["lastSeen"]


def test_an_image_claiming_a_huge_version_still_fits_the_crd(result: scanner.Result) -> None:
    huge = scanner.Result(**{**result.__dict__, "versions": {**result.versions,
                                                             "torch": "9" * 5000}})  # fmt: skip
    spec = record.spec(huge, record.target(result, IMAGE), WHO, NOW)
    assert len(spec["versions"]["torch"] or "") == MAX_VERSION


def test_a_passing_scan_has_no_verdict_to_write(result: scanner.Result) -> None:
    clean = scanner.Result(**{**result.__dict__, "causes": []})
    with pytest.raises(ValueError, match="records no verdict"):
        record.spec(clean, record.target(result, IMAGE), WHO, NOW)


def test_the_webhook_says_a_scan_found_it_and_who_recorded_it(result: scanner.Result) -> None:
    subject = record.target(result, IMAGE)
    obj = {"metadata": {"name": subject.name}, "spec": record.spec(result, subject, WHO, NOW)}
    v = verdict_from_object(obj)
    assert v is not None and v.from_scan and v.recorded_by == WHO
    store = VerdictStore()
    store.upsert(v)
    hit = store.lookup(parse(f"{IMAGE}@{result.digest}"), NOW)
    assert hit is not None and hit.trust == "deny" and hit.by_digest
    text = policy.verdict_denial(hit)
    assert f"found in the image's files by epguard scan, recorded by {WHO}" in text
    assert result.causes[0].cause.splitlines()[0].rstrip(".") in text
    assert record.spec(result, subject, WHO, NOW)["fix"].rstrip(".") in text
    assert f"[epguard verdict {subject.name}]" in text
    # By tag only: the same verdict, trusted while fresh.
    by_tag = store.lookup(parse(IMAGE), NOW + dt.timedelta(hours=1))
    assert by_tag is not None and by_tag.trust == "deny" and not by_tag.by_digest


def test_a_verdict_without_source_is_the_probes() -> None:
    v = verdict_from_object(
        {"metadata": {"name": "x"}, "spec": {"image": IMAGE, "verdict": "Unusable"}}
    )
    assert v is not None and not v.from_scan and v.recorded_by is None
