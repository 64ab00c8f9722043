"""The dependency floors in pyproject.toml hold the features the code uses.

Checking what is installed says nothing about a floor: the installed version is whatever
the resolver picked, usually the newest. So each feature epguard needs from a dependency
is written down below with the first release that has it, found by reading the released
files on PyPI (the release below it, named too, does not have it), and the tests check
the floors themselves against that table: a floor below a feature's first release fails,
whatever is installed. Offline and fast: nothing is downloaded here.

Two more checks keep the table honest: every feature named is there in the installed
version (a row that names a feature wrongly fails), and the installed versions satisfy
the floors. Run in a venv with every dependency at its floor, that check is also the
floors' own (the commit that rewrote this file says how).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@dataclass(frozen=True)
class Need:
    dist: str  # the distribution, as [project] dependencies names it
    feature: str  # what the code uses, and where
    first: str  # the first release that has it
    before: str | None  # the release just below ``first``, read and found without it
    evidence: str  # where in the released files
    present: Callable[[], bool]  # the feature, looked up in the installed version


def _params(fn: Callable[..., object]) -> set[str]:
    return set(inspect.signature(fn).parameters)


def _fastapi_lifespan() -> bool:
    from fastapi import FastAPI

    return "lifespan" in _params(FastAPI.__init__)


def _uvicorn_config(name: str) -> Callable[[], bool]:
    def present() -> bool:
        import uvicorn

        return name in _params(uvicorn.Config.__init__)

    return present


def _uvicorn_httptools_400() -> bool:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    hooks = ("send_400_response", "on_url", "on_header", "on_headers_complete")
    return all(callable(getattr(HttpToolsProtocol, h, None)) for h in hooks)


def _pydantic_v2() -> bool:
    import pydantic

    names = ("field_validator", "model_validator", "ConfigDict")
    return all(hasattr(pydantic, n) for n in names) and hasattr(
        pydantic.BaseModel, "model_dump_json"
    )


def _pydantic_errors_without_input() -> bool:
    from pydantic import BaseModel, ValidationError

    class M(BaseModel):
        n: int

    try:
        M.model_validate({"n": "x"})
    except ValidationError as exc:
        [error] = exc.errors(include_url=False, include_input=False)
        return "input" not in error and "url" not in error
    return False


def _msgspec_json() -> bool:
    import msgspec

    decoded = msgspec.json.Decoder().decode(b'{"a": [1]}')
    encoded = msgspec.json.Encoder().encode({"a": 1})
    return decoded == {"a": [1]} and encoded == b'{"a":1}' and msgspec.json.decode(b"1") == 1


def _msgspec_validation_error() -> bool:
    import msgspec

    return issubclass(msgspec.ValidationError, msgspec.DecodeError)


def _yaml_safe() -> bool:
    import yaml

    docs = list(yaml.safe_load_all("a: 1\n---\nb: [2]\n"))
    return docs == [{"a": 1}, {"b": [2]}] and yaml.safe_load(yaml.safe_dump({"c": 3})) == {"c": 3}


def _prometheus_registry() -> bool:
    from prometheus_client import CollectorRegistry, Gauge, Histogram
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

    r = CollectorRegistry()
    Gauge("g", "g", ["x"], registry=r).labels("1").set(1)
    Histogram("h", "h", buckets=(0.1, 1.0), registry=r).observe(0.5)
    text = generate_latest(r).decode()
    return 'g{x="1"} 1.0' in text and 'h_bucket{le="1.0"} 1.0' in text and bool(CONTENT_TYPE_LATEST)


def _prometheus_total() -> bool:
    from prometheus_client import CollectorRegistry, Counter
    from prometheus_client.exposition import generate_latest

    r = CollectorRegistry()
    Counter("epguard_admission_reviews", "r", ["endpoint"], registry=r).labels("v").inc()
    return 'epguard_admission_reviews_total{endpoint="v"} 1.0' in generate_latest(r).decode()


def _cryptography_bundle() -> bool:
    from cryptography import x509

    return callable(getattr(x509, "load_pem_x509_certificates", None))


def _cryptography_utc() -> bool:
    from cryptography import x509

    return all(
        hasattr(x509.Certificate, a) for a in ("not_valid_before_utc", "not_valid_after_utc")
    )


def _kopf_label_selectors() -> bool:
    import kopf

    return hasattr(kopf.OperatorSettings().watching, "label_selectors")


def _kopf_identity() -> bool:
    import kopf

    parameters = inspect.signature(kopf.operator).parameters
    return "identity" in parameters and "settings" in parameters


def _kubernetes_watch_raw() -> bool:
    from kubernetes import watch

    return "'deserialize'" in inspect.getsource(watch.Watch.stream)


def _kubernetes_content_type() -> bool:
    from kubernetes import client

    # A parameter from 37.0.0 (the new generator); in 36.x a kwarg the call looks up.
    api = client.CoreV1Api
    return "_content_type" in _params(api.patch_namespaced_pod) or "'_content_type'" in (
        inspect.getsource(api.patch_namespaced_pod_with_http_info)
    )


def _kubernetes_param_serialize() -> bool:
    from kubernetes import client

    return callable(getattr(client.ApiClient, "param_serialize", None))


def _zstd_window() -> bool:
    import zstandard

    zstandard.ZstdDecompressor(max_window_size=1 << 20)
    return issubclass(zstandard.ZstdError, Exception)


def _zstd_across_frames() -> bool:
    import io

    import zstandard

    frames = zstandard.ZstdCompressor().compress(b"ab") + zstandard.ZstdCompressor().compress(b"c")
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(frames), read_across_frames=True)
    return bool(reader.read() == b"abc")


# Established by reading each release's files as PyPI serves them (wheel, or sdist where
# no wheel of that release installs here): `pip download <dist>==<version> --no-deps`.
NEEDS: tuple[Need, ...] = (
    Need("fastapi", "FastAPI(lifespan=...): the webhook's background tasks (admission/app.py, "
         "server.py)", "0.93.0", "0.92.0",
         "fastapi/applications.py: FastAPI.__init__ takes lifespan from 0.93.0",
         _fastapi_lifespan),
    Need("uvicorn", "Config(ssl_context_factory=...): TLS reloaded without a restart "
         "(admission/server.py)", "0.47.0", "0.46.0",
         "uvicorn/config.py: Config.__init__ takes ssl_context_factory from 0.47.0",
         _uvicorn_config("ssl_context_factory")),
    Need("uvicorn", "Config(timeout_graceful_shutdown=...) (admission/server.py)", "0.22.0",
         "0.21.1", "uvicorn/config.py", _uvicorn_config("timeout_graceful_shutdown")),
    Need("uvicorn", "Config(server_header=False) (admission/server.py)", "0.15.0", "0.13.4",
         "uvicorn/config.py; 0.14.0's sdist does not build here, so 0.15.0 is the first "
         "release read that has it (the first may be 0.14.0)",
         _uvicorn_config("server_header")),
    Need("uvicorn", "HttpToolsProtocol and the hooks admission/protocol.py overrides, "
         "send_400_response among them (answered 431)", "0.17.5", "0.17.4",
         "uvicorn/protocols/http/httptools_impl.py: send_400_response from 0.17.5",
         _uvicorn_httptools_400),
    Need("pydantic", "field_validator, model_validator, ConfigDict, model_dump_json "
         "(engine/rules.py, engine/review.py)", "2.0", "1.10.27",
         "pydantic/functional_validators.py, pydantic/config.py: new in 2.0",
         _pydantic_v2),
    Need("pydantic", "ValidationError.errors(include_url=False, include_input=False) "
         "(admission/transport.py)", "2.4.0", "2.3.0",
         "pydantic pins pydantic-core exactly: 2.4.0 pins 2.10.0, whose "
         "_pydantic_core.pyi has include_input; 2.3.0 pins 2.6.3, whose errors() has not",
         _pydantic_errors_without_input),
    Need("msgspec", "msgspec.json.Decoder/Encoder/decode and msgspec.DecodeError "
         "(admission/transport.py, completion.py)", "0.4.0", "0.3.2",
         "msgspec/json.pyi first ships in 0.4.0", _msgspec_json),
    Need("msgspec", "msgspec.ValidationError (admission/transport.py)", "0.8.0", "0.7.0",
         "msgspec/__init__.pyi: class ValidationError(DecodeError) from 0.8.0",
         _msgspec_validation_error),
    Need("pyyaml", "yaml.safe_load, safe_load_all, safe_dump, YAMLError (command.py, "
         "engine/rules.py, engine/workloads.py)", "3.10", None,
         "lib3/yaml/__init__.py of 3.10, the oldest release on PyPI", _yaml_safe),
    Need("prometheus-client", "CollectorRegistry, Counter/Gauge/Histogram(registry=, "
         "buckets=), exposition.generate_latest and CONTENT_TYPE_LATEST (metrics.py)",
         "0.0.10", "0.0.9", "0.0.9 has no prometheus_client/exposition.py",
         _prometheus_registry),
    Need("prometheus-client", "Counter('epguard_admission_reviews') exposed as "
         "epguard_admission_reviews_total, the name the docs and dashboards use "
         "(admission/instrumentation.py)", "0.4.0", "0.3.1",
         "prometheus_client/core.py: Counter samples get '_total' from 0.4.0",
         _prometheus_total),
    Need("cryptography", "x509.load_pem_x509_certificates: CA bundles "
         "(controller/authority.py)", "39.0.0", "38.0.4", "cryptography/x509/base.py",
         _cryptography_bundle),
    Need("cryptography", "Certificate.not_valid_before_utc / not_valid_after_utc "
         "(controller/authority.py, certificates.py)", "42.0.0", "41.0.7",
         "cryptography/x509/base.py", _cryptography_utc),
    Need("kopf", "settings.watching.label_selectors: the recorder watches probed pods only "
         "(controller/recorder.py)", "1.45.0", "1.44.6",
         "kopf/_cogs/configs/configuration.py: WatchingSettings.label_selectors",
         _kopf_label_selectors),
    Need("kopf", "kopf.operator(identity=..., settings=...): an identity without getpass "
         "(controller/__main__.py)", "1.29.2", "0.28.3",
         "kopf/reactor/running.py: operator() has settings in 0.28.3, identity from 1.29.2",
         _kopf_identity),
    Need("kubernetes", "Watch.stream(..., deserialize=False): raw JSON objects "
         "(cluster/watch.py)", "34.1.0", "33.1.0",
         "kubernetes/watch/watch.py: kwargs.pop('deserialize', True)",
         _kubernetes_watch_raw),
    Need("kubernetes", "per-call _content_type: JSON patches "
         "(controller/certificates.py)", "36.0.0", "35.0.0",
         "kubernetes/client/api/core_v1_api.py: '_content_type' in every call's params",
         _kubernetes_content_type),
    Need("kubernetes", "ApiClient.param_serialize with call_api: GET any object by path "
         "(cluster/kube.py get_object)", "37.0.0", "36.0.3",
         "kubernetes/client/api_client.py: def param_serialize (the new generator)",
         _kubernetes_param_serialize),
    Need("zstandard", "ZstdDecompressor(max_window_size=...), ZstdError (scan/layers.py)",
         "0.9.0", "0.8.2", "c-ext/decompressor.c of the sdist", _zstd_window),
    Need("zstandard", "stream_reader(..., read_across_frames=True): multi-frame layers "
         "(scan/layers.py)", "0.11.0", "0.10.2",
         "NEWS.rst 0.11.0; zstandard/cffi.py and c-ext/decompressionreader.c",
         _zstd_across_frames),
)  # fmt: skip


def _requirements() -> dict[str, Requirement]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return {canonicalize_name(r.name): r for r in reqs}


def floor(dist: str) -> Version:
    """The version a ``>=`` in pyproject.toml names for ``dist``."""
    req = _requirements()[canonicalize_name(dist)]
    floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert len(floors) == 1, f"{dist}: no single '>=' floor in {req}"
    return floors[0]


def _id(need: Need) -> str:
    return f"{need.dist}:{need.feature.split(':')[0].split(' (')[0][:40].strip()}"


def test_the_table_covers_every_dependency_and_only_dependencies() -> None:
    deps = set(_requirements())
    named = {canonicalize_name(n.dist) for n in NEEDS}
    assert deps - named == set(), "a dependency whose floor no row checks"
    assert named - deps == set(), "a row for something that is not a dependency"


@pytest.mark.parametrize("need", NEEDS, ids=_id)
def test_the_floor_has_the_feature(need: Need) -> None:
    assert floor(need.dist) >= Version(need.first), (
        f"pyproject.toml allows {need.dist} {floor(need.dist)}, which predates "
        f"{need.feature} (first in {need.first}: {need.evidence})"
    )


@pytest.mark.parametrize("need", [n for n in NEEDS if n.before is not None], ids=_id)
def test_the_release_named_without_the_feature_is_below_the_first(need: Need) -> None:
    assert need.before is not None and Version(need.before) < Version(need.first)


@pytest.mark.parametrize("need", NEEDS, ids=_id)
def test_the_feature_is_there_in_the_installed_version(need: Need) -> None:
    # Not the floor's check (that is above): this one catches a row that names a
    # feature the code does not find where the row says.
    assert need.present(), f"{need.dist} {_installed(need.dist)}: no {need.feature}"


def _installed(dist: str) -> Version:
    return Version(importlib.metadata.version(dist))


@pytest.mark.parametrize("dist", sorted(_requirements()))
def test_the_installed_version_satisfies_the_floor(dist: str) -> None:
    req = _requirements()[dist]
    assert req.specifier.contains(_installed(dist), prereleases=True), (
        f"{dist} {_installed(dist)} is installed; pyproject.toml asks {req.specifier}"
    )
