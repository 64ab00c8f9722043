"""Self-managed TLS for the admission webhook: a private CA, a serving certificate, and
rotation of both with an overlap in which the old and the new CA are trusted together.

Everything here is pure: it takes the current Secret data and the time, and returns the
Secret data that should exist now. The controller (``webhook.controller.certificates``)
does the API calls. Keeping the decisions pure is what lets the tests walk a whole
rotation through years of simulated time without a cluster.

Secret layout (type ``kubernetes.io/tls``, so cert-manager's layout is a subset of it):

``tls.crt``      the serving certificate (leaf only; the API server trusts the CA bundle)
``tls.key``      its private key
``ca.crt``       the CA bundle the API server must trust: every unexpired CA, newest first
``ca.key``       the key of the CA that signs ``tls.crt`` ("active" CA)
``ca-next.key``  only during a CA rotation: the key of the new CA, already in ``ca.crt``
                 but not yet signing. It is promoted once it has been trusted for the
                 overlap period, so no API server ever sees a serving cert it cannot verify.

The webhook pods mount only ``tls.crt`` and ``tls.key`` (the chart projects those two
items), so the CA keys never reach the process that faces the network.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from epguard.webhook import settings

TLS_CRT = "tls.crt"
TLS_KEY = "tls.key"
CA_CRT = "ca.crt"
CA_KEY = "ca.key"
CA_NEXT_KEY = "ca-next.key"

# Certificates are backdated by this much: a freshly minted cert must already be valid on
# an API server whose clock runs a little behind the controller's.
CLOCK_SKEW = dt.timedelta(minutes=5)

PrivateKey = ec.EllipticCurvePrivateKey
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# One DNS label (RFC 1123): letters, digits and inner hyphens, at most 63 characters.
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class TLSPolicy:
    """Lifetimes and thresholds; the defaults are the controller's options' defaults."""

    dns_names: tuple[str, ...]
    ca_validity: dt.timedelta = settings.CA_VALIDITY
    ca_renew_before: dt.timedelta = settings.CA_RENEW_BEFORE
    cert_validity: dt.timedelta = settings.CERT_VALIDITY
    cert_renew_before: dt.timedelta = settings.CERT_RENEW_BEFORE
    overlap: dt.timedelta = settings.CA_OVERLAP
    ca_common_name: str = "epguard-webhook-ca"
    # IP SANs besides the DNS names, for a webhook reached by address (a local dev stack
    # whose webhook configuration says https://127.0.0.1:PORT/...).
    ip_addresses: tuple[IPAddress, ...] = ()

    def __post_init__(self) -> None:
        if not self.dns_names:
            raise ValueError("TLSPolicy needs at least one DNS name")
        if self.ca_renew_before >= self.ca_validity:
            raise ValueError("ca_renew_before must be shorter than ca_validity")
        if self.cert_renew_before >= self.cert_validity:
            raise ValueError("cert_renew_before must be shorter than cert_validity")
        if self.overlap >= self.ca_renew_before:
            # Otherwise the old CA could expire before its successor is allowed to sign.
            raise ValueError("overlap must be shorter than ca_renew_before")


@dataclass(frozen=True)
class Decision:
    """What reconcile() concluded: the Secret data to store, and why it changed.

    ``changed`` is False when ``data`` equals the input; callers then write nothing."""

    data: dict[str, bytes]
    changed: bool
    reasons: tuple[str, ...] = field(default=())


# --- primitives ---------------------------------------------------------------------------


def key_usage(*, ca: bool) -> x509.KeyUsage:
    """Key usage of a CA (signs certificates and CRLs) or of a leaf (signs handshakes)."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def new_key() -> PrivateKey:
    # P-256: small, fast handshakes, accepted by every Kubernetes API server.
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def load_key(pem: bytes) -> PrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("expected an EC private key")
    return key


def load_bundle(pem: bytes) -> list[x509.Certificate]:
    """Every certificate in a PEM bundle, in order; an empty or broken bundle is []."""
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        return []


def bundle_pem(certs: Sequence[x509.Certificate]) -> bytes:
    return b"".join(cert_pem(c) for c in certs)


def _same_key(cert: x509.Certificate, key: PrivateKey) -> bool:
    return cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) == key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def make_ca(key: PrivateKey, policy: TLSPolicy, now: dt.datetime) -> x509.Certificate:
    # The serial's high bits make two CAs minted in the same second distinguishable in
    # the bundle and in `openssl x509 -text` output.
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, policy.ca_common_name),
            x509.NameAttribute(NameOID.SERIAL_NUMBER, format(x509.random_serial_number(), "x")),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + policy.ca_validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            key_usage(ca=True),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )


