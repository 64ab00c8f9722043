"""One settings model for the webhook and the controller.

Every setting is an :class:`Option`, defined once here with its type (a parser), its
default, its help, its command-line flag and its ``EPGUARD_*`` environment variable,
and declared on the field of the settings dataclass that holds its value
(:class:`Settings` for the webhook, :class:`ControllerSettings` for the controller),
whose name is the setting's name: the option tables are read off those fields, and mypy
checks each field's type against its option's default and parser.

Precedence is flag > environment > default: the chart sets environment variables from
its values (whose defaults are these, checked by ``tests/chart``), and a human
debugging a pod can still override one on the command line.

A bad value stops the start with one line naming the variable (or flag), what it must
be and what it got -- :class:`SettingsError`, which both entry points print and turn
into exit status 2. Every value is parsed here, so nothing fails later on a value that
was accepted (a log level, a number, a lifetime).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar

from epguard.probe.cli import PROBE_LEVELS
from epguard.webhook.engine.namespaces import (
    MODES,
    PREFLIGHT_MODES,
    Mode,
    PreflightMode,
    parse_mode,
    parse_preflight,
)
from epguard.webhook.engine.verdicts import DEFAULT_TAG_TTL
from epguard.webhook.engine.workloads import KindError, KindSpec, parse_kinds

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})
LOG_LEVELS = ("debug", "info", "warning", "error")
# The largest review the API server can send: an UPDATE carries the object and the old
# object. A stored object is at most 1.5 MiB (etcd's default --max-request-bytes; the
# old object was stored, and a new one over it cannot be), and the API server writes
# the review with Go's JSON encoder, which escapes <, >, &, U+2028/9, control bytes and
# invalid UTF-8 as 6-byte \uXXXX: up to 6x. 2 x 1.5 MiB x 6 = 18 MiB, plus 1 MiB for
# the envelope (userInfo, options): 19 MiB. (A CREATE's object can be up to the API
# server's 3 MiB request limit: 18 MiB escaped, inside it too.) A review over it is
# still answered by mode, never 413 (webhook/admission/transport.py).
MAX_BODY_BYTES = 19 * 1024 * 1024
# Memory charged to the reviews in flight (bodies and decoded objects), all together:
# the webhook idles at ~85 MiB, judging adds up to half of what is charged, one rules
# parse ~55 MiB, and the chart's limit is 256 MiB; 48 MiB holds the largest review the
# API server can send twice over.
MAX_INFLIGHT_BYTES = 48 * 1024 * 1024


class SettingsError(ValueError):
    """A bad setting; the message is the one line printed before exit status 2."""


# -- value parsers: text -> value, or ValueError("must be ...") -----------------------


def text(value: str) -> str:
    return value


def boolean(value: str) -> bool:
    v = value.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise ValueError("must be true or false")


def integer(lo: int, hi: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            n = int(value.strip())
        except ValueError:
            raise ValueError("must be a number") from None
        if not lo <= n <= hi:
            raise ValueError(f"must be between {lo} and {hi}")
        return n

    return parse


def number(*, minimum: float = 0.0, positive: bool = False) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            n = float(value.strip())
        except ValueError:
            raise ValueError("must be a number") from None
        if n != n or n in (float("inf"), float("-inf")):
            raise ValueError("must be a finite number")
        if positive and n <= 0:
            raise ValueError("must be a number greater than 0")
        if n < minimum:
            raise ValueError(f"must be a number of at least {minimum:g}")
        return n

    return parse


def hours(value: str) -> dt.timedelta:
    return dt.timedelta(hours=number(positive=True)(value))


def choice(values: Sequence[str]) -> Callable[[str], str]:
    def parse(value: str) -> str:
        v = value.strip().lower()
        if v not in values:
            raise ValueError(f"must be one of {', '.join(values)}")
        return v

    return parse


def mode(value: str) -> Mode:
    parsed = parse_mode(value)
    if parsed is None:
        raise ValueError(f"must be one of {', '.join(MODES)}")
    return parsed


def preflight_mode(value: str) -> PreflightMode:
    parsed = parse_preflight(value)
    if parsed is None:
        raise ValueError(f"must be one of {', '.join(PREFLIGHT_MODES)}")
    return parsed


def kinds(value: str) -> tuple[KindSpec, ...]:
    try:
        return parse_kinds(value, "EPGUARD_EXTRA_KINDS")
    except KindError as exc:
        raise ValueError(str(exc)) from None


def names(value: str) -> tuple[str, ...]:
    """A comma-separated list of names (empty items dropped)."""
    return tuple(n.strip() for n in value.split(",") if n.strip())


# A label value (63 characters at most, letters or digits at both ends), lower-case as
# the kubelet writes kubernetes.io/arch; the chart's schema has the same pattern.
_ARCH_RE = re.compile(r"[a-z0-9](?:[a-z0-9_.-]{0,61}[a-z0-9])?")


# A Secret's name: a DNS-1123 subdomain (253 characters at most).
_SECRET_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def secret_names(value: str) -> tuple[str, ...]:
    """Secret names, comma-separated: a repeat dropped, anything that is no Secret name
    refused (the API server would refuse every pod it was added to)."""
    out: list[str] = []
    for item in names(value):
        if len(item) > 253 or not _SECRET_RE.fullmatch(item):
            raise ValueError(f"{item!r} is no Secret name (a DNS-1123 subdomain)")
        if item not in out:
            out.append(item)
    return tuple(out)


def architectures(value: str) -> tuple[str, ...]:
    """kubernetes.io/arch values, comma-separated, as the chart's schema takes them (the
    kubelet writes them lower-case): a repeat is dropped, anything else refused, since a
    wrong value stops all learning and deletes what probes taught."""
    out: list[str] = []
    for item in names(value):
        if not _ARCH_RE.fullmatch(item):
            raise ValueError(f"{item!r} is no kubernetes.io/arch value (amd64, arm64, …)")
        if item not in out:
            out.append(item)
    return tuple(out)


def json_object(value: str) -> dict[str, Any] | None:
    if not value.strip():
        return None
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("must be a JSON object")
    return obj


def _hours_of(delta: dt.timedelta) -> float:
    return delta.total_seconds() / 3600


# -- the model -------------------------------------------------------------------------

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Option(Generic[T]):
    """How one setting is read: environment variable, help, default and parser. Its name
    is the name of the settings field it is declared on (:func:`setting`), and its flag
    that name with dashes (``--log-level``) unless ``flag`` says otherwise."""

    env: str
    help: str
    default: T
    parse: Callable[[str], T]
    flag: str | None = None
    # An empty variable means "empty" (e.g. no peering) instead of "unset".
    empty_is_value: bool = False
    # The flag may repeat; its values are joined with commas (the variable's syntax).
    repeat: bool = False
    # The chart value that sets it, if any (tests/chart checks the defaults agree).
    chart: str | None = None
    metavar: str | None = None


_OPTION = "epguard.option"  # where a settings field keeps its Option (field metadata)


def setting(option: Option[T]) -> T:
    """Declare a settings dataclass field read by ``option``: the field's default is the
    option's, and mypy checks the field's type against the option's default and parser."""
    return field(default=option.default, metadata={_OPTION: option})


