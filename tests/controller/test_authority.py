"""The pure certificate logic: issuance, renewal, and a CA rotation walked through
simulated years, checking at every step that the API server can verify the webhook."""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import ssl
import tempfile
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from epguard.webhook.controller import authority as certs

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


# A real handshake checks the certificate against the real clock, so what is handshaken
# is issued now (a fixed T0 would expire under the test a year after it).
def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


MISMATCH = "[Hh]ostname mismatch|IP address mismatch"
NAMES = certs.dns_names_for("epguard-webhook", "epguard-system")
POLICY = certs.TLSPolicy(dns_names=NAMES)


def leaf_of(data: dict[str, bytes]) -> x509.Certificate:
    return certs.load_bundle(data[certs.TLS_CRT])[0]


def bundle_of(data: dict[str, bytes]) -> list[x509.Certificate]:
    return certs.load_bundle(data[certs.CA_CRT])


def trusted(leaf: x509.Certificate, bundle: list[x509.Certificate], at: dt.datetime) -> bool:
    return any(
        certs.verifies(leaf, ca) and ca.not_valid_before_utc <= at < ca.not_valid_after_utc
        for ca in bundle
    ) and (leaf.not_valid_before_utc <= at < leaf.not_valid_after_utc)


def handshake(data: dict[str, bytes], ca_bundle: bytes, server_name: str) -> None:
    """A real TLS 1.2+ handshake in memory: the server presents tls.crt/tls.key, the
    client trusts only ``ca_bundle`` and checks ``server_name`` as the API server does."""
    with tempfile.TemporaryDirectory() as tmp:
        crt, key = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        crt.write_bytes(data[certs.TLS_CRT])
        key.write_bytes(data[certs.TLS_KEY])
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(crt, key)
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    client_ctx.load_verify_locations(cadata=ca_bundle.decode())
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=server_name)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for side, obj in (("client", client), ("server", server)):
            if done[side]:
                continue
            try:
                obj.do_handshake()
                done[side] = True
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return
    raise AssertionError("handshake did not complete")


class TestIssuance:
    def test_an_empty_secret_gets_a_ca_and_a_serving_cert_signed_by_it(self) -> None:
        d = certs.reconcile(None, POLICY, T0)
        assert d.changed
        assert set(d.data) == {certs.CA_CRT, certs.CA_KEY, certs.TLS_CRT, certs.TLS_KEY}
        (ca,) = bundle_of(d.data)
        assert certs.verifies(leaf_of(d.data), ca)
        assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca

    def test_the_serving_cert_names_the_service_and_is_for_server_auth_only(self) -> None:
        leaf = leaf_of(certs.reconcile(None, POLICY, T0).data)
        assert set(certs.san_dns_names(leaf)) == set(NAMES)
        eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca

    def test_a_tls_client_trusting_only_ca_crt_accepts_the_service_name(self) -> None:
        d = certs.reconcile(None, POLICY, now()).data
        handshake(d, d[certs.CA_CRT], "epguard-webhook.epguard-system.svc")

    def test_a_tls_client_rejects_a_name_the_cert_was_not_issued_for(self) -> None:
        d = certs.reconcile(None, POLICY, now()).data
        with pytest.raises(ssl.SSLCertVerificationError, match=MISMATCH):
            handshake(d, d[certs.CA_CRT], "other.epguard-system.svc")

    def test_certificates_are_backdated_for_api_servers_with_slow_clocks(self) -> None:
        d = certs.reconcile(None, POLICY, T0).data
        assert leaf_of(d).not_valid_before_utc <= T0 - dt.timedelta(minutes=1)

    def test_a_second_pass_at_the_same_moment_changes_nothing(self) -> None:
        first = certs.reconcile(None, POLICY, T0)
        again = certs.reconcile(first.data, POLICY, T0 + dt.timedelta(minutes=1))
        assert not again.changed
        assert again.data == first.data

    def test_garbage_in_the_secret_is_replaced_by_a_working_set(self) -> None:
        junk = {certs.CA_CRT: b"not pem", certs.CA_KEY: b"nope", certs.TLS_CRT: b"", "x": b"1"}
        d = certs.reconcile(junk, POLICY, T0)
        assert d.changed and "missing, unreadable or expired" in d.reasons[0]
        assert certs.verifies(leaf_of(d.data), bundle_of(d.data)[0])

    def test_a_ca_key_that_matches_no_trusted_ca_starts_over(self) -> None:
        d = certs.reconcile(None, POLICY, T0).data
        other = certs.reconcile(None, POLICY, T0).data
        mixed = dict(d, **{certs.CA_KEY: other[certs.CA_KEY]})
        out = certs.reconcile(mixed, POLICY, T0)
        assert out.changed
        assert bundle_of(out.data)[0].serial_number != bundle_of(d)[0].serial_number

    def test_the_serving_cert_never_outlives_its_ca(self) -> None:
        short = certs.TLSPolicy(
            dns_names=NAMES,
            ca_validity=dt.timedelta(days=100),
            ca_renew_before=dt.timedelta(days=10),
            cert_validity=dt.timedelta(days=365),
            cert_renew_before=dt.timedelta(days=30),
        )
        d = certs.reconcile(None, short, T0).data
        assert leaf_of(d).not_valid_after_utc <= bundle_of(d)[0].not_valid_after_utc


