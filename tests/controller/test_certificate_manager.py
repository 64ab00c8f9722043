"""The controller's TLS loop against an in-memory API that behaves like the API server
where it matters: resourceVersions, 409 on a lost race, webhooks in list order."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import re
from dataclasses import replace

import kopf
import pytest

from epguard.webhook.controller import HANDLER_MODULES
from epguard.webhook.controller import authority as certs
from epguard.webhook.controller.certificates import (
    MUTATING,
    VALIDATING,
    CertificateManager,
    Conflict,
    StoredSecret,
    StoredWebhookConfig,
    WebhookConfigRef,
    start_certificate_manager,
    stop_certificate_manager,
)
from epguard.webhook.controller.config import ControllerConfig, parse
from epguard.webhook.settings import SettingsError

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


class FakeApi:
    def __init__(self) -> None:
        self.versions = itertools.count(1)
        self.secrets: dict[tuple[str, str], StoredSecret] = {}
        self.configs: dict[WebhookConfigRef, StoredWebhookConfig] = {}
        self.secret_writes = 0
        self.bundle_patches = 0

    def add_config(self, kind: str, name: str, hooks: list[str]) -> WebhookConfigRef:
        ref = WebhookConfigRef(kind, name)
        self.configs[ref] = StoredWebhookConfig(
            uid=f"uid-{name}", webhooks=[(h, b"") for h in hooks]
        )
        return ref

    async def read_secret(self, namespace: str, name: str) -> StoredSecret | None:
        found = self.secrets.get((namespace, name))
        return replace(found, data=dict(found.data)) if found else None

    async def write_secret(
        self,
        namespace: str,
        name: str,
        secret: StoredSecret,
        owner: tuple[WebhookConfigRef, str] | None,
    ) -> None:
        key = (namespace, name)
        existing = self.secrets.get(key)
        if secret.resource_version is None and existing is not None:
            raise Conflict("already exists")
        if existing is not None and existing.resource_version != secret.resource_version:
            raise Conflict("resourceVersion changed")
        owners = (owner[1],) if owner else ()
        self.secrets[key] = StoredSecret(dict(secret.data), str(next(self.versions)), owners)
        self.secret_writes += 1

    async def read_webhook_config(self, ref: WebhookConfigRef) -> StoredWebhookConfig | None:
        found = self.configs.get(ref)
        return StoredWebhookConfig(found.uid, list(found.webhooks)) if found else None

    async def set_ca_bundle(
        self, ref: WebhookConfigRef, webhooks: list[tuple[int, str]], bundle: bytes
    ) -> None:
        cfg = self.configs[ref]
        for index, name in webhooks:
            if index >= len(cfg.webhooks) or cfg.webhooks[index][0] != name:
                raise Conflict("webhook moved")
            cfg.webhooks[index] = (name, bundle)
        self.bundle_patches += 1


def config(**overrides: object) -> ControllerConfig:
    env = {"EPGUARD_NAMESPACE": "epguard-system", "EPGUARD_MUTATING_WEBHOOK": "epguard-inject"}
    base = parse([], env=env)
    return replace(base, **overrides)  # type: ignore[arg-type]


@pytest.fixture
def api() -> FakeApi:
    fake = FakeApi()
    fake.add_config(VALIDATING, "epguard", ["pods.epguard.io", "workloads.epguard.io"])
    # The chart's two injection webhooks (namespace label / pod annotation opt-in).
    fake.add_config(
        MUTATING, "epguard-inject", ["namespace.inject.epguard.io", "annotation.inject.epguard.io"]
    )
    return fake


def manager(api: FakeApi, at: list[dt.datetime] | None = None) -> CertificateManager:
    clock = at or [T0]
    return CertificateManager(api, config(), clock=lambda: clock[0])


class TestFirstPass:
    async def test_it_creates_the_secret_and_fills_every_webhooks_ca_bundle(
        self, api: FakeApi
    ) -> None:
        result = await manager(api).reconcile_once()
        secret = api.secrets[("epguard-system", "epguard-tls")]
        bundle = secret.data[certs.CA_CRT]
        assert result.secret_written
        for cfg in api.configs.values():
            assert [b for _, b in cfg.webhooks] == [bundle] * len(cfg.webhooks)

    async def test_the_secret_is_owned_by_the_validating_configuration_for_uninstall(
        self, api: FakeApi
    ) -> None:
        await manager(api).reconcile_once()
        assert api.secrets[("epguard-system", "epguard-tls")].owner_uids == ("uid-epguard",)

    async def test_a_second_pass_writes_nothing(self, api: FakeApi) -> None:
        m = manager(api)
        await m.reconcile_once()
        writes, patches = api.secret_writes, api.bundle_patches
        result = await m.reconcile_once()
        assert (api.secret_writes, api.bundle_patches) == (writes, patches)
        assert not result.secret_written and not result.bundles_patched

    async def test_a_missing_configuration_still_gets_a_secret_and_a_quick_retry(self) -> None:
        empty = FakeApi()
        m = manager(empty)
        result = await m.reconcile_once()
        assert result.secret_written
        assert result.missing_configs == [
            "ValidatingWebhookConfiguration/epguard",
            "MutatingWebhookConfiguration/epguard-inject",
        ]
        assert m.delay_after(result) <= 5.0

    async def test_the_owner_is_added_once_the_configuration_appears(self) -> None:
        late = FakeApi()
        m = manager(late)
        await m.reconcile_once()
        assert not late.secrets[("epguard-system", "epguard-tls")].owner_uids
        late.add_config(VALIDATING, "epguard", ["pods.epguard.io"])
        await m.reconcile_once()
        assert late.secrets[("epguard-system", "epguard-tls")].owner_uids == ("uid-epguard",)


class TestDrift:
    async def test_a_ca_bundle_reset_by_an_upgrade_is_restored(self, api: FakeApi) -> None:
        m = manager(api)
        await m.reconcile_once()
        ref = WebhookConfigRef(VALIDATING, "epguard")
        api.configs[ref].webhooks[1] = ("workloads.epguard.io", b"")
        result = await m.reconcile_once()
        assert result.bundles_patched == ["ValidatingWebhookConfiguration/epguard"]
        assert api.configs[ref].webhooks[1][1] != b""

    async def test_a_deleted_secret_is_recreated_and_the_new_ca_published(
        self, api: FakeApi
    ) -> None:
        m = manager(api)
        await m.reconcile_once()
        old = api.secrets.pop(("epguard-system", "epguard-tls")).data[certs.CA_CRT]
        await m.reconcile_once()
        new = api.secrets[("epguard-system", "epguard-tls")].data[certs.CA_CRT]
        assert new != old
        ref = WebhookConfigRef(VALIDATING, "epguard")
        assert {b for _, b in api.configs[ref].webhooks} == {new}

    async def test_a_ca_rotation_publishes_both_cas_before_the_new_one_signs(
        self, api: FakeApi
    ) -> None:
        clock = [T0]
        m = manager(api, clock)
        await m.reconcile_once()
        ca = certs.load_bundle(api.secrets[("epguard-system", "epguard-tls")].data[certs.CA_CRT])
        clock[0] = ca[0].not_valid_after_utc - m.policy.ca_renew_before
        await m.reconcile_once()
        ref = WebhookConfigRef(VALIDATING, "epguard")
        published = certs.load_bundle(api.configs[ref].webhooks[0][1])
        assert len(published) == 2
        result = await m.reconcile_once()
        assert result.next_action_at is not None
        assert 0 < m.delay_after(result) <= m.policy.overlap.total_seconds() + 1


class TestRaces:
    async def test_two_replicas_starting_together_agree_on_one_secret(self, api: FakeApi) -> None:
        a, b = manager(api), manager(api)
        await a.reconcile_once()
        # b read "no Secret" before a's write landed: its create must lose, not overwrite.
        original_read = api.read_secret

        async def stale_read(namespace: str, name: str) -> StoredSecret | None:
            return None

        api.read_secret = stale_read  # type: ignore[method-assign]
        with pytest.raises(Conflict):
            await b.reconcile_once()
        api.read_secret = original_read  # type: ignore[method-assign]
        written = api.secret_writes
        result = await b.reconcile_once()
        assert not result.secret_written and api.secret_writes == written

    async def test_the_loop_survives_errors_and_stops_when_asked(self, api: FakeApi) -> None:
        calls = 0

        async def broken(namespace: str, name: str) -> StoredSecret | None:
            nonlocal calls
            calls += 1
            raise RuntimeError("API server restarting")

        api.read_secret = broken  # type: ignore[method-assign]
        m = CertificateManager(api, config(poll_interval=0.01), clock=lambda: T0)
        stop = asyncio.Event()
        task = asyncio.create_task(m.run(stop))
        while calls < 3:
            await asyncio.sleep(0)
            await asyncio.sleep(0.005)
        stop.set()
        await asyncio.wait_for(task, timeout=60)
        assert calls >= 3


class TestKopfWiring:
    def test_the_certificates_module_is_a_registered_handler_module(self) -> None:
        assert "epguard.webhook.controller.certificates" in HANDLER_MODULES

    async def test_startup_runs_the_loop_and_cleanup_stops_it(self, api: FakeApi) -> None:
        async def factory() -> FakeApi:
            return api

        memo = kopf.Memo(config=config(), tls_api_factory=factory)
        await start_certificate_manager(memo=memo)
        while not api.secret_writes:
            await asyncio.sleep(0.01)
        await stop_certificate_manager(memo=memo)
        assert memo["tls_task"].done()

    async def test_with_cert_manager_the_controller_leaves_tls_alone(self, api: FakeApi) -> None:
        memo = kopf.Memo(config=config(manage_certs=False, policy=None))
        await start_certificate_manager(memo=memo)
        assert "tls_task" not in memo


class TestConfig:
    def test_every_option_reads_its_environment_variable(self) -> None:
        cfg = parse(
            [],
            env={
                "EPGUARD_NAMESPACE": "ns1",
                "EPGUARD_TLS_SECRET": "s1",
                "EPGUARD_SERVICE": "svc1",
                "EPGUARD_VALIDATING_WEBHOOK": "v1",
                "EPGUARD_MUTATING_WEBHOOK": "m1",
                "EPGUARD_MANAGE_CERTS": "false",
                "EPGUARD_PEERING": "",
                "EPGUARD_CERT_POLL_SECONDS": "7",
            },
        )
        assert (cfg.namespace, cfg.tls_secret, cfg.service) == ("ns1", "s1", "svc1")
        assert (cfg.validating_webhook, cfg.mutating_webhook) == ("v1", "m1")
        assert cfg.manage_certs is False and cfg.policy is None
        assert cfg.peering == "" and cfg.poll_interval == 7

    def test_the_serving_cert_covers_the_service_dns_names(self) -> None:
        cfg = parse(["--service", "w", "--namespace", "n"], env={})
        assert cfg.policy is not None
        assert cfg.policy.dns_names[0] == "w.n.svc"

    def test_lifetimes_that_cannot_rotate_safely_are_refused(self) -> None:
        with pytest.raises(SettingsError, match="ca_renew_before must be shorter"):
            parse(["--ca-validity-hours", "10", "--ca-renew-before-hours", "20"], env={})


class TestExtraSANOption:
    def test_repeated_and_comma_separated_flags_add_addresses_and_names(self) -> None:
        cfg = parse(["--extra-san", "127.0.0.1", "--extra-san", "localhost,::1"], env={})
        assert cfg.policy is not None
        assert [str(ip) for ip in cfg.policy.ip_addresses] == ["127.0.0.1", "::1"]
        assert cfg.policy.dns_names == (
            *certs.dns_names_for("epguard-webhook", "epguard-system"),
            "localhost",
        )

    def test_the_environment_variable_takes_a_space_or_comma_separated_list(self) -> None:
        cfg = parse([], env={"EPGUARD_EXTRA_SANS": "127.0.0.1, ::1 dev.local"})
        assert cfg.policy is not None
        assert [str(ip) for ip in cfg.policy.ip_addresses] == ["127.0.0.1", "::1"]
        assert cfg.policy.dns_names[-1] == "dev.local"

    def test_the_flag_replaces_the_environment_variable(self) -> None:
        cfg = parse(["--extra-san", "10.1.2.3"], env={"EPGUARD_EXTRA_SANS": "127.0.0.1"})
        assert cfg.policy is not None
        assert [str(ip) for ip in cfg.policy.ip_addresses] == ["10.1.2.3"]

    def test_a_service_name_given_again_is_not_repeated(self) -> None:
        cfg = parse(["--extra-san", "epguard-webhook.epguard-system.svc"], env={})
        assert cfg.policy is not None
        assert cfg.policy.dns_names == certs.dns_names_for("epguard-webhook", "epguard-system")

    def test_by_default_the_cert_names_only_the_service(self) -> None:
        cfg = parse([], env={})
        assert cfg.policy is not None and cfg.policy.ip_addresses == ()
        assert cfg.policy.dns_names == certs.dns_names_for("epguard-webhook", "epguard-system")

    def test_a_value_that_is_neither_address_nor_name_stops_the_start_and_says_which(
        self,
    ) -> None:
        with pytest.raises(SettingsError, match=re.escape("https://127.0.0.1:8443")):
            parse(["--extra-san", "https://127.0.0.1:8443"], env={})

    async def test_the_controller_issues_a_cert_a_client_dialling_127_0_0_1_accepts(
        self, api: FakeApi
    ) -> None:
        cfg = parse(["--extra-san", "127.0.0.1"], env={})
        await CertificateManager(api, cfg, clock=lambda: T0).reconcile_once()
        stored = await api.read_secret(cfg.namespace, cfg.tls_secret)
        assert stored is not None
        leaf = certs.load_bundle(stored.data[certs.TLS_CRT])[0]
        assert [str(ip) for ip in certs.san_ip_addresses(leaf)] == ["127.0.0.1"]