def options_of(settings: type[DataclassInstance]) -> dict[str, Option[Any]]:
    """The options a settings dataclass is read by, by field name, in field order."""
    return {f.name: f.metadata[_OPTION] for f in fields(settings) if _OPTION in f.metadata}


# Shared by the webhook and the controller (one Option object: one default, one parser).
NAMESPACE = Option(
    "EPGUARD_NAMESPACE",
    "namespace of the release (rules ConfigMap, TLS Secret)",
    "epguard-system",
    text,
)
LOG_LEVEL = Option(
    "EPGUARD_LOG_LEVEL",
    "log level: debug, info, warning or error (any case)",
    "info",
    choice(LOG_LEVELS),
    chart="webhook.logLevel / controller.logLevel",
)

MODE: Option[Mode] = Option(
    "EPGUARD_MODE",
    f"default mode: {', '.join(MODES)}",
    "enforce",
    mode,
    chart="webhook.mode",
)

ALLOW_SKIP = Option(
    "EPGUARD_ALLOW_SKIP",
    "honour the epguard.io/skip annotation",
    True,
    boolean,
    chart="webhook.allowSkip",
)

RULES_CONFIGMAP = Option("EPGUARD_RULES_CONFIGMAP", "rules ConfigMap name", "epguard-rules", text)