class TestRenewal:
    def test_the_serving_cert_is_reissued_inside_its_renewal_window_from_the_same_ca(
        self,
    ) -> None:
        d0 = certs.reconcile(None, POLICY, T0).data
        before = T0 + POLICY.cert_validity - POLICY.cert_renew_before - dt.timedelta(hours=1)
        assert not certs.reconcile(d0, POLICY, before).changed
        after = before + dt.timedelta(hours=2)
        d1 = certs.reconcile(d0, POLICY, after)
        assert d1.changed
        assert d1.data[certs.CA_CRT] == d0[certs.CA_CRT]
        assert leaf_of(d1.data).serial_number != leaf_of(d0).serial_number
        assert leaf_of(d1.data).not_valid_after_utc > leaf_of(d0).not_valid_after_utc

    def test_a_changed_service_name_reissues_only_the_serving_cert(self) -> None:
        d0 = certs.reconcile(None, POLICY, T0).data
        renamed = certs.TLSPolicy(dns_names=certs.dns_names_for("renamed", "epguard-system"))
        d1 = certs.reconcile(d0, renamed, T0)
        assert d1.changed
        assert d1.data[certs.CA_CRT] == d0[certs.CA_CRT]
        assert "renamed.epguard-system.svc" in certs.san_dns_names(leaf_of(d1.data))

    def test_a_serving_cert_from_a_foreign_ca_is_replaced(self) -> None:
        d0 = certs.reconcile(None, POLICY, T0).data
        foreign = certs.reconcile(None, POLICY, T0).data
        mixed = dict(d0, **{k: foreign[k] for k in (certs.TLS_CRT, certs.TLS_KEY)})
        d1 = certs.reconcile(mixed, POLICY, T0)
        assert d1.changed and any("not issued by the active CA" in r for r in d1.reasons)


