"""A real OCI registry on the node's address: every image the node runs is pulled from it.

Debian's ``docker-registry`` (CNCF distribution v2.8) runs as one of the node's
processes, on ``<node ip>:5000`` with a serving certificate from the cluster's CA;
containerd trusts that CA through its registry ``hosts.toml`` (no system trust store is
touched). Its storage is ``$EPGUARD_CACHE/registry`` so that what was pushed survives
``down``; its access log is in the node's work directory, so each node start reads only
its own pulls.

The images built here (:mod:`devcluster.images`: pause, busybox, epguard, the workers)
keep their names ``localhost/epguard/<name>:<tag>``; :meth:`Registry.push_archive` copies
an OCI archive's blobs and manifest into the registry byte for byte (the manifest digest
pods pin is the archive's), and a ``hosts.toml`` for ``localhost`` sends containerd's pulls
of those names to this registry. So the kubelet pulls them (``imagePullPolicy:
IfNotPresent``) as it would from any registry, and reports their manifest digests.

The model image is what the preflight gate promises never to pull for a bad worker:
:data:`MODEL_SHARDS` shards of deterministic bytes (1 GiB in all) in one uncompressed
layer, at the layer's root, so an image volume mounted at ``/model`` shows
``/model/shard-000.bin`` ... It is written straight into the registry over its HTTP API
(a streamed upload, hashed on the way): no archive or layout copy on disk, and the same
digests on every machine.

``blob_gets`` reads the access log: which blobs were served, how often, how many bytes.

A second, *private* instance (:data:`PRIVATE_PORT`, empty storage) answers every
request without credentials ``401 Unauthorized`` with a token challenge (distribution's
``silly`` auth: it checks only that an ``Authorization`` header is there): an image on it
is what a namespace without the right ``imagePullSecrets`` meets in a real cluster.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import random
import re
import ssl
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

from devcluster import binaries, ociimage, pki
from devcluster.process import ManagedProcess

REGISTRY_BIN = Path("/usr/bin/docker-registry")
PORT = 5000
PRIVATE_PORT = 5001
MODEL_REPOSITORY = "models/sglang-weights"
MODEL_TAG = "1"
MODEL_SHARDS = 4
SHARD_BYTES = 256 << 20
_CHUNK = 1 << 20
# The registry host of the images built here: their names stay ``localhost/...`` (no
# outside registry can be meant by it), and containerd resolves it to this registry.
LOCAL_HOST = "localhost"
START_TIMEOUT = 30.0
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
# The distribution spec's grammar of a repository name and a tag.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
# One access-log line (combined format): the request, its status and the bytes sent.
_ACCESS = re.compile(r'"(GET|HEAD) (/v2/\S+) HTTP/[\d.]+" (\d{3}) (\d+|-)')


class RegistryError(RuntimeError):
    """The registry did not start or refused a request; the message says which."""


@dataclass(frozen=True)
class BlobServed:
    """What the registry served of one blob (GET requests; a HEAD sends no body)."""

    requests: int
    bytes: int


@dataclass(frozen=True)
class Registry:
    """The registry of one node: ``workdir`` holds its TLS files, config, log and the
    ``hosts.toml`` tree containerd reads."""

    workdir: Path
    ip: str
    port: int = PORT
    # Every request needs credentials (see the module's docstring); nothing is stored.
    private: bool = False

    @property
    def host(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def storage(self) -> Path:
        return self.workdir / "storage" if self.private else binaries.cache_dir() / "registry"

    @property
    def log(self) -> Path:
        return self.workdir / "registry.log"

    @property
    def hosts_dir(self) -> Path:
        """containerd's ``config_path``: one directory per ``host:port``, shared by the
        node's registries."""
        return self.workdir.parent / "registry-hosts"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "tls" / "ca.crt"

    @property
    def model_ref(self) -> str:
        return f"{self.host}/{MODEL_REPOSITORY}:{MODEL_TAG}"

    # --- start ------------------------------------------------------------------------

    def prepare(self, ca: pki.CertificateAuthority) -> list[str]:
        """Write the serving certificate, the registry's config and containerd's
        ``hosts.toml``; return the command line that serves it."""
        if not REGISTRY_BIN.is_file():
            raise RegistryError(
                f"{REGISTRY_BIN} missing: run `make tools` (scripts/tools.d/05-system.sh)"
            )
        tls = self.workdir / "tls"
        tls.mkdir(parents=True, exist_ok=True)
        self.storage.mkdir(parents=True, exist_ok=True)
        self.ca_file.write_bytes(ca.cert_pem)
        ca.issue_serving("epguard-dev-registry", dns_names=[], ips=[self.ip]).write(
            tls / "registry.crt", tls / "registry.key"
        )
        config = {
            "version": 0.1,
            "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": False}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.storage)},
                "delete": {"enabled": True},
                "maintenance": {"uploadpurging": {"enabled": False}},
            },
            "http": {
                "addr": self.host,
                "tls": {"certificate": str(tls / "registry.crt"), "key": str(tls / "registry.key")},
            },
        }
        if self.private:
            config["auth"] = {
                "silly": {"realm": f"https://{self.host}/token", "service": "epguard-private"}
            }
        path = self.workdir / "config.yml"
        path.write_text(json.dumps(config, indent=1))  # YAML is a superset of JSON
        names = [self.host] if self.private else [self.host, LOCAL_HOST]
        for name in names:
            hosts = self.hosts_dir / name
            hosts.mkdir(parents=True, exist_ok=True)
            (hosts / "hosts.toml").write_text(
                f'server = "https://{self.host}"\n'
                f'[host."https://{self.host}"]\n'
                '  capabilities = ["pull", "resolve"]\n'
                f'  ca = "{self.ca_file}"\n'
            )
        return [str(REGISTRY_BIN), "serve", str(path)]

    def collect_garbage(self) -> None:
        """Remove what no tag names any more (a rebuilt epguard image's old layers) from
        the storage, before the registry serves: distribution collects only offline.
        An empty storage (a fresh cache: nothing pushed yet) has nothing to collect, and
        the collector fails on it ("Path not found: /docker/registry/v2/repositories")."""
        if not (self.storage / "docker" / "registry" / "v2" / "repositories").is_dir():
            return
        config = self.workdir / "config.yml"
        r = subprocess.run(
            [str(REGISTRY_BIN), "garbage-collect", "--delete-untagged", str(config)],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if r.returncode != 0:
            raise RegistryError(f"garbage-collect failed: {(r.stderr or r.stdout)[-2000:]}")

    def wait_ready(self, proc: ManagedProcess) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                status, _, _ = self.request("GET", "/v2/")
                if status == (401 if self.private else 200):
                    return
            except OSError:
                pass
            if not proc.alive() or time.monotonic() > deadline:
                raise RegistryError(
                    f"the registry on {self.host} did not answer /v2/; last log lines:\n"
                    f"{proc.log_tail()}"
                )
            time.sleep(0.2)

    # --- HTTP -------------------------------------------------------------------------

    def _connection(self) -> http.client.HTTPSConnection:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        return http.client.HTTPSConnection(self.ip, self.port, context=context, timeout=60)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | Iterator[bytes] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        conn = self._connection()
        try:
            conn.request(
                method, path, body=body, headers=headers or {},
                encode_chunked=body is not None and not isinstance(body, bytes),
            )  # fmt: skip
            response = conn.getresponse()
            return response.status, response.headers, response.read()
        finally:
            conn.close()

    def has_manifest(self, repository: str, tag: str) -> bool:
        return self.manifest_digest(repository, tag) is not None

    def manifest_digest(self, repository: str, tag: str) -> str | None:
        """The digest the registry serves under ``repository:tag``, None if none."""
        status, headers, _ = self.request(
            "HEAD", f"/v2/{repository}/manifests/{tag}", headers={"Accept": MANIFEST_TYPE}
        )
        return headers.get("Docker-Content-Digest") if status == 200 else None

    def has_blob(self, repository: str, digest: str) -> bool:
        status, _, _ = self.request("HEAD", f"/v2/{repository}/blobs/{digest}")
        return status == 200

    def _upload(
        self, repository: str, digest_of: hashlib._Hash, body: bytes | Iterator[bytes]
    ) -> str:
        """One blob: start an upload session, stream the body, commit it under the
        digest of what was sent (read from ``digest_of`` after the body ends)."""
        status, headers, said = self.request("POST", f"/v2/{repository}/blobs/uploads/")
        if status != 202:
            raise RegistryError(f"upload to {repository} refused: {status} {said[:200]!r}")
        location = _path_of(headers["Location"])
        status, headers, said = self.request(
            "PATCH", location, body=body, headers={"Content-Type": "application/octet-stream"}
        )
        if status != 202:
            raise RegistryError(f"blob upload to {repository} failed: {status} {said[:200]!r}")
        location = _path_of(headers["Location"])
        digest = f"sha256:{digest_of.hexdigest()}"
        sep = "&" if "?" in location else "?"
        status, _, said = self.request("PUT", f"{location}{sep}digest={digest}", body=b"")
        if status != 201:
            raise RegistryError(f"blob commit {digest} failed: {status} {said[:200]!r}")
        return digest

    def push_model(self) -> str:
        """Write the model image into the registry unless it is there; returns its
        reference. Deterministic: the same digests on every machine."""
        if self.has_manifest(MODEL_REPOSITORY, MODEL_TAG):
            return self.model_ref
        layer_hash = hashlib.sha256()
        size = 0

        def counted() -> Iterator[bytes]:
            nonlocal size
            for chunk in model_layer():
                layer_hash.update(chunk)
                size += len(chunk)
                yield chunk

        layer = self._upload(MODEL_REPOSITORY, layer_hash, counted())
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {},
                "rootfs": {"type": "layers", "diff_ids": [layer]},
            },
            sort_keys=True,
        ).encode()
        config_digest = self._upload(MODEL_REPOSITORY, hashlib.sha256(config), config)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST_TYPE,
                "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(config)},
                "layers": [{"mediaType": LAYER_TYPE, "digest": layer, "size": size}],
            },
            sort_keys=True,
        ).encode()
        status, _, said = self.request(
            "PUT", f"/v2/{MODEL_REPOSITORY}/manifests/{MODEL_TAG}", body=manifest,
            headers={"Content-Type": MANIFEST_TYPE},
        )  # fmt: skip
        if status != 201:
            raise RegistryError(f"model manifest refused: {status} {said[:200]!r}")
        return self.model_ref

    def push_archive(self, archive: Path) -> dict[str, str]:
        """Copy each image of an OCI archive (written by :mod:`devcluster.ociimage` or
        buildah) named ``localhost/<repository>:<tag>`` into the registry, blobs and
        manifest byte for byte, unless the tag already serves that manifest; returns
        {image name: manifest digest}. A blob the repository holds is not sent again (the
        workers share their multi-GB torch layer)."""
        pushed: dict[str, str] = {}
        with tarfile.open(archive) as tar:
            for name, digest in ociimage.archive_images(archive).items():
                repository, tag = local_repository(name)
                pushed[name] = digest
                if self.manifest_digest(repository, tag) == digest:
                    continue
                manifest = _blob(tar, digest).read()
                doc = json.loads(manifest)
                blobs = [doc["config"], *doc["layers"]]
                for blob in blobs:
                    if not self.has_blob(repository, blob["digest"]):
                        self._push_blob(tar, repository, str(blob["digest"]))
                status, _, said = self.request(
                    "PUT", f"/v2/{repository}/manifests/{tag}", body=manifest,
                    headers={"Content-Type": str(doc.get("mediaType", MANIFEST_TYPE))},
                )  # fmt: skip
                if status != 201:
                    raise RegistryError(f"manifest of {name} refused: {status} {said[:200]!r}")
        return pushed

    def tag(self, name: str, alias: str) -> str:
        """Serve the manifest of ``name`` under ``alias`` too (both built here, in one
        repository: no blob is copied); returns its digest. distribution 2.8 cannot
        delete a tag alone, so an alias stays (a link of a few bytes)."""
        repository, tag = local_repository(name)
        alias_repository, alias_tag = local_repository(alias)
        if alias_repository != repository:
            raise RegistryError(f"{alias!r} is not in the repository of {name!r}")
        status, headers, body = self.request(
            "GET", f"/v2/{repository}/manifests/{tag}", headers={"Accept": MANIFEST_TYPE}
        )
        if status != 200:
            raise RegistryError(f"no manifest for {name} ({status})")
        status, _, said = self.request(
            "PUT", f"/v2/{repository}/manifests/{alias_tag}", body=body,
            headers={"Content-Type": headers.get("Content-Type", MANIFEST_TYPE)},
        )  # fmt: skip
        if status != 201:
            raise RegistryError(f"tag {alias} refused: {status} {said[:200]!r}")
        return str(headers["Docker-Content-Digest"])

    def _push_blob(self, tar: tarfile.TarFile, repository: str, digest: str) -> None:
        f = _blob(tar, digest)
        hashed = hashlib.sha256()

        def chunks() -> Iterator[bytes]:
            while chunk := f.read(_CHUNK):
                hashed.update(chunk)
                yield chunk

        if self._upload(repository, hashed, chunks()) != digest:
            raise RegistryError(f"the archive's blob {digest} does not match its digest")

    def model_layer_sizes(self) -> dict[str, int]:
        """{digest: size} of the model image's layers (what a pull of the model fetches)."""
        status, _, body = self.request(
            "GET", f"/v2/{MODEL_REPOSITORY}/manifests/{MODEL_TAG}",
            headers={"Accept": MANIFEST_TYPE},
        )  # fmt: skip
        if status != 200:
            raise RegistryError(f"no model manifest in the registry ({status})")
        return {str(layer["digest"]): int(layer["size"]) for layer in json.loads(body)["layers"]}

    def model_layers(self) -> list[str]:
        return list(self.model_layer_sizes())

    # --- the access log ---------------------------------------------------------------

    def log_offset(self) -> int:
        """Where the access log ends now: pass it to :meth:`blob_gets` to count only
        what is served after this moment."""
        try:
            return self.log.stat().st_size
        except FileNotFoundError:
            return 0

    def blob_gets(self, since: int = 0) -> dict[str, BlobServed]:
        """{blob digest: what was served} from the access log, after byte ``since``."""
        served: dict[str, BlobServed] = {}
        try:
            with self.log.open("rb") as f:
                f.seek(since)
                text = f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return served
        for match in _ACCESS.finditer(text):
            method, path, status, sent = match.groups()
            if method != "GET" or "/blobs/" not in path or not status.startswith("2"):
                continue
            # A pull through a mirror (a ``localhost/...`` name) adds ``?ns=localhost``.
            digest = path.rsplit("/blobs/", 1)[1].partition("?")[0]
            before = served.get(digest, BlobServed(0, 0))
            served[digest] = BlobServed(
                before.requests + 1, before.bytes + (int(sent) if sent != "-" else 0)
            )
        return served