RULES_KEY = Option(
    "EPGUARD_RULES_KEY", "key of the rules in that ConfigMap", "rules.yaml", text
)

VERDICT_TTL = Option(
    "EPGUARD_VERDICT_TTL_HOURS",
    "hours a tag-only Unusable ImageVerdict refuses before it only warns",
    _hours_of(DEFAULT_TAG_TTL),
    number(minimum=0),
    chart="webhook.verdictTTLHours",
)

EXTRA_KINDS: Option[tuple[KindSpec, ...]] = Option(
    "EPGUARD_EXTRA_KINDS",
    "JSON list of workload kinds to judge besides the built-in ones (webhook.extraKinds)",
    (),
    kinds,
    chart="webhook.extraKinds",
)
PROBE_KEY_SECRET = Option(
    "EPGUARD_PROBE_KEY_SECRET",
    "Secret (in the release namespace) with the keys that sign injected probes; the "
    "controller creates and rotates it, the webhook reads it",
    "epguard-probe-key",
    text,
)

KUBECONFIG: Option[str | None] = Option(
    "EPGUARD_KUBECONFIG",
    "kubeconfig for the API (default: the pod's service account, else $KUBECONFIG)",
    None,
    text,
)


@dataclass(frozen=True)
class Settings:
    """The webhook's settings, each field declared by the option that reads it."""

    rules: str | None = setting(
        Option("EPGUARD_RULES", "rules YAML file (default: the built-in rules)", None, text)
    )
    tls_cert: str | None = setting(
        Option("EPGUARD_TLS_CERT", "PEM certificate (chain)", None, text)
    )
    tls_key: str | None = setting(Option("EPGUARD_TLS_KEY", "PEM private key", None, text))
    client_ca: str | None = setting(
        Option(
            "EPGUARD_CLIENT_CA",
            "PEM CA bundle: when set, /validate and /mutate answer only clients with a "
            "certificate it signed (give the API server one: docs/webhook.md)",
            None,
            text,
        )
    )
    host: str = setting(Option("EPGUARD_HOST", "listen address", "0.0.0.0", text))
    port: int = setting(
        Option("EPGUARD_PORT", "listen port", 8443, integer(0, 65535), chart="webhook.port")
    )
    mode: Mode = setting(MODE)
    allow_skip: bool = setting(ALLOW_SKIP)
    namespace: str = setting(NAMESPACE)
    rules_configmap: str = setting(RULES_CONFIGMAP)
    rules_key: str = setting(RULES_KEY)
    probe_key_secret: str = setting(PROBE_KEY_SECRET)
    kubeconfig: str | None = setting(KUBECONFIG)
    watch: str = setting(
        Option(
            "EPGUARD_WATCH",
            "watch ConfigMap/Namespaces/ImageVerdicts when credentials exist: auto or off",
            "auto",
            choice(("auto", "off")),
        )
    )
    verdict_ttl_hours: float = setting(VERDICT_TTL)
    reload_interval: float = setting(
        Option(
            "EPGUARD_RELOAD_INTERVAL",
            "seconds between TLS/rules file checks",
            2.0,
            number(positive=True),
        )
    )
    log_level: str = setting(LOG_LEVEL)
    max_body_bytes: int = setting(
        Option(
            "EPGUARD_MAX_BODY_BYTES",
            "largest AdmissionReview judged, in bytes; a larger one is answered by mode "
            "(refused under enforce)",
            MAX_BODY_BYTES,
            integer(1, 64 * 1024 * 1024),
        )
    )
    max_inflight_bytes: int = setting(
        Option(
            "EPGUARD_MAX_INFLIGHT_BYTES",
            "memory, in bytes, for all reviews being read and judged together (bodies and "
            "decoded objects); a review that does not fit is answered by mode",
            MAX_INFLIGHT_BYTES,
            integer(1024 * 1024, 1024 * 1024 * 1024),
        )
    )
    deadline_seconds: float = setting(
        Option(
            "EPGUARD_DEADLINE_SECONDS",
            "seconds a large review may take to judge before it is answered by mode (refused "
            "under enforce); below the webhooks' timeoutSeconds (the chart gives 60% of it)",
            3.0,
            number(positive=True),
        )
    )
    max_head_bytes: int = setting(
        Option(
            "EPGUARD_MAX_HEAD_BYTES",
            "largest request head (request line and headers) accepted, in bytes; over it: 431",
            64 * 1024,
            integer(1024, 1024 * 1024),
        )
    )
    head_timeout_seconds: float = setting(
        Option(
            "EPGUARD_HEAD_TIMEOUT_SECONDS",
            "seconds a connection may take to send a request head before it is closed",
            10.0,
            number(positive=True),
        )
    )
    body_timeout_seconds: float = setting(
        Option(
            "EPGUARD_BODY_TIMEOUT_SECONDS",
            "seconds a request may take to send its whole body, from the end of its head, "
            "before the connection is closed",
            10.0,
            number(positive=True),
        )
    )
    inject_image: str = setting(
        Option(
            "EPGUARD_INJECT_IMAGE",
            "image that carries the probe, for injected pods",
            "epguard:dev",
            text,
        )
    )
    inject_pull_secrets: tuple[str, ...] = setting(
        Option(
            "EPGUARD_INJECT_PULL_SECRETS",
            "image pull secrets added to every pod the probe is injected into (and so to its "
            "preflight), comma-separated: the injected image's registry credentials, where "
            "the nodes have none; each must exist in the pod's namespace",
            (),
            secret_names,
            chart="injection.imagePullSecrets",
        )
    )
    probe_level: str = setting(
        Option(
            "EPGUARD_PROBE_LEVEL",
            f"probe depth in injected pods: {', '.join(PROBE_LEVELS)}",
            PROBE_LEVELS[0],
            choice(PROBE_LEVELS),
            chart="injection.probeLevel",
        )
    )
    preflight_mode: PreflightMode = setting(
        Option(
            "EPGUARD_PREFLIGHT_MODE",
            "gate: an elastic-EP worker on an image with no verdict waits unscheduled "
            "until a preflight judged the image; off: it is scheduled at once (a "
            "namespace's epguard.io/preflight label overrides)",
            "gate",
            preflight_mode,
            chart="preflight.mode",
        )
    )
    extra_kinds: tuple[KindSpec, ...] = setting(EXTRA_KINDS)


