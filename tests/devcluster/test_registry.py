"""The node registry: the model layer is a valid, deterministic tar, the access log is
counted as the registry writes it, and (a real docker-registry on loopback) archives are
pushed byte for byte and a replaced tag collected. Pulls through containerd and image
volumes are exercised on the node (tests/devcluster/test_node.py,
tests/e2e/test_preflight_on_node.py read this log after real pulls)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from devcluster import ociimage, registry
from devcluster.node import stale_images
from devcluster.pki import CertificateAuthority
from devcluster.process import ManagedProcess, free_port
from devcluster.registry import BlobServed, Registry

# Access lines as docker-registry 2.8 writes them (combined format), between its own
# `time=... level=...` lines, from a real pull of the model on the node.
LOG = """\
time="2026-12-03T06:40:13Z" level=info msg="listening on 192.0.2.2:5000, tls"
192.0.2.2 - - [03/Dec/2026:06:40:13 +0000] "GET /v2/ HTTP/1.1" 200 2 "" ""
192.0.2.2 - - [03/Dec/2026:06:41:02 +0000] "HEAD /v2/models/sglang-weights/manifests/1 HTTP/1.1" 200 420 "" "containerd/v2.4.2"
192.0.2.2 - - [03/Dec/2026:06:41:02 +0000] "GET /v2/models/sglang-weights/manifests/sha256:3e23 HTTP/1.1" 200 420 "" "containerd/v2.4.2"
192.0.2.2 - - [03/Dec/2026:06:41:02 +0000] "GET /v2/models/sglang-weights/blobs/sha256:1594 HTTP/1.1" 200 173 "" "containerd/v2.4.2"
time="2026-12-03T06:41:02Z" level=info msg="response completed" http.request.method=GET
192.0.2.2 - - [03/Dec/2026:06:41:02 +0000] "GET /v2/models/sglang-weights/blobs/sha256:8886 HTTP/1.1" 200 1073745920 "" "containerd/v2.4.2"
192.0.2.2 - - [03/Dec/2026:06:41:09 +0000] "HEAD /v2/models/sglang-weights/blobs/sha256:8886 HTTP/1.1" 200 1073745920 "" "containerd/v2.4.2"
192.0.2.2 - - [03/Dec/2026:06:41:09 +0000] "GET /v2/models/sglang-weights/blobs/sha256:dead HTTP/1.1" 404 157 "" "containerd/v2.4.2"
192.0.2.2 - - [03/Dec/2026:14:05:33 +0000] "GET /v2/epguard/busybox/blobs/sha256:bdd8?ns=localhost HTTP/1.1" 200 1031415 "" "containerd/v2.4.2"
"""  # noqa: E501


@pytest.fixture
def small_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real layer's shape with 2 MiB shards (the node writes 256 MiB ones)."""
    monkeypatch.setattr(registry, "SHARD_BYTES", 2 << 20)


def test_the_access_log_counts_blob_gets_only_and_their_bytes(tmp_path: Path) -> None:
    reg = Registry(tmp_path, "192.0.2.2")
    reg.log.write_text(LOG)
    assert reg.blob_gets() == {
        "sha256:1594": BlobServed(1, 173),
        "sha256:8886": BlobServed(1, 1073745920),
        "sha256:bdd8": BlobServed(1, 1031415),  # pulled by its localhost/... name
    }


def test_what_was_served_after_an_offset_is_counted_from_there(tmp_path: Path) -> None:
    reg = Registry(tmp_path, "192.0.2.2")
    assert reg.log_offset() == 0 and reg.blob_gets() == {}  # no log yet
    reg.log.write_text(LOG)
    since = reg.log_offset()
    with reg.log.open("a") as f:
        f.write(LOG)
    assert reg.blob_gets(since)["sha256:8886"] == BlobServed(1, 1073745920)
    assert reg.blob_gets()["sha256:8886"] == BlobServed(2, 2 * 1073745920)


@pytest.mark.usefixtures("small_model")
def test_the_model_layer_is_a_tar_of_the_shards_at_its_root() -> None:
    data = b"".join(registry.model_layer())
    assert len(data) % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names == [f"shard-{i:03d}.bin" for i in range(registry.MODEL_SHARDS)] + [
            "config.json"
        ]
        assert all(m.isfile() and m.uid == 0 and m.mtime == 0 for m in members)
        shards = [tar.extractfile(m).read() for m in members[:-1]]  # type: ignore[union-attr]
    assert all(len(s) == 2 << 20 for s in shards)
    assert len({hashlib.sha256(s).digest() for s in shards}) == registry.MODEL_SHARDS


@pytest.mark.usefixtures("small_model")
def test_the_model_layer_has_the_same_bytes_on_every_run() -> None:
    first = hashlib.sha256(b"".join(registry.model_layer())).hexdigest()
    assert hashlib.sha256(b"".join(registry.model_layer())).hexdigest() == first