def make_serving_cert(
    key: PrivateKey,
    ca: x509.Certificate,
    ca_key: PrivateKey,
    policy: TLSPolicy,
    now: dt.datetime,
) -> x509.Certificate:
    # Never outlive the issuing CA: a leaf valid past its CA would fail verification
    # at the CA's expiry, which is the outage rotation exists to prevent.
    not_after = min(now + policy.cert_validity, ca.not_valid_after_utc)
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, policy.dns_names[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            key_usage(ca=False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    *(x509.DNSName(n) for n in policy.dns_names),
                    *(x509.IPAddress(ip) for ip in policy.ip_addresses),
                ]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def parse_subject_alt_names(values: Iterable[str]) -> tuple[tuple[str, ...], tuple[IPAddress, ...]]:
    """Split extra SANs as an admin writes them (``127.0.0.1``, ``::1``, ``localhost``,
    ``webhook.example.com``; several in one string separated by commas or
    whitespace) into DNS names and IP addresses, in
    order and without repeats. Raises ValueError naming the first entry that is neither an
    IP address nor a valid DNS name."""
    dns: list[str] = []
    ips: list[IPAddress] = []
    for value in values:
        for raw in re.split(r"[,\s]+", value):
            item = raw.strip()
            if not item:
                continue
            try:
                ip = ipaddress.ip_address(item)
            except ValueError:
                pass
            else:
                if ip not in ips:
                    ips.append(ip)
                continue
            name = item.lower().rstrip(".")
            labels = name.split(".")
            if len(name) > 253 or not all(_LABEL.match(label) for label in labels):
                raise ValueError(f"not an IP address or a DNS name: {item!r}")
            if name not in dns:
                dns.append(name)
    return tuple(dns), tuple(ips)


def dns_names_for(service: str, namespace: str) -> tuple[str, ...]:
    """The names the API server may use for a webhook Service (it uses the .svc form)."""
    return (
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
        f"{service}.{namespace}",
        service,
    )


def verifies(leaf: x509.Certificate, ca: x509.Certificate) -> bool:
    """True when ``ca`` signed ``leaf`` (signature and issuer name)."""
    if leaf.issuer != ca.subject:
        return False
    try:
        leaf.verify_directly_issued_by(ca)
    except Exception:  # InvalidSignature, ValueError, TypeError: all mean "not this CA"
        return False
    return True


def san_dns_names(cert: x509.Certificate) -> tuple[str, ...]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(san.get_values_for_type(x509.DNSName))


def san_ip_addresses(cert: x509.Certificate) -> tuple[IPAddress, ...]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(
        ip
        for ip in san.get_values_for_type(x509.IPAddress)
        if isinstance(ip, ipaddress.IPv4Address | ipaddress.IPv6Address)
    )


# --- the decision -------------------------------------------------------------------------


def _load_optional_key(data: Mapping[str, bytes], name: str) -> PrivateKey | None:
    raw = data.get(name)
    if not raw:
        return None
    try:
        return load_key(raw)
    except (ValueError, TypeError):
        return None


def reconcile(data: Mapping[str, bytes] | None, policy: TLSPolicy, now: dt.datetime) -> Decision:
    """Return the Secret data that should exist at ``now``.

    Steps, each only when needed:
    1. nothing usable (no Secret, no CA key, CA key matching no trusted CA): start over;
    2. drop expired CAs from the bundle;
    3. promote a staged CA that has been trusted for ``policy.overlap``: it becomes the
       signer and the serving cert is reissued from it (the old CA stays trusted until it
       expires, covering webhook pods that still serve the old cert for a minute);
    4. stage a new CA when the active one is within ``ca_renew_before`` of expiry;
    5. reissue the serving cert when it is missing, not from the active CA, has the wrong
       DNS names or IP addresses, or is within ``cert_renew_before`` of expiry.
    """
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    current = dict(data or {})
    reasons: list[str] = []

    bundle = [c for c in load_bundle(current.get(CA_CRT, b"")) if c.not_valid_after_utc > now]
    ca_key = _load_optional_key(current, CA_KEY)
    active = next((c for c in bundle if ca_key and _same_key(c, ca_key)), None)

    if ca_key is None or active is None:
        ca_key = new_key()
        active = make_ca(ca_key, policy, now)
        first_key = new_key()
        first = make_serving_cert(first_key, active, ca_key, policy, now)
        fresh = {
            CA_CRT: cert_pem(active),
            CA_KEY: key_pem(ca_key),
            TLS_CRT: cert_pem(first),
            TLS_KEY: key_pem(first_key),
        }
        why = "created a new CA and serving certificate"
        if data:
            why += " (the stored CA was missing, unreadable or expired)"
        return Decision(data=fresh, changed=True, reasons=(why,))

    if len(bundle) != len(load_bundle(current.get(CA_CRT, b""))):
        reasons.append("dropped expired CAs from the bundle")

    next_key = _load_optional_key(current, CA_NEXT_KEY)
    staged = next((c for c in bundle if next_key and _same_key(c, next_key)), None)
    if current.get(CA_NEXT_KEY) and staged is None:
        # A staged key without its CA in the bundle cannot be promoted safely: forget it,
        # step 4 stages a fresh one if it is still needed.
        current.pop(CA_NEXT_KEY, None)
        next_key = None
        reasons.append("discarded a staged CA key whose certificate is not trusted")

    force_leaf = False
    if staged is not None and next_key is not None:
        trusted_since = staged.not_valid_before_utc + CLOCK_SKEW
        if now - trusted_since >= policy.overlap:
            active = staged
            ca_key = next_key
            current[CA_KEY] = key_pem(ca_key)
            current.pop(CA_NEXT_KEY, None)
            staged = None
            force_leaf = True
            reasons.append("promoted the staged CA to signer after the overlap period")

    if staged is None and active.not_valid_after_utc - now <= policy.ca_renew_before:
        fresh_key = new_key()
        bundle.insert(0, make_ca(fresh_key, policy, now))
        current[CA_NEXT_KEY] = key_pem(fresh_key)
        reasons.append("staged a new CA (trusted now, signing after the overlap)")

    current[CA_CRT] = bundle_pem(bundle)

    leaf = next(iter(load_bundle(current.get(TLS_CRT, b""))), None)
    leaf_key = _load_optional_key(current, TLS_KEY)
    why_leaf = None
    if force_leaf:
        why_leaf = ""
    elif leaf is None or leaf_key is None or not _same_key(leaf, leaf_key):
        why_leaf = "the serving certificate or its key was missing or mismatched"
    elif not verifies(leaf, active):
        why_leaf = "the serving certificate was not issued by the active CA"
    elif set(san_dns_names(leaf)) != set(policy.dns_names):
        why_leaf = "the serving certificate's DNS names changed"
    elif set(san_ip_addresses(leaf)) != set(policy.ip_addresses):
        why_leaf = "the serving certificate's IP addresses changed"
    elif leaf.not_valid_after_utc - now <= policy.cert_renew_before:
        why_leaf = "the serving certificate is due for renewal"
    if why_leaf is not None:
        leaf_key = new_key()
        leaf = make_serving_cert(leaf_key, active, ca_key, policy, now)
        current[TLS_CRT] = cert_pem(leaf)
        current[TLS_KEY] = key_pem(leaf_key)
        if why_leaf:
            reasons.append(f"reissued the serving certificate: {why_leaf}")

    changed = current != dict(data or {})
    return Decision(data=current, changed=changed, reasons=tuple(reasons))


def next_action_at(data: Mapping[str, bytes], policy: TLSPolicy) -> dt.datetime | None:
    """When reconcile() will next have something to do, given unchanged input; None when
    the data is unusable (reconcile now). The controller sleeps until then (bounded by its
    poll interval), so a rotation happens on time even with a long poll interval."""
    bundle = load_bundle(data.get(CA_CRT, b""))
    leaf = next(iter(load_bundle(data.get(TLS_CRT, b""))), None)
    ca_key = _load_optional_key(data, CA_KEY)
    active = next((c for c in bundle if ca_key and _same_key(c, ca_key)), None)
    if leaf is None or active is None:
        return None
    moments = [leaf.not_valid_after_utc - policy.cert_renew_before]
    moments += [c.not_valid_after_utc for c in bundle]
    next_key = _load_optional_key(data, CA_NEXT_KEY)
    staged = next((c for c in bundle if next_key and _same_key(c, next_key)), None)
    if staged is not None:
        moments.append(staged.not_valid_before_utc + CLOCK_SKEW + policy.overlap)
    else:
        # With a CA already staged, the active CA's renewal moment has passed and is
        # no longer a reason to act.
        moments.append(active.not_valid_after_utc - policy.ca_renew_before)
    return min(moments)
