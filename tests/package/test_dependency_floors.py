"""The dependency floors in pyproject.toml hold the features the code uses: the lowest
version each floor allows must have them (checked here on what is installed, and by
the floor itself: kopf 1.44.6, the last release below the floor, has no
``watching.label_selectors``)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import kopf
import uvicorn

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _floor(package: str) -> tuple[int, ...]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.split("[")[0].split(">")[0].strip() == package)
    return tuple(int(x) for x in spec.split(">=")[1].split(",")[0].split(".")[:2])


def test_kopf_floor_has_the_label_selectors_the_recorder_sets() -> None:
    # webhook/controller/recorder.py: settings.watching.label_selectors["v1", "pods"]
    assert _floor("kopf") >= (1, 45)
    assert hasattr(kopf.OperatorSettings().watching, "label_selectors")


def test_uvicorn_floor_has_the_tls_context_factory() -> None:
    # webhook/admission/server.py reloads TLS through Config(ssl_context_factory=...)
    assert _floor("uvicorn") >= (0, 47)
    assert "ssl_context_factory" in uvicorn.Config.__init__.__code__.co_varnames


def test_msgspec_floor_has_what_transport_and_completion_use() -> None:
    # webhook/admission/transport.py and completion.py: json.Decoder/Encoder, DecodeError; the
    # floor's release (0.18) has them all.
    import msgspec

    assert _floor("msgspec") >= (0, 18)
    assert msgspec.json.Decoder().decode(b'{"a": [1]}') == {"a": [1]}
    assert msgspec.json.Encoder().encode({"a": 1}) == b'{"a":1}'
    assert issubclass(msgspec.DecodeError, msgspec.MsgspecError)


def test_kubernetes_floor_has_what_the_watches_and_raw_calls_use() -> None:
    # webhook/cluster/watch.py: Watch.stream(..., deserialize=False) hands the raw JSON objects
    # over without a model round trip; webhook/cluster/kube.py: param_serialize/call_api (the
    # generator of the 35+ clients); certificates/recorder: per-call _content_type.
    import inspect

    from kubernetes import client, watch

    assert _floor("kubernetes") >= (37,)
    assert "deserialize" in inspect.getsource(watch.Watch.stream)
    assert hasattr(client.ApiClient, "param_serialize")
    patch = client.CoreV1Api.patch_namespaced_pod
    assert "_content_type" in inspect.signature(patch).parameters