# The self-managed TLS lifetimes' defaults (controller/authority.py TLSPolicy uses them):
# a 5-year CA renewed 90 days before expiry, a 1-year serving cert renewed 30 days
# before expiry, and a 1-hour overlap before a new CA signs (the API server picks up a
# new caBundle within seconds).
CA_VALIDITY = dt.timedelta(days=5 * 365)
CA_RENEW_BEFORE = dt.timedelta(days=90)
CERT_VALIDITY = dt.timedelta(days=365)
CERT_RENEW_BEFORE = dt.timedelta(days=30)
CA_OVERLAP = dt.timedelta(hours=1)


@dataclass(frozen=True)
class ControllerSettings:
    """The controller's settings, each field declared by the option that reads it
    (``controller/config.py`` makes the controller's configuration of them)."""

    namespace: str = setting(NAMESPACE)
    probe_key_secret: str = setting(PROBE_KEY_SECRET)
    probe_key_rotation_days: float = setting(
        Option(
            "EPGUARD_PROBE_KEY_ROTATION_DAYS",
            "days before the probe-signing key is replaced (the previous keys still verify)",
            30.0,
            number(positive=True),
            chart="injection.keyRotationDays",
        )
    )
    manage_certs: bool = setting(
        Option(
            "EPGUARD_MANAGE_CERTS",
            "create/rotate the CA and serving cert and inject caBundle; false when "
            "cert-manager does it",
            True,
            boolean,
        )
    )
    tls_secret: str = setting(
        Option(
            "EPGUARD_TLS_SECRET",
            "Secret holding tls.crt, tls.key, ca.crt",
            "epguard-tls",
            text,
            chart="tls.secretName",
        )
    )
    service: str = setting(
        Option(
            "EPGUARD_SERVICE",
            "the webhook Service; the serving cert is issued for its DNS names",
            "epguard-webhook",
            text,
        )
    )
    extra_san: str = setting(
        Option(
            "EPGUARD_EXTRA_SANS",
            "another subject alternative name for the serving cert besides the Service's "
            "DNS names: an IP address (127.0.0.1, ::1) or a DNS name, for a webhook the API "
            "server reaches by address. Repeat it or separate with commas (the variable: "
            "commas or spaces); given on the command line it replaces the variable. Only "
            "with manage-certs",
            "",
            text,
            flag="--extra-san",
            repeat=True,
            metavar="NAME_OR_IP",
        )
    )
    validating_webhook: str = setting(
        Option(
            "EPGUARD_VALIDATING_WEBHOOK",
            "ValidatingWebhookConfiguration whose caBundle is kept current",
            "epguard",
            text,
        )
    )
    mutating_webhook: str = setting(
        Option(
            "EPGUARD_MUTATING_WEBHOOK",
            "MutatingWebhookConfiguration whose caBundle is kept current; empty for none",
            "",
            text,
            empty_is_value=True,
        )
    )
    # The webhook's EPGUARD_INJECT_IMAGE too, with another meaning: "inject this" to the
    # webhook (it needs an image), "trust only this" to the controller.
    probe_image: str = setting(
        Option(
            "EPGUARD_INJECT_IMAGE",
            "the image epguard injects to copy the probe into pods; only pods whose "
            "epguard-copy-probe runs it, or whose epguard-probe volume is it (a "
            "preflight's, preflight.probeVolume: image), are trusted to report probe "
            "outcomes. Empty trusts any probe call",
            "",
            text,
            empty_is_value=True,
        )
    )
    peering: str = setting(
        Option(
            "EPGUARD_PEERING",
            "kopf ClusterKopfPeering name for HA (one active replica); empty runs standalone",
            "epguard",
            text,
            empty_is_value=True,
        )
    )
    liveness: str = setting(
        Option(
            "EPGUARD_LIVENESS",
            "kopf liveness endpoint URL; empty disables it",
            "http://0.0.0.0:8080/healthz",
            text,
            empty_is_value=True,
        )
    )
    architecture_check_seconds: float = setting(
        Option(
            "EPGUARD_ARCHITECTURE_CHECK_SECONDS",
            "seconds between checks for nodes of a second architecture (then the verdicts "
            "probes taught are deleted: they are per image, not per platform)",
            60.0,
            number(positive=True),
        )
    )
    architectures: tuple[str, ...] = setting(
        Option(
            "EPGUARD_ARCHITECTURES",
            "the kubernetes.io/arch values the elastic-EP workers run on, comma-separated; "
            "probes teach verdicts only on nodes of the one declared (none when two are); "
            "empty: only while every labelled node has one architecture",
            (),
            architectures,
            chart="controller.architectures",
        )
    )
    poll_interval: float = setting(
        Option(
            "EPGUARD_CERT_POLL_SECONDS",
            "seconds between TLS reconciliations",
            60.0,
            number(positive=True),
            chart="tls.selfManaged.pollSeconds",
        )
    )
    ca_validity_hours: dt.timedelta = setting(
        Option(
            "EPGUARD_CA_VALIDITY_HOURS",
            "CA lifetime, in hours",
            CA_VALIDITY,
            hours,
            chart="tls.selfManaged.caValidityHours",
        )
    )
    ca_renew_before_hours: dt.timedelta = setting(
        Option(
            "EPGUARD_CA_RENEW_BEFORE_HOURS",
            "renew the CA this many hours before it expires",
            CA_RENEW_BEFORE,
            hours,
            chart="tls.selfManaged.caRenewBeforeHours",
        )
    )
    cert_validity_hours: dt.timedelta = setting(
        Option(
            "EPGUARD_CERT_VALIDITY_HOURS",
            "serving cert lifetime, in hours",
            CERT_VALIDITY,
            hours,
            chart="tls.selfManaged.certValidityHours",
        )
    )
    cert_renew_before_hours: dt.timedelta = setting(
        Option(
            "EPGUARD_CERT_RENEW_BEFORE_HOURS",
            "renew the serving cert this many hours before it expires",
            CERT_RENEW_BEFORE,
            hours,
            chart="tls.selfManaged.certRenewBeforeHours",
        )
    )
    ca_overlap_hours: dt.timedelta = setting(
        Option(
            "EPGUARD_CA_OVERLAP_HOURS",
            "hours a new CA is trusted before it signs",
            CA_OVERLAP,
            hours,
            chart="tls.selfManaged.caOverlapHours",
        )
    )
    kubeconfig: str | None = setting(KUBECONFIG)
    # The outage backstop (webhook/controller/compiler.py). It judges as the webhook does,
    # so it reads the webhook's mode, exemption, tag TTL, kinds, namespaces and selector.
    backstop_enabled: bool = setting(
        Option(
            "EPGUARD_BACKSTOP_ENABLED",
            "keep the outage backstop installed; false removes one an earlier run left",
            False,
            boolean,
        )
    )
    backstop_name: str = setting(
        Option(
            "EPGUARD_BACKSTOP",
            "name of the outage backstop (its parameter ConfigMap and the prefix of its "
            "ValidatingAdmissionPolicies)",
            "epguard-backstop",
            text,
            flag="--backstop",
            metavar="BACKSTOP",
        )
    )
    mode: Mode = setting(MODE)
    allow_skip: bool = setting(ALLOW_SKIP)
    verdict_ttl_hours: float = setting(VERDICT_TTL)
    rules_configmap: str = setting(RULES_CONFIGMAP)
    rules_key: str = setting(RULES_KEY)
    extra_kinds: tuple[KindSpec, ...] = setting(EXTRA_KINDS)
    exclude_namespaces: tuple[str, ...] = setting(
        Option(
            "EPGUARD_EXCLUDE_NAMESPACES",
            "namespaces the backstop never judges, comma-separated (as the webhooks' "
            "namespaceSelector)",
            ("kube-system",),
            names,
        )
    )
    object_selector: dict[str, Any] | None = setting(
        Option(
            "EPGUARD_OBJECT_SELECTOR",
            "the webhooks' objectSelector as JSON (webhook.objectSelector); the backstop "
            "judges only what the webhook is asked about",
            None,
            json_object,
        )
    )
    preflight_timeout_seconds: int = setting(
        Option(
            "EPGUARD_PREFLIGHT_TIMEOUT_SECONDS",
            "seconds a preflight may take, its image pull included, counted from its "
            "creation; then preflight.onError decides for the pods that wait on it",
            600,
            integer(30, 86400),
            chart="preflight.timeoutSeconds",
        )
    )
    preflight_on_error: str = setting(
        Option(
            "EPGUARD_PREFLIGHT_ON_ERROR",
            "when a preflight cannot judge (pull error, unschedulable, deadline, no "
            "python3): open removes the gate with a Warning Event, hold keeps the pods "
            "gated",
            "open",
            choice(("open", "hold")),
            chart="preflight.onError",
        )
    )
    preflight_gpus: str = setting(
        Option(
            "EPGUARD_PREFLIGHT_GPUS",
            "0: a preflight holds no GPU (it judges files); worker: it requests the "
            "worker's extended resources",
            "0",
            choice(("0", "worker")),
            chart="preflight.gpus",
        )
    )
    preflight_probe_volume: str = setting(
        Option(
            "EPGUARD_PREFLIGHT_PROBE_VOLUME",
            "copy: epguard's copy container writes the probe into a preflight's emptyDir "
            "(any runtime); image: the epguard image is the preflight's probe volume, one "
            "container less (Kubernetes 1.35, or 1.33-1.34 with the ImageVolume gate, and "
            "containerd 2.1 or CRI-O 1.31)",
            "copy",
            choice(("copy", "image")),
            chart="preflight.probeVolume",
        )
    )
    preflight_retain_seconds: int = setting(
        Option(
            "EPGUARD_PREFLIGHT_RETAIN_SECONDS",
            "seconds a finished preflight pod answers for its image (new pods on it are "
            "ungated at once) before it is deleted, once no pod waits on it",
            3600,
            integer(0, 7 * 86400),
            chart="preflight.retainSeconds",
        )
    )
    verdicts_per_namespace: int = setting(
        Option(
            "EPGUARD_VERDICTS_PER_NAMESPACE",
            "ImageVerdicts the probes of one namespace may teach (new images; a verdict "
            "that exists is still updated): past it, that namespace's probes teach "
            "nothing new, so no tenant can fill the webhook's store of 50,000 verdicts",
            1000,
            integer(1, 50_000),
            chart="controller.verdictsPerNamespace",
        )
    )
    log_level: str = setting(LOG_LEVEL)


