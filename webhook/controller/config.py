"""The controller's settings: ``webhook.settings.CONTROLLER_OPTIONS`` (flag > environment
> default, one model with the webhook's), checked into a :class:`ControllerConfig`."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epguard.webhook.controller import authority
from epguard.webhook.controller.compiler import BackstopConfig
from epguard.webhook.engine.workloads import PATH_KINDS
from epguard.webhook.settings import CONTROLLER_OPTIONS, SettingsError, read


@dataclass(frozen=True)
class ControllerConfig:
    namespace: str
    manage_certs: bool
    tls_secret: str
    service: str
    validating_webhook: str
    mutating_webhook: str
    probe_image: str
    peering: str
    liveness: str
    poll_interval: float
    policy: authority.TLSPolicy | None
    log_level: str
    kubeconfig: str | None = None
    # The outage backstop; None: off (and one left installed under backstop_name is
    # removed).
    backstop: BackstopConfig | None = None
    backstop_name: str = "epguard-backstop"
    rules_configmap: str = "epguard-rules"
    rules_key: str = "rules.yaml"
    tag_ttl: dt.timedelta = dt.timedelta(hours=24)
    probe_key_secret: str = "epguard-probe-key"
    probe_key_rotation: dt.timedelta = dt.timedelta(days=30)


def parse(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ControllerConfig:
    """The controller's settings; SettingsError (one line) for a bad value."""
    v = read(
        CONTROLLER_OPTIONS,
        argv,
        env,
        prog="epguard-controller",
        description=(
            "epguard's controller (a kopf operator): manages the webhook's TLS certificate "
            "and CA bundle, and records probe outcomes. Each option also reads the "
            "EPGUARD_* environment variable named in its help; a flag beats the variable."
        ),
    )
    try:
        extra_dns, extra_ips = authority.parse_subject_alt_names([v["extra_san"]])
    except ValueError as exc:
        raise SettingsError(f"--extra-san/EPGUARD_EXTRA_SANS: {exc}") from None
    policy: authority.TLSPolicy | None = None
    if v["manage_certs"]:
        service_names = authority.dns_names_for(v["service"], v["namespace"])
        try:
            policy = authority.TLSPolicy(
                # The Service's names first: the first one is also the certificate's CN.
                dns_names=service_names + tuple(n for n in extra_dns if n not in service_names),
                ip_addresses=extra_ips,
                ca_validity=v["ca_validity_hours"],
                ca_renew_before=v["ca_renew_before_hours"],
                cert_validity=v["cert_validity_hours"],
                cert_renew_before=v["cert_renew_before_hours"],
                overlap=v["ca_overlap_hours"],
            )
        except ValueError as exc:
            raise SettingsError(f"certificate lifetimes: {exc}") from None
    backstop: BackstopConfig | None = None
    if v["backstop_enabled"]:
        backstop = BackstopConfig(
            params_namespace=v["namespace"],
            name=v["backstop"],
            default_mode=v["mode"],
            allow_skip=v["allow_skip"],
            excluded_namespaces=tuple(dict.fromkeys((*v["exclude_namespaces"], v["namespace"]))),
            kinds=(*PATH_KINDS, *(k for k in v["extra_kinds"] if k.paths)),
            object_selector=v["object_selector"],
        )
    return ControllerConfig(
        namespace=v["namespace"],
        manage_certs=v["manage_certs"],
        tls_secret=v["tls_secret"],
        service=v["service"],
        validating_webhook=v["validating_webhook"],
        mutating_webhook=v["mutating_webhook"],
        probe_image=v["probe_image"],
        peering=v["peering"],
        liveness=v["liveness"],
        poll_interval=v["poll_interval"],
        policy=policy,
        log_level=v["log_level"],
        kubeconfig=v["kubeconfig"],
        backstop=backstop,
        backstop_name=v["backstop"],
        rules_configmap=v["rules_configmap"],
        rules_key=v["rules_key"],
        tag_ttl=dt.timedelta(hours=v["verdict_ttl_hours"]),
        probe_key_secret=v["probe_key_secret"],
        probe_key_rotation=dt.timedelta(days=v["probe_key_rotation_days"]),
    )
