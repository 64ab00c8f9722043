"""Who may call the webhook (issue 21, point 4): the NetworkPolicy leaves the cluster's
pod CIDRs out of an open API-server range, and a client CA makes the webhook answer
only the API server's certificate."""

from __future__ import annotations

from typing import Any

from tests.chart.chartlib import CHART, notes, render, run_helm

Obj = dict[str, Any]


def api_server_peers(*extra: str) -> list[Obj]:
    np = render(*extra).one("NetworkPolicy", "epguard-webhook")
    # The first rule is the API server's (then the helm test pod, then scrapers).
    return list(np["spec"]["ingress"][0]["from"])


def test_pod_cidrs_are_left_out_of_an_open_api_server_range() -> None:
    peers = api_server_peers("--set", "networkPolicy.podCIDRs={10.244.0.0/16,fd00:10:244::/56}")
    assert peers == [
        {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.244.0.0/16"]}},
        {"ipBlock": {"cidr": "::/0", "except": ["fd00:10:244::/56"]}},
    ]


def test_a_narrowed_api_server_range_is_rendered_as_given() -> None:
    peers = api_server_peers(
        "--set",
        "networkPolicy.apiServerCIDRs={172.18.0.0/16}",
        "--set",
        "networkPolicy.podCIDRs={10.244.0.0/16}",
    )
    assert peers == [{"ipBlock": {"cidr": "172.18.0.0/16"}}]


def test_by_default_nothing_is_left_out() -> None:
    assert api_server_peers() == [
        {"ipBlock": {"cidr": "0.0.0.0/0"}},
        {"ipBlock": {"cidr": "::/0"}},
    ]


def test_a_pod_cidr_that_is_not_a_cidr_fails_the_render() -> None:
    r = run_helm("template", "x", str(CHART), "--set", "networkPolicy.podCIDRs={pods}", check=False)
    assert r.returncode != 0 and "podCIDRs" in r.stderr


def test_a_client_ca_secret_is_mounted_and_required() -> None:
    dep = render("--set", "webhook.clientCASecret=apiserver-client-ca").one(
        "Deployment", "epguard-webhook"
    )
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["EPGUARD_CLIENT_CA"] == "/etc/epguard/client-ca/ca.crt"
    assert {"name": "client-ca", "mountPath": "/etc/epguard/client-ca", "readOnly": True} in c[
        "volumeMounts"
    ]
    volume = next(v for v in spec["volumes"] if v["name"] == "client-ca")
    assert volume["secret"] == {
        "secretName": "apiserver-client-ca",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }
    plain = render().one("Deployment", "epguard-webhook")["spec"]["template"]["spec"]
    assert "EPGUARD_CLIENT_CA" not in {e["name"] for e in plain["containers"][0]["env"]}


def test_install_warns_about_the_open_range_until_pods_are_left_out() -> None:
    assert "networkPolicy.podCIDRs" in notes()
    assert "apiServerCIDRs admits any address" not in notes(
        "--set", "networkPolicy.podCIDRs={10.244.0.0/16}"
    )
