"""Certificates and keys for the local control plane, made with ``cryptography``.

One throwaway CA signs everything: the API server's serving certificate, the
admin client certificate (group ``system:masters``) and, later, the webhook's
serving certificate. The service-account token signing key is a separate key
pair, as in a real cluster. EC P-256 keys everywhere: both etcd/kube-apiserver
and Python's ssl accept them, and they are generated in microseconds where RSA
takes tens of milliseconds.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from epguard.webhook.controller.authority import CLOCK_SKEW, cert_pem, key_pem, key_usage, load_key
from epguard.webhook.controller.authority import new_key as _new_key

# Long enough for any dev session, short enough that a leaked file is harmless.
_VALIDITY = datetime.timedelta(days=7)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, both PEM-encoded."""

    cert: bytes
    key: bytes

    def write(self, cert_path: Path, key_path: Path) -> None:
        cert_path.write_bytes(self.cert)
        write_private(key_path, self.key)


def write_private(path: Path, data: bytes) -> None:
    """Write key material readable by the owner only."""
    # Create with 0600 from the start rather than chmod after: no window in
    # which another user on a shared machine can read the key.
    path.unlink(missing_ok=True)
    with path.open("xb") as f:
        path.chmod(0o600)
        f.write(data)


class CertificateAuthority:
    """A self-signed CA that issues serving and client certificates."""

    def __init__(self, common_name: str = "epguard-devcluster-ca") -> None:
        self._key = _new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                key_usage(ca=True),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )

    @classmethod
    def load(cls, cert: bytes, key: bytes) -> CertificateAuthority:
        """The CA an earlier run wrote (``ca.crt``, ``ca.key``), to issue more certificates
        from it: the node's components join the control plane's existing trust."""
        ca = cls.__new__(cls)
        ca._key = load_key(key)
        ca._cert = x509.load_pem_x509_certificate(cert)
        return ca

    @property
    def cert_pem(self) -> bytes:
        return cert_pem(self._cert)

    @property
    def pair(self) -> KeyPair:
        return KeyPair(cert=cert_pem(self._cert), key=key_pem(self._key))

    def _issue(
        self,
        subject: x509.Name,
        usage: x509.ObjectIdentifier,
        sans: list[x509.GeneralName] | None,
    ) -> KeyPair:
        key = _new_key()
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                key_usage(ca=False),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return KeyPair(cert=cert_pem(cert), key=key_pem(key))

    def issue_serving(self, common_name: str, dns_names: list[str], ips: list[str]) -> KeyPair:
        """A TLS server certificate; clients verify it by the SANs, never the CN."""
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        return self._issue(subject, ExtendedKeyUsageOID.SERVER_AUTH, sans)

    def issue_client(self, user: str, groups: list[str]) -> KeyPair:
        """A client certificate: the API server reads the user from CN, groups from O."""
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, user)]
        attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
        return self._issue(x509.Name(attrs), ExtendedKeyUsageOID.CLIENT_AUTH, None)


def service_account_keys() -> tuple[bytes, bytes]:
    """(private PEM, public PEM) for signing and verifying service-account tokens."""
    key = _new_key()
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return key_pem(key), public