def test_containerd_trusts_the_registry_by_its_hosts_file_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not registry.REGISTRY_BIN.is_file():
        pytest.skip("docker-registry is not installed (make tools installs it)")
    monkeypatch.setenv("EPGUARD_CACHE", str(tmp_path / "cache"))
    reg = Registry(tmp_path / "reg", "192.0.2.2")
    argv = reg.prepare(CertificateAuthority())
    assert argv[-1] == str(tmp_path / "reg" / "config.yml")
    hosts = (reg.hosts_dir / "192.0.2.2:5000" / "hosts.toml").read_text()
    assert 'server = "https://192.0.2.2:5000"' in hosts
    assert f'ca = "{reg.ca_file}"' in hosts
    assert reg.ca_file.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")


def test_the_private_registry_refuses_every_pull_without_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's second registry: what a namespace without the pull secret meets. A
    real docker-registry process on loopback: /v2/ and a manifest answer 401 with a
    token challenge, and it keeps nothing in the shared cache."""
    if not registry.REGISTRY_BIN.is_file():
        pytest.skip("docker-registry is not installed (make tools installs it)")
    monkeypatch.setenv("EPGUARD_CACHE", str(tmp_path / "cache"))
    port = free_port()
    reg = Registry(tmp_path / "private", "127.0.0.1", port, private=True)
    public = Registry(tmp_path / "reg", "127.0.0.1")
    assert reg.hosts_dir == public.hosts_dir  # containerd reads one config_path
    proc = ManagedProcess.spawn("private", reg.prepare(CertificateAuthority()), reg.log)
    try:
        reg.wait_ready(proc)
        status, headers, _ = reg.request("HEAD", "/v2/team/sglang-private/manifests/1")
        assert status == 401
        assert headers["WWW-Authenticate"].startswith("Bearer realm=")
        status, _, _ = reg.request("GET", "/v2/", headers={"Authorization": "Bearer x"})
        assert status == 200  # the header is all it checks: credentials make the difference
    finally:
        proc.stop()
    assert reg.storage.is_relative_to(tmp_path / "private")
    assert not (tmp_path / "cache" / "registry").exists()
    hosts = (reg.hosts_dir / f"127.0.0.1:{port}" / "hosts.toml").read_text()
    assert f'server = "https://127.0.0.1:{port}"' in hosts


def test_a_public_registry_also_serves_the_images_named_localhost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not registry.REGISTRY_BIN.is_file():
        pytest.skip("docker-registry is not installed (make tools installs it)")
    monkeypatch.setenv("EPGUARD_CACHE", str(tmp_path / "cache"))
    reg = Registry(tmp_path / "reg", "192.0.2.2")
    reg.prepare(CertificateAuthority())
    local = (reg.hosts_dir / registry.LOCAL_HOST / "hosts.toml").read_text()
    assert local == (reg.hosts_dir / "192.0.2.2:5000" / "hosts.toml").read_text()
    private = Registry(tmp_path / "private", "192.0.2.2", registry.PRIVATE_PORT, private=True)
    (reg.hosts_dir / registry.LOCAL_HOST / "hosts.toml").unlink()
    private.prepare(CertificateAuthority())
    assert not (reg.hosts_dir / registry.LOCAL_HOST / "hosts.toml").exists()


@pytest.mark.parametrize(
    "name", ["docker.io/library/busybox:1", "localhost/epguard/busybox", "localhost:5000/a:1",
             "localhost/a@sha256:00", "epguard/busybox:1"],
)  # fmt: skip
def test_only_an_image_named_localhost_repository_tag_is_pushed(name: str) -> None:
    with pytest.raises(registry.RegistryError, match="not an image built here"):
        registry.local_repository(name)


def _archive(path: Path, ref: str, payload: bytes) -> str:
    big = path.with_suffix(".layer.tar")  # a file layer, as the workers' torch layer is
    big.write_bytes(ociimage.layer_from_files([ociimage.LayerFile("data/big", payload)]))
    small = ociimage.layer_from_files([ociimage.LayerFile("etc/ref", ref.encode(), 0o644)])
    return ociimage.write_archive(path, ref, [small, big], {"Cmd": ["/bin/sh"]})


def test_an_archive_is_pushed_byte_for_byte_once_and_a_replaced_tag_is_collected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real docker-registry on loopback: the manifest it serves has the archive's
    digest, a second push sends no blob, and after the tag is pushed again from a
    rebuilt archive the garbage collection removes only the old image's blobs."""
    if not registry.REGISTRY_BIN.is_file():
        pytest.skip("docker-registry is not installed (make tools installs it)")
    monkeypatch.setenv("EPGUARD_CACHE", str(tmp_path / "cache"))
    port = free_port()
    reg = Registry(tmp_path / "reg", "127.0.0.1", port)
    ca = CertificateAuthority()

    def serve() -> ManagedProcess:
        proc = ManagedProcess.spawn("registry", reg.prepare(ca), reg.log)
        reg.wait_ready(proc)
        return proc

    first = _archive(tmp_path / "v1.oci.tar", "localhost/epguard/tool:dev", b"1" * (3 << 20))
    proc = serve()
    try:
        assert reg.push_archive(tmp_path / "v1.oci.tar") == {"localhost/epguard/tool:dev": first}
        assert reg.manifest_digest("epguard/tool", "dev") == first
        status, _, body = reg.request("GET", f"/v2/epguard/tool/manifests/{first}",
                                      headers={"Accept": registry.MANIFEST_TYPE})  # fmt: skip
        assert status == 200 and "sha256:" + hashlib.sha256(body).hexdigest() == first
        old_layers = [d["digest"] for d in json.loads(body)["layers"]]
        uploads = reg.log.read_text().count('"POST /v2/epguard/tool/blobs/uploads/')
        assert uploads == 3  # config and two layers
        reg.push_archive(tmp_path / "v1.oci.tar")
        assert reg.log.read_text().count('"POST /v2/epguard/tool/blobs/uploads/') == uploads
        assert reg.tag("localhost/epguard/tool:dev", "localhost/epguard/tool:alias") == first
        assert reg.manifest_digest("epguard/tool", "alias") == first
        assert reg.log.read_text().count('"POST /v2/epguard/tool/blobs/uploads/') == uploads
        with pytest.raises(registry.RegistryError, match="not in the repository"):
            reg.tag("localhost/epguard/tool:dev", "localhost/epguard/other:alias")
        second = _archive(tmp_path / "v2.oci.tar", "localhost/epguard/tool:dev", b"2" * (3 << 20))
        assert reg.push_archive(tmp_path / "v2.oci.tar") == {"localhost/epguard/tool:dev": second}
        assert reg.manifest_digest("epguard/tool", "dev") == second
    finally:
        proc.stop()
    blobs = reg.storage / "docker" / "registry" / "v2" / "blobs" / "sha256"
    assert (blobs / old_layers[1][7:9] / old_layers[1][7:]).is_dir()
    reg.collect_garbage()
    assert (blobs / old_layers[1][7:9] / old_layers[1][7:]).is_dir()  # the alias names it
    tags = reg.storage / "docker" / "registry" / "v2" / "repositories" / "epguard" / "tool"
    shutil.rmtree(tags / "_manifests" / "tags" / "alias")  # what a tag delete would do
    reg.collect_garbage()
    assert not (blobs / old_layers[1][7:9] / old_layers[1][7:]).exists()
    assert not (blobs / first[7:9] / first[7:]).exists()
    assert (blobs / second[7:9] / second[7:]).is_dir()
    assert (blobs / old_layers[0][7:9] / old_layers[0][7:]).is_dir()  # shared by v2
    proc = serve()
    try:
        assert reg.manifest_digest("epguard/tool", "dev") == second
    finally:
        proc.stop()


