"""Server settings: command-line options, each with an environment variable.

Precedence is flag > environment > default, so the chart sets environment
variables and a human debugging a pod can still override one on the command line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from webhook.namespaces import MODES, Mode, parse_mode
from webhook.workloads import KindError, KindSpec, parse_kinds

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


PROBE_LEVELS = ("import", "smoke")


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    rules: str | None
    tls_cert: str | None
    tls_key: str | None
    host: str = "0.0.0.0"
    port: int = 8443
    mode: Mode = "enforce"
    allow_skip: bool = True
    namespace: str = "epguard-system"
    rules_configmap: str = "epguard-rules"
    rules_key: str = "rules.yaml"
    kubeconfig: str | None = None
    # "auto": watch the cluster if credentials are found; "off": rules file only.
    watch: str = "auto"
    verdict_ttl_hours: float = 24.0
    reload_interval: float = 2.0
    log_level: str = "info"
    max_body_bytes: int = 3 * 1024 * 1024
    # Probe injection (POST /mutate): the image whose /opt/epguard/probe is copied into
    # the pod, and how deep the probe checks (import | smoke).
    inject_image: str = "epguard:dev"
    probe_level: str = "import"
    # Workload kinds an admin added (chart value webhook.extraKinds).
    extra_kinds: tuple[KindSpec, ...] = ()


def _bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise SettingsError(f"{name} must be true or false, not {value!r}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epguard-webhook",
        description="epguard validating admission webhook (HTTPS: /validate, /healthz, "
        "/readyz, /metrics). Every option also reads an EPGUARD_* environment variable.",
    )
    p.add_argument("--rules", help="rules YAML file [EPGUARD_RULES] (default: built-in rules)")
    p.add_argument("--tls-cert", help="PEM certificate (chain) [EPGUARD_TLS_CERT]")
    p.add_argument("--tls-key", help="PEM private key [EPGUARD_TLS_KEY]")
    p.add_argument("--host", help="listen address [EPGUARD_HOST] (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="listen port [EPGUARD_PORT] (default 8443)")
    p.add_argument("--mode", choices=MODES, help="default mode [EPGUARD_MODE] (default enforce)")
    p.add_argument(
        "--allow-skip",
        choices=("true", "false"),
        help="honour the epguard.io/skip annotation [EPGUARD_ALLOW_SKIP] (default true)",
    )
    p.add_argument("--namespace", help="namespace of the rules ConfigMap [EPGUARD_NAMESPACE]")
    p.add_argument("--rules-configmap", help="rules ConfigMap name [EPGUARD_RULES_CONFIGMAP]")
    p.add_argument("--kubeconfig", help="kubeconfig for the watches [EPGUARD_KUBECONFIG]")
    p.add_argument(
        "--watch",
        choices=("auto", "off"),
        help="watch ConfigMap/Namespaces/ImageVerdicts when credentials exist [EPGUARD_WATCH]",
    )
    p.add_argument("--verdict-ttl-hours", type=float, help="[EPGUARD_VERDICT_TTL_HOURS]")
    p.add_argument(
        "--reload-interval",
        type=float,
        help="seconds between TLS/rules file checks [EPGUARD_RELOAD_INTERVAL] (default 2)",
    )
    p.add_argument("--log-level", help="[EPGUARD_LOG_LEVEL] (default info)")
    p.add_argument(
        "--inject-image",
        help="image that carries the probe, for injected pods [EPGUARD_INJECT_IMAGE]",
    )
    p.add_argument(
        "--probe-level",
        choices=PROBE_LEVELS,
        help="probe depth in injected pods [EPGUARD_PROBE_LEVEL] (default import)",
    )
    p.add_argument(
        "--extra-kinds",
        help="JSON list of workload kinds to judge besides the built-in ones, as the chart "
        "value webhook.extraKinds [EPGUARD_EXTRA_KINDS]",
    )
    return p


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    ns = parser().parse_args(argv)

    def pick(flag: object, var: str) -> str | None:
        if flag is not None:
            return str(flag)
        value = env.get(var)
        return value if value not in (None, "") else None

    defaults = Settings(rules=None, tls_cert=None, tls_key=None)
    mode_text = pick(ns.mode, "EPGUARD_MODE")
    mode = parse_mode(mode_text) if mode_text is not None else defaults.mode
    if mode is None:
        raise SettingsError(f"EPGUARD_MODE must be one of {', '.join(MODES)}, not {mode_text!r}")
    port_text = pick(ns.port, "EPGUARD_PORT")
    try:
        port = int(port_text) if port_text is not None else defaults.port
    except ValueError:
        raise SettingsError(f"EPGUARD_PORT must be a number, not {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise SettingsError(f"port {port} is out of range")
    skip_text = pick(ns.allow_skip, "EPGUARD_ALLOW_SKIP")
    watch = pick(ns.watch, "EPGUARD_WATCH") or defaults.watch
    if watch not in ("auto", "off"):
        raise SettingsError(f"EPGUARD_WATCH must be auto or off, not {watch!r}")

    def number(flag: object, var: str, default: float) -> float:
        text = pick(flag, var)
        try:
            return float(text) if text is not None else default
        except ValueError:
            raise SettingsError(f"{var} must be a number, not {text!r}") from None

    probe_level = pick(ns.probe_level, "EPGUARD_PROBE_LEVEL") or defaults.probe_level
    if probe_level not in PROBE_LEVELS:
        raise SettingsError(
            f"EPGUARD_PROBE_LEVEL must be one of {', '.join(PROBE_LEVELS)}, not {probe_level!r}"
        )
    cert, key = pick(ns.tls_cert, "EPGUARD_TLS_CERT"), pick(ns.tls_key, "EPGUARD_TLS_KEY")
    if (cert is None) != (key is None):
        raise SettingsError("give both --tls-cert and --tls-key, or neither")
    kinds_text = pick(ns.extra_kinds, "EPGUARD_EXTRA_KINDS")
    try:
        extra_kinds = parse_kinds(kinds_text, "EPGUARD_EXTRA_KINDS") if kinds_text else ()
    except KindError as exc:
        raise SettingsError(str(exc)) from None
    return Settings(
        rules=pick(ns.rules, "EPGUARD_RULES"),
        tls_cert=cert,
        tls_key=key,
        host=pick(ns.host, "EPGUARD_HOST") or defaults.host,
        port=port,
        mode=mode,
        allow_skip=_bool("EPGUARD_ALLOW_SKIP", skip_text) if skip_text else defaults.allow_skip,
        namespace=pick(ns.namespace, "EPGUARD_NAMESPACE") or defaults.namespace,
        rules_configmap=pick(ns.rules_configmap, "EPGUARD_RULES_CONFIGMAP")
        or defaults.rules_configmap,
        kubeconfig=pick(ns.kubeconfig, "EPGUARD_KUBECONFIG"),
        watch=watch,
        verdict_ttl_hours=number(ns.verdict_ttl_hours, "EPGUARD_VERDICT_TTL_HOURS", 24.0),
        reload_interval=number(ns.reload_interval, "EPGUARD_RELOAD_INTERVAL", 2.0),
        log_level=(pick(ns.log_level, "EPGUARD_LOG_LEVEL") or defaults.log_level).lower(),
        inject_image=pick(ns.inject_image, "EPGUARD_INJECT_IMAGE") or defaults.inject_image,
        probe_level=probe_level,
        extra_kinds=extra_kinds,
    )