# Every option of each component, in --help order (tests/chart checks the chart's
# defaults against them).
WEBHOOK_OPTIONS: tuple[Option[Any], ...] = tuple(options_of(Settings).values())
CONTROLLER_OPTIONS: tuple[Option[Any], ...] = tuple(options_of(ControllerSettings).values())


def _default_text(o: Option[Any]) -> str:
    d = o.default
    if isinstance(d, dt.timedelta):
        return f"{_hours_of(d):g}"
    if isinstance(d, bool):
        return "true" if d else "false"
    if d in (None, "", ()):
        return "none"
    if isinstance(d, tuple) and all(isinstance(x, str) for x in d):
        return ",".join(d)
    return str(d)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SettingsError(message)


def read(
    options: Mapping[str, Option[Any]],
    argv: Sequence[str] | None,
    environ: Mapping[str, str] | None,
    *,
    prog: str,
    description: str,
) -> dict[str, Any]:
    """Each option's value by name (flag > environment > default), parsed; SettingsError
    if bad."""
    env = os.environ if environ is None else environ
    p = _Parser(prog=prog, description=description)
    flags = {name: o.flag or "--" + name.replace("_", "-") for name, o in options.items()}
    for name, o in options.items():
        p.add_argument(
            flags[name],
            dest=name,
            default=None,
            action="append" if o.repeat else "store",
            metavar=o.metavar,
            help=f"{o.help} [{o.env}] (default {_default_text(o)})".replace("%", "%%"),
        )
    ns = p.parse_args(argv)
    values: dict[str, Any] = {}
    for name, o in options.items():
        given = getattr(ns, name)
        if given is not None:
            raw, source = (",".join(given) if o.repeat else given), flags[name]
        else:
            raw, source = env.get(o.env), o.env
            if raw is None or (raw == "" and not o.empty_is_value):
                values[name] = o.default
                continue
        try:
            values[name] = o.parse(raw)
        except ValueError as exc:
            raise SettingsError(f"{source}: {exc}, not {raw!r}") from None
    return values


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    values = read(
        options_of(Settings),
        argv,
        environ,
        prog="epguard-webhook",
        description="epguard admission webhook (HTTPS: /validate, /mutate, /healthz, /readyz, "
        "/metrics). Every option also reads the EPGUARD_* environment variable named in its "
        "help; a flag beats the variable.",
    )
    if (values["tls_cert"] is None) != (values["tls_key"] is None):
        raise SettingsError("give both --tls-cert and --tls-key, or neither")
    if values["client_ca"] and values["tls_cert"] is None:
        raise SettingsError("--client-ca needs --tls-cert and --tls-key (it is a TLS setting)")
    return Settings(**values)