def local_repository(name: str) -> tuple[str, str]:
    """``localhost/epguard/sglang:0.5.23`` -> (``epguard/sglang``, ``0.5.23``): where an
    image built here lives in the node's registry."""
    host, _, rest = name.partition("/")
    repository, _, tag = rest.rpartition(":")
    if host != LOCAL_HOST or not _REPOSITORY.fullmatch(repository) or not _TAG.fullmatch(tag):
        raise RegistryError(f"{name!r} is not an image built here (localhost/<repository>:<tag>)")
    return repository, tag


def _blob(tar: tarfile.TarFile, digest: str) -> IO[bytes]:
    """The blob ``digest`` of an OCI archive (``blobs/<algorithm>/<hex>``), to read."""
    algorithm, _, hexdigest = digest.partition(":")
    f = tar.extractfile(f"blobs/{algorithm}/{hexdigest}")
    if f is None:
        raise RegistryError(f"{digest} is not a file in the archive")
    return f


def _path_of(location: str) -> str:
    """An upload Location (absolute URL or path) as a request path with its query."""
    parts = urlsplit(location)
    return parts.path + (f"?{parts.query}" if parts.query else "")


def model_layer() -> Iterator[bytes]:
    """The model image's one layer, as a tar stream: ``shard-NNN.bin`` files of
    deterministic bytes and a ``config.json``, root-owned, mtime 0."""
    files: list[tuple[str, int, Iterator[bytes]]] = [
        (f"shard-{i:03d}.bin", SHARD_BYTES, _shard(i)) for i in range(MODEL_SHARDS)
    ]
    meta = json.dumps({"model": "epguard-e2e", "shards": MODEL_SHARDS}).encode()
    files.append(("config.json", len(meta), iter([meta])))
    for name, size, chunks in files:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o644, 0
        yield info.tobuf(format=tarfile.USTAR_FORMAT)
        yield from chunks
        if size % 512:
            yield b"\0" * (512 - size % 512)
    yield b"\0" * 1024  # end of archive


def _shard(index: int) -> Iterator[bytes]:
    rng = random.Random(f"epguard-model-{index}")
    for _ in range(SHARD_BYTES // _CHUNK):
        yield rng.randbytes(_CHUNK)
