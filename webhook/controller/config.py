"""Controller settings from the command line, each with an environment variable so the
chart can set them without templating an argv."""

from __future__ import annotations

import argparse
import datetime as dt
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from webhook import certs


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
    policy: certs.TLSPolicy | None
    log_level: str


def _env_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def _hours(value: str) -> dt.timedelta:
    try:
        hours = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number of hours: {value!r}") from exc
    if hours <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value!r}")
    return dt.timedelta(hours=hours)


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if env is None else env

    def default(name: str, fallback: str) -> str:
        return env.get(name, fallback)

    p = argparse.ArgumentParser(
        prog="epguard-controller",
        description=(
            "epguard's controller (a kopf operator): manages the webhook's TLS certificate "
            "and CA bundle, and hosts the handlers of later concerns. Each option also "
            "reads the environment variable named in its help."
        ),
    )
    p.add_argument(
        "--namespace",
        default=default("EPGUARD_NAMESPACE", "epguard-system"),
        help="namespace of the release: where the TLS Secret lives (EPGUARD_NAMESPACE)",
    )
    p.add_argument(
        "--manage-certs",
        type=_env_bool,
        default=_env_bool(default("EPGUARD_MANAGE_CERTS", "true")),
        help="create/rotate the CA and serving cert and inject caBundle; false when "
        "cert-manager does it (EPGUARD_MANAGE_CERTS, default true)",
    )
    p.add_argument(
        "--tls-secret",
        default=default("EPGUARD_TLS_SECRET", "epguard-tls"),
        help="Secret holding tls.crt, tls.key, ca.crt (EPGUARD_TLS_SECRET)",
    )
    p.add_argument(
        "--service",
        default=default("EPGUARD_SERVICE", "epguard-webhook"),
        help="the webhook Service; the serving cert is issued for its DNS names (EPGUARD_SERVICE)",
    )
    p.add_argument(
        "--extra-san",
        action="append",
        default=None,
        metavar="NAME_OR_IP",
        help="another subject alternative name for the serving cert besides the Service's DNS "
        "names: an IP address (127.0.0.1, ::1) or a DNS name, for a webhook the API server "
        "reaches by address, e.g. a local dev stack. Repeat it or separate with commas; "
        "given on the command line it replaces EPGUARD_EXTRA_SANS (comma- or space-separated). "
        "Only with --manage-certs",
    )
    p.add_argument(
        "--validating-webhook",
        default=default("EPGUARD_VALIDATING_WEBHOOK", "epguard"),
        help="ValidatingWebhookConfiguration whose caBundle is kept current "
        "(EPGUARD_VALIDATING_WEBHOOK)",
    )
    p.add_argument(
        "--mutating-webhook",
        default=default("EPGUARD_MUTATING_WEBHOOK", ""),
        help="MutatingWebhookConfiguration whose caBundle is kept current; empty for none "
        "(EPGUARD_MUTATING_WEBHOOK)",
    )
    p.add_argument(
        "--probe-image",
        default=default("EPGUARD_INJECT_IMAGE", ""),
        help="the image epguard injects to copy the probe into pods; only pods whose "
        "epguard-copy-probe runs it are trusted to report probe outcomes, so a pod cannot "
        "bring a look-alike probe. Empty trusts any probe call (EPGUARD_INJECT_IMAGE)",
    )
    p.add_argument(
        "--peering",
        default=default("EPGUARD_PEERING", "epguard"),
        help="kopf ClusterKopfPeering name for HA (one active replica); empty runs "
        "standalone (EPGUARD_PEERING)",
    )
    p.add_argument(
        "--liveness",
        default=default("EPGUARD_LIVENESS", "http://0.0.0.0:8080/healthz"),
        help="kopf liveness endpoint URL; empty disables it (EPGUARD_LIVENESS)",
    )
    p.add_argument(
        "--poll-interval",
        type=float,
        default=float(default("EPGUARD_CERT_POLL_SECONDS", "60")),
        help="seconds between TLS reconciliations (EPGUARD_CERT_POLL_SECONDS, default 60)",
    )
    for flag, var, fallback, what in (
        ("--ca-validity-hours", "EPGUARD_CA_VALIDITY_HOURS", "43800", "CA lifetime"),
        ("--ca-renew-before-hours", "EPGUARD_CA_RENEW_BEFORE_HOURS", "2160", "CA renewal"),
        ("--cert-validity-hours", "EPGUARD_CERT_VALIDITY_HOURS", "8760", "serving cert lifetime"),
        (
            "--cert-renew-before-hours",
            "EPGUARD_CERT_RENEW_BEFORE_HOURS",
            "720",
            "serving cert renewal",
        ),
        ("--ca-overlap-hours", "EPGUARD_CA_OVERLAP_HOURS", "1", "old+new CA overlap"),
    ):
        p.add_argument(
            flag,
            type=_hours,
            default=_hours(default(var, fallback)),
            help=f"{what}, in hours ({var}, default {fallback})",
        )
    p.add_argument(
        "--log-level",
        default=default("EPGUARD_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="(EPGUARD_LOG_LEVEL)",
    )
    return p


def parse(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ControllerConfig:
    env = os.environ if env is None else env
    parser = build_parser(env)
    ns = parser.parse_args(argv)
    extra = ns.extra_san if ns.extra_san is not None else [env.get("EPGUARD_EXTRA_SANS", "")]
    try:
        extra_dns, extra_ips = certs.parse_subject_alt_names(extra)
    except ValueError as exc:
        parser.error(f"--extra-san/EPGUARD_EXTRA_SANS: {exc}")
    policy: certs.TLSPolicy | None = None
    if ns.manage_certs:
        service_names = certs.dns_names_for(ns.service, ns.namespace)
        try:
            policy = certs.TLSPolicy(
                # The Service's names first: the first one is also the certificate's CN.
                dns_names=service_names + tuple(n for n in extra_dns if n not in service_names),
                ip_addresses=extra_ips,
                ca_validity=ns.ca_validity_hours,
                ca_renew_before=ns.ca_renew_before_hours,
                cert_validity=ns.cert_validity_hours,
                cert_renew_before=ns.cert_renew_before_hours,
                overlap=ns.ca_overlap_hours,
            )
        except ValueError as exc:
            parser.error(str(exc))
    if ns.poll_interval <= 0:
        parser.error("--poll-interval must be positive")
    return ControllerConfig(
        namespace=ns.namespace,
        manage_certs=ns.manage_certs,
        tls_secret=ns.tls_secret,
        service=ns.service,
        validating_webhook=ns.validating_webhook,
        mutating_webhook=ns.mutating_webhook,
        probe_image=ns.probe_image,
        peering=ns.peering,
        liveness=ns.liveness,
        poll_interval=ns.poll_interval,
        policy=policy,
        log_level=ns.log_level,
    )
