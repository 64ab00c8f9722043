"""The controller's in-cluster server address: from the environment the kubelet sets,
never from a DNS name that only resolves where cluster DNS runs."""

from __future__ import annotations

from epguard.webhook.controller.login import in_cluster_server


def test_the_server_is_the_kubernetes_service_address_the_kubelet_puts_in_the_env() -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster_server(env) == "https://10.0.0.1:443"


def test_an_ipv6_service_address_is_bracketed() -> None:
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}
    assert in_cluster_server(env) == "https://[fd00::1]:6443"


def test_outside_a_pod_there_is_no_in_cluster_server() -> None:
    assert in_cluster_server({}) is None
    assert in_cluster_server({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) is None
