"""The API client every epguard part builds (webhook/cluster/kube.py): from each source
of credentials, with a connection pool wide enough for the threads that share it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from epguard.webhook.cluster.kube import CONNECTIONS, NoCredentials, api_client


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def _pool(api: object) -> int:
    return int(api.rest_client.pool_manager.connection_pool_kw["maxsize"])  # type: ignore[attr-defined]


def test_each_source_gives_a_client_with_the_whole_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client's own default is 5 per CPU (10 on the 2-core node), which a 200-pod
    # preflight run overflowed: every connection past it was closed and reopened.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    explicit = api_client(str(_kubeconfig(tmp_path / "a", "https://a.example:6443")))
    assert explicit.configuration.host == "https://a.example:6443"
    assert _pool(explicit) == CONNECTIONS
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "b", "https://b.example:6443")))
    from_env = api_client()
    assert from_env.configuration.host == "https://b.example:6443"
    assert _pool(from_env) == CONNECTIONS


def test_the_home_kubeconfig_is_read_only_when_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    home = tmp_path / "kubeconfig"
    _kubeconfig(home, "https://home.example:6443")
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(home))
    with pytest.raises(NoCredentials):
        api_client()
    api = api_client(home_kubeconfig=True)
    assert api.configuration.host == "https://home.example:6443"
    assert _pool(api) == CONNECTIONS
