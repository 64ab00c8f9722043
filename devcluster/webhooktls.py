"""The local webhook's TLS: its serving certificate, the CA bundle the API server
trusts for it, and a rotation that never fails an admission.

In the cluster the controller does this for the in-cluster Service name; the
local webhook listens on 127.0.0.1, so devcluster issues its certificate from a
dev CA of its own. Files are written like a kubelet-projected Secret
(:mod:`devcluster.secretvolume`), so the webhook reloads them as it would in a pod.

A rotation follows the same protocol as the controller's: trust old and new CA
together, switch the serving certificate, then drop the old CA. Instead of a
fixed overlap period it waits for proof at each step that the API server and
the webhook have caught up (see :func:`sync_barrier`).
"""

from __future__ import annotations

import base64
import json
import ssl
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from devcluster import pki
from devcluster.controlplane import ControlPlane
from devcluster.secretvolume import SecretVolume

RELEASE_LABEL = "app.kubernetes.io/instance=epguard"
SYNC_CONFIG = "devcluster-sync-barrier"


class WebhookTLSError(RuntimeError):
    pass


class LocalWebhookTLS:
    """``<dir>/tls/{tls.crt,tls.key}`` for the webhook, ``<dir>/ca.crt`` for caBundle."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.volume = SecretVolume(directory / "tls")

    @property
    def cert_file(self) -> Path:
        return self.volume.path("tls.crt")

    @property
    def key_file(self) -> Path:
        return self.volume.path("tls.key")

    @property
    def bundle_file(self) -> Path:
        return self.directory / "ca.crt"

    def issue(self) -> None:
        """A new dev CA and a serving certificate from it; the bundle is that CA alone."""
        ca = pki.CertificateAuthority(f"epguard-devcluster-webhook-ca-{uuid.uuid4().hex[:6]}")
        self._serve(ca)
        self.bundle_file.write_bytes(ca.cert_pem)

    def _serve(self, ca: pki.CertificateAuthority) -> bytes:
        pair = ca.issue_serving("epguard-webhook", ["localhost"], ["127.0.0.1"])
        self.volume.write({"tls.crt": pair.cert, "tls.key": pair.key})
        return pair.cert

    def rotate(self, cp: ControlPlane, port: int, timeout: float = 60.0) -> None:
        """Rotate CA and certificate while the webhook serves, without a failed call."""
        old_bundle = self.bundle_file.read_bytes()
        ca = pki.CertificateAuthority(f"epguard-devcluster-webhook-ca-{uuid.uuid4().hex[:6]}")
        # 1. Both CAs trusted, and the API server provably using that bundle.
        self._publish(cp, ca.cert_pem + old_bundle, timeout)
        # 2. The new certificate served (the webhook reloads the files by itself).
        new_cert = self._serve(ca)
        _wait_served(port, new_cert, timeout)
        # 3. The old CA no longer trusted.
        self._publish(cp, ca.cert_pem, timeout)

    def _publish(self, cp: ControlPlane, bundle: bytes, timeout: float) -> None:
        self.bundle_file.write_bytes(bundle)
        set_client_config(cp, bundle=bundle)
        sync_barrier(cp, timeout)


WEBHOOK_CONFIG_KINDS = ("validatingwebhookconfiguration", "mutatingwebhookconfiguration")


def epguard_webhook_configs(cp: ControlPlane) -> list[dict[str, Any]]:
    """epguard's validating and mutating configurations (each item keeps its kind)."""
    items: list[dict[str, Any]] = []
    for kind in WEBHOOK_CONFIG_KINDS:
        r = cp.kubectl("get", kind + "s", "-l", RELEASE_LABEL, "-o", "json")
        if r.returncode != 0:
            raise WebhookTLSError(f"listing webhook configurations failed: {r.stderr}")
        for item in json.loads(r.stdout)["items"]:
            item["kind"] = kind  # list items may come without their kind
            items.append(item)
    return items