class TestCARotation:
    def test_a_new_ca_is_trusted_before_it_signs_and_signs_after_the_overlap(self) -> None:
        d0 = certs.reconcile(None, POLICY, T0).data
        (old_ca,) = bundle_of(d0)
        staging = old_ca.not_valid_after_utc - POLICY.ca_renew_before + dt.timedelta(hours=1)
        d1 = certs.reconcile(d0, POLICY, staging).data
        assert certs.CA_NEXT_KEY in d1
        assert len(bundle_of(d1)) == 2
        # Still signed by the old CA: API servers may not have the new bundle yet.
        assert certs.verifies(leaf_of(d1), old_ca)

        not_yet = certs.reconcile(d1, POLICY, staging + POLICY.overlap - dt.timedelta(minutes=10))
        assert certs.verifies(leaf_of(not_yet.data), old_ca)

        d2 = certs.reconcile(d1, POLICY, staging + POLICY.overlap).data
        new_ca = bundle_of(d1)[0]
        assert certs.CA_NEXT_KEY not in d2
        assert certs.verifies(leaf_of(d2), new_ca)
        # The old CA stays trusted: pods still serving the old cert for a minute work.
        assert any(c.serial_number == old_ca.serial_number for c in bundle_of(d2))
        assert trusted(leaf_of(d1), bundle_of(d2), staging + POLICY.overlap)

    def test_an_expired_ca_leaves_the_bundle(self) -> None:
        d = certs.reconcile(None, POLICY, T0).data
        (first_ca,) = bundle_of(d)
        at = T0
        while at < first_ca.not_valid_after_utc + dt.timedelta(days=1):
            at += dt.timedelta(days=7)
            d = certs.reconcile(d, POLICY, at).data
        assert all(c.serial_number != first_ca.serial_number for c in bundle_of(d))

    def test_ten_years_of_daily_passes_never_leave_the_webhook_unverifiable(self) -> None:
        """At every pass: the API server holding the *previous* bundle still verifies the
        *new* serving cert (the caBundle patch lags the Secret), and the new bundle still
        verifies the *previous* serving cert (webhook pods reload files with a lag)."""
        d = certs.reconcile(None, POLICY, T0).data
        at = T0
        issuers: set[int] = set()
        for _ in range(10 * 365):
            at += dt.timedelta(days=1)
            new = certs.reconcile(d, POLICY, at).data
            assert trusted(leaf_of(new), bundle_of(new), at)
            assert trusted(leaf_of(new), bundle_of(d), at), f"new cert not in old bundle at {at}"
            assert trusted(leaf_of(d), bundle_of(new), at), f"old cert dropped early at {at}"
            issuers.add(
                next(c.serial_number for c in bundle_of(new) if certs.verifies(leaf_of(new), c))
            )
            d = new
        assert len(issuers) >= 2  # the walk did cross a CA rotation

    def test_a_staged_key_without_its_ca_in_the_bundle_is_discarded(self) -> None:
        d0 = certs.reconcile(None, POLICY, T0).data
        stray = dict(d0, **{certs.CA_NEXT_KEY: certs.key_pem(certs.new_key())})
        d1 = certs.reconcile(stray, POLICY, T0)
        assert certs.CA_NEXT_KEY not in d1.data
        assert d1.data[certs.CA_CRT] == d0[certs.CA_CRT]


class TestSchedule:
    def test_the_next_action_is_the_serving_cert_renewal_for_a_fresh_set(self) -> None:
        d = certs.reconcile(None, POLICY, T0).data
        when = certs.next_action_at(d, POLICY)
        assert when == leaf_of(d).not_valid_after_utc - POLICY.cert_renew_before

    def test_while_a_ca_is_staged_the_next_action_is_its_promotion(self) -> None:
        d0 = certs.reconcile(None, POLICY, T0).data
        staging = bundle_of(d0)[0].not_valid_after_utc - POLICY.ca_renew_before
        d1 = certs.reconcile(d0, POLICY, staging).data
        when = certs.next_action_at(d1, POLICY)
        assert when is not None
        assert staging <= when <= staging + POLICY.overlap

    def test_unusable_data_means_act_now(self) -> None:
        assert certs.next_action_at({}, POLICY) is None


class TestPolicy:
    @pytest.mark.parametrize(
        "kwargs",
        [
            {"dns_names": ()},
            {"dns_names": NAMES, "ca_renew_before": dt.timedelta(days=5 * 365)},
            {"dns_names": NAMES, "cert_renew_before": dt.timedelta(days=365)},
            {"dns_names": NAMES, "overlap": dt.timedelta(days=90)},
        ],
    )
    def test_inconsistent_lifetimes_are_refused(self, kwargs: dict[str, object]) -> None:
        with pytest.raises(ValueError):
            certs.TLSPolicy(**kwargs)  # type: ignore[arg-type]

    def test_a_naive_time_is_refused(self) -> None:
        with pytest.raises(ValueError):
            certs.reconcile(None, POLICY, dt.datetime(2026, 1, 1))