def test_an_empty_storage_has_nothing_to_collect_and_the_registry_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh cache: the node's first start collects before anything was ever pushed.
    The real collector fails on an empty storage ("Path not found:
    /docker/registry/v2/repositories"), which stopped every node start on a fresh
    machine; with nothing to collect there is nothing to run."""
    if not registry.REGISTRY_BIN.is_file():
        pytest.skip("docker-registry is not installed (make tools installs it)")
    monkeypatch.setenv("EPGUARD_CACHE", str(tmp_path / "cache"))
    reg = Registry(tmp_path / "reg", "127.0.0.1", free_port())
    argv = reg.prepare(CertificateAuthority())
    assert not (reg.storage / "docker" / "registry" / "v2" / "repositories").exists()
    reg.collect_garbage()
    proc = ManagedProcess.spawn("registry", argv, reg.log)
    try:
        reg.wait_ready(proc)
    finally:
        proc.stop()


def test_every_image_the_node_runs_has_a_place_in_the_registry() -> None:
    from devcluster.images import BUSYBOX_IMAGE, EPGUARD_IMAGE, WORKER_IMAGES
    from devcluster.node import PAUSE_IMAGE

    refs = [PAUSE_IMAGE, BUSYBOX_IMAGE, EPGUARD_IMAGE, *(w.ref for w in WORKER_IMAGES)]
    places = [registry.local_repository(ref) for ref in refs]
    assert ("epguard/sglang", "0.5.23-mte0.3.13") in places
    assert [f"localhost/{repo}:{tag}" for repo, tag in places] == refs


def test_an_image_held_imported_or_at_another_digest_is_pulled_again() -> None:
    new, old = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    pushed = {"localhost/epguard/epguard:dev": new, "localhost/epguard/busybox:1": new,
              "localhost/epguard/pause:3.10": new, "localhost/epguard/sglang:a": new}  # fmt: skip
    held = {
        "localhost/epguard/epguard:dev": old,  # rebuilt since
        "localhost/epguard/epguard@" + old: old,
        "localhost/epguard/busybox:1": new,  # pulled: its repository@digest name is there
        "localhost/epguard/busybox@" + new: new,
        "localhost/epguard/pause:3.10": new,  # imported by an older checkout: no such name
    }
    assert stale_images(pushed, held) == ["localhost/epguard/epguard:dev",
                                          "localhost/epguard/pause:3.10"]  # fmt: skip