def _local_url(base: str, client_config: Any) -> str:
    """The local webhook's URL for one webhook: its origin, and the path the chart gave
    the in-cluster Service (/validate or /mutate), so each endpoint keeps its own."""
    origin = urlsplit(base)
    service = client_config.get("service") if isinstance(client_config, dict) else None
    path = service.get("path") if isinstance(service, dict) else None
    if not path and isinstance(client_config, dict) and client_config.get("url"):
        path = urlsplit(client_config["url"]).path
    return f"{origin.scheme}://{origin.netloc}{path or origin.path}"


def set_client_config(cp: ControlPlane, *, bundle: bytes, url: str | None = None) -> list[str]:
    """Set caBundle (and, given one, the url) of every webhook in epguard's
    configurations; returns their names."""
    ca_b64 = base64.b64encode(bundle).decode()
    names = []
    for config in epguard_webhook_configs(cp):
        name = config["metadata"]["name"]
        patch: list[dict[str, Any]] = []
        for i, hook in enumerate(config.get("webhooks", [])):
            # Without a url only the caBundle changes, whatever else clientConfig holds.
            path, value = (
                (f"/webhooks/{i}/clientConfig/caBundle", ca_b64)
                if url is None
                else (
                    f"/webhooks/{i}/clientConfig",
                    {"url": _local_url(url, hook.get("clientConfig")), "caBundle": ca_b64},
                )
            )
            patch.append({"op": "replace", "path": path, "value": value})
        p = cp.kubectl("patch", config["kind"], name, "--type=json", "-p", json.dumps(patch))
        if p.returncode != 0:
            raise WebhookTLSError(f"patching {name} failed: {p.stderr}")
        names.append(name)
    return names


def sync_barrier(cp: ControlPlane, timeout: float = 60.0) -> None:
    """Return once the API server's admission chain has seen every webhook
    configuration change made before this call.

    The API server reads webhook configurations through one informer, which
    applies watch events in order. So: write a canary configuration with a fresh
    token, and wait until a dry-run create that only the canary matches is refused
    by it (its URL is unreachable and it fails closed). Once the canary is in
    effect, every earlier change is too. The canary matches nothing else.
    """
    token = uuid.uuid4().hex
    canary = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": SYNC_CONFIG},
        "webhooks": [
            {
                "name": "sync-barrier.devcluster.epguard.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 1,
                # Port 1 on loopback: refused at once, nothing ever listens there.
                "clientConfig": {"url": "https://127.0.0.1:1/sync"},
                "objectSelector": {"matchLabels": {"devcluster-sync": token}},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["configmaps"],
                    }
                ],
            }
        ],
    }
    cp.kubectl("apply", "-f", "-", input=json.dumps(canary), check=True)
    probe = json.dumps(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "devcluster-sync-probe",
                "namespace": "default",
                "labels": {"devcluster-sync": token},
            },
        }
    )
    deadline = time.monotonic() + timeout
    while True:
        r = cp.kubectl("create", "--dry-run=server", "-f", "-", input=probe)
        if r.returncode != 0 and "sync-barrier.devcluster.epguard.io" in r.stderr:
            # Gone again so that nobody listing webhook configurations wonders about
            # a fail-closed webhook; its deletion needs no barrier of its own.
            cp.kubectl("delete", "validatingwebhookconfiguration", SYNC_CONFIG, "--wait=false")
            return
        if time.monotonic() > deadline:
            raise WebhookTLSError(f"the API server did not pick up {SYNC_CONFIG} in {timeout}s")
        time.sleep(0.1)


def _wait_served(port: int, cert_pem: bytes, timeout: float) -> None:
    want = ssl.PEM_cert_to_DER_cert(cert_pem.decode())
    deadline = time.monotonic() + timeout
    while True:
        try:
            served = ssl.get_server_certificate(("127.0.0.1", port), timeout=2.0)
            if ssl.PEM_cert_to_DER_cert(served) == want:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise WebhookTLSError(f"the webhook on port {port} did not serve the new certificate")
        time.sleep(0.1)
