"""The controller's configuration: its settings (``webhook.settings.ControllerSettings``,
read flag > environment > default, one model with the webhook's) and what they make
checked together: the webhook's TLS policy and the outage backstop's configuration."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epguard.webhook.controller import authority
from epguard.webhook.controller.compiler import BackstopConfig
from epguard.webhook.engine.workloads import PATH_KINDS
from epguard.webhook.settings import ControllerSettings, SettingsError, options_of, read


@dataclass(frozen=True)
class ControllerConfig(ControllerSettings):
    # The webhook's certificate authority; None: the controller does not manage the
    # certificates (manage_certs false).
    policy: authority.TLSPolicy | None = None
    # The outage backstop; None: off (and one left installed under backstop_name is
    # removed).
    backstop: BackstopConfig | None = None

    @property
    def tag_ttl(self) -> dt.timedelta:
        return dt.timedelta(hours=self.verdict_ttl_hours)

    @property
    def probe_key_rotation(self) -> dt.timedelta:
        return dt.timedelta(days=self.probe_key_rotation_days)


def parse(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ControllerConfig:
    """The controller's settings; SettingsError (one line) for a bad value."""
    c = ControllerConfig(
        **read(
            options_of(ControllerSettings),
            argv,
            env,
            prog="epguard-controller",
            description=(
                "epguard's controller (a kopf operator): manages the webhook's TLS "
                "certificate and CA bundle, and records probe outcomes. Each option also "
                "reads the EPGUARD_* environment variable named in its help; a flag beats "
                "the variable."
            ),
        )
    )
    try:
        extra_dns, extra_ips = authority.parse_subject_alt_names([c.extra_san])
    except ValueError as exc:
        raise SettingsError(f"--extra-san/EPGUARD_EXTRA_SANS: {exc}") from None
    policy: authority.TLSPolicy | None = None
    if c.manage_certs:
        service_names = authority.dns_names_for(c.service, c.namespace)
        try:
            policy = authority.TLSPolicy(
                # The Service's names first: the first one is also the certificate's CN.
                dns_names=service_names + tuple(n for n in extra_dns if n not in service_names),
                ip_addresses=extra_ips,
                ca_validity=c.ca_validity_hours,
                ca_renew_before=c.ca_renew_before_hours,
                cert_validity=c.cert_validity_hours,
                cert_renew_before=c.cert_renew_before_hours,
                overlap=c.ca_overlap_hours,
            )
        except ValueError as exc:
            raise SettingsError(f"certificate lifetimes: {exc}") from None
    backstop: BackstopConfig | None = None
    if c.backstop_enabled:
        backstop = BackstopConfig(
            params_namespace=c.namespace,
            name=c.backstop_name,
            default_mode=c.mode,
            allow_skip=c.allow_skip,
            excluded_namespaces=tuple(dict.fromkeys((*c.exclude_namespaces, c.namespace))),
            kinds=(*PATH_KINDS, *(k for k in c.extra_kinds if k.paths)),
            object_selector=c.object_selector,
        )
    return dataclasses.replace(c, policy=policy, backstop=backstop)