LOOPBACK = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))
LOCAL_POLICY = certs.TLSPolicy(dns_names=(*NAMES, "localhost"), ip_addresses=LOOPBACK)


class TestExtraSubjectAlternativeNames:
    """A webhook the API server reaches by address (devcluster's local stack calls
    https://127.0.0.1:PORT/validate) needs IP SANs besides the Service's DNS names."""

    def test_the_serving_cert_carries_the_extra_ip_addresses_and_names(self) -> None:
        leaf = leaf_of(certs.reconcile(None, LOCAL_POLICY, T0).data)
        assert set(certs.san_ip_addresses(leaf)) == set(LOOPBACK)
        assert set(certs.san_dns_names(leaf)) == {*NAMES, "localhost"}

    @pytest.mark.parametrize("address", ["127.0.0.1", "::1"])
    def test_a_tls_client_dialling_the_address_accepts_the_cert(self, address: str) -> None:
        d = certs.reconcile(None, LOCAL_POLICY, now()).data
        handshake(d, d[certs.CA_CRT], address)

    def test_without_the_extra_address_a_client_dialling_it_refuses_the_cert(self) -> None:
        d = certs.reconcile(None, POLICY, now()).data
        with pytest.raises(ssl.SSLCertVerificationError, match=MISMATCH):
            handshake(d, d[certs.CA_CRT], "127.0.0.1")

    def test_adding_an_address_reissues_only_the_serving_cert_and_then_settles(self) -> None:
        d0 = certs.reconcile(None, POLICY, T0).data
        d1 = certs.reconcile(d0, LOCAL_POLICY, T0)
        assert d1.changed and d1.data[certs.CA_CRT] == d0[certs.CA_CRT]
        assert set(certs.san_ip_addresses(leaf_of(d1.data))) == set(LOOPBACK)
        assert not certs.reconcile(d1.data, LOCAL_POLICY, T0).changed

    def test_removing_an_address_reissues_the_serving_cert_without_it(self) -> None:
        d0 = certs.reconcile(None, LOCAL_POLICY, T0).data
        d1 = certs.reconcile(d0, certs.TLSPolicy(dns_names=LOCAL_POLICY.dns_names), T0)
        assert any("IP addresses changed" in r for r in d1.reasons)
        assert certs.san_ip_addresses(leaf_of(d1.data)) == ()

    def test_the_service_name_stays_the_common_name(self) -> None:
        leaf = leaf_of(certs.reconcile(None, LOCAL_POLICY, T0).data)
        (cn,) = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        assert cn.value == NAMES[0]


class TestParseSubjectAlternativeNames:
    def test_addresses_and_names_are_told_apart_in_order_without_repeats(self) -> None:
        dns, ips = certs.parse_subject_alt_names(
            ["127.0.0.1", "localhost,::1", " Webhook.Example.COM. ", "127.0.0.1 localhost"]
        )
        assert dns == ("localhost", "webhook.example.com")
        assert ips == LOOPBACK

    def test_nothing_is_nothing(self) -> None:
        assert certs.parse_subject_alt_names(["", " , "]) == ((), ())

    @pytest.mark.parametrize(
        "bad", ["https://127.0.0.1", "[::1]", "under_score.local", "-x.example", "a..b", "*.x.io"]
    )
    def test_anything_else_is_refused_with_its_text(self, bad: str) -> None:
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            certs.parse_subject_alt_names([bad])

    def test_a_name_longer_than_dns_allows_is_refused(self) -> None:
        with pytest.raises(ValueError):
            certs.parse_subject_alt_names([".".join(["a" * 63] * 5)])
