"""One settings model for the webhook and the controller: each option defined once,
flag > environment > default, and a bad value ends the start with one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from epguard.webhook.controller.config import parse
from epguard.webhook.settings import (
    CONTROLLER_OPTIONS,
    WEBHOOK_OPTIONS,
    ControllerSettings,
    Settings,
    SettingsError,
    load,
    options_of,
)

REPO = Path(__file__).resolve().parents[2]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPGUARD_")}
    env.pop("KUBECONFIG", None)
    return {**env, **extra}


@pytest.mark.parametrize(
    ("module", "variable", "value", "says"),
    [
        ("epguard.webhook.controller", "EPGUARD_CERT_POLL_SECONDS", "x", "must be a number"),
        ("epguard.webhook.controller", "EPGUARD_CA_VALIDITY_HOURS", "-1", "greater than 0"),
        ("epguard.webhook.controller", "EPGUARD_LOG_LEVEL", "verbose", "must be one of debug"),
        ("epguard.webhook.controller", "EPGUARD_MANAGE_CERTS", "maybe", "must be true or false"),
        ("epguard.webhook.controller", "EPGUARD_ARCHITECTURES", "AMD64", "no kubernetes.io"),
        ("webhook", "EPGUARD_LOG_LEVEL", "loud", "must be one of debug"),
        ("webhook", "EPGUARD_VERDICT_TTL_HOURS", "-2", "at least 0"),
        ("webhook", "EPGUARD_PORT", "http", "must be a number"),
        ("webhook", "EPGUARD_PROBE_LEVEL", "deep", "must be one of import, smoke"),
        ("webhook", "EPGUARD_INJECT_PULL_SECRETS", "corp,Bad_Name", "no Secret name"),
    ],
)
def test_a_bad_value_is_one_line_on_stderr_and_exit_2(
    module: str, variable: str, value: str, says: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module],
        cwd=REPO,
        env=_clean_env(**{variable: value}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert variable in lines[0] and says in lines[0] and repr(value) in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", ["info", "INFO", "Warning", "debug"])
def test_log_levels_are_read_in_any_case_by_both_components(value: str) -> None:
    env = {"EPGUARD_LOG_LEVEL": value}
    assert load([], env).log_level == value.lower()
    assert parse([], env).log_level == value.lower()


def test_flag_beats_environment_beats_default() -> None:
    env = {"EPGUARD_CERT_POLL_SECONDS": "7", "EPGUARD_VERDICT_TTL_HOURS": "3"}
    assert parse([], env).poll_interval == 7
    assert parse(["--poll-interval", "9"], env).poll_interval == 9
    assert parse([], {}).poll_interval == 60
    assert load([], env).verdict_ttl_hours == 3
    assert load(["--verdict-ttl-hours", "0"], env).verdict_ttl_hours == 0
    assert load([], {}).verdict_ttl_hours == 24


def test_a_bad_flag_names_the_flag() -> None:
    with pytest.raises(SettingsError, match=r"^--poll-interval: must be a number"):
        parse(["--poll-interval", "soon"], {})


def test_an_empty_variable_means_empty_only_where_that_means_something() -> None:
    cfg = parse([], {"EPGUARD_PEERING": "", "EPGUARD_LIVENESS": ""})
    assert (cfg.peering, cfg.liveness) == ("", "")
    assert load([], {"EPGUARD_PORT": "", "EPGUARD_LOG_LEVEL": ""}).port == 8443


def test_every_option_is_defined_once() -> None:
    for options in (WEBHOOK_OPTIONS, CONTROLLER_OPTIONS):
        assert len({o.env for o in options}) == len(options)
    # Each is declared by a settings field, which names it (and its flag).
    assert len(fields(Settings)) == len(options_of(Settings)) == len(WEBHOOK_OPTIONS)
    controller = options_of(ControllerSettings)
    assert len(fields(ControllerSettings)) == len(controller) == len(CONTROLLER_OPTIONS)
    # A variable both components read is one Option object, so one default and one parser
    # -- except the probe image, which means "inject this" to the webhook (it needs an
    # image) and "trust only this" to the controller (empty trusts any probe call).
    webhook = {o.env: o for o in WEBHOOK_OPTIONS}
    for o in CONTROLLER_OPTIONS:
        if o.env in webhook and o.env != "EPGUARD_INJECT_IMAGE":
            assert webhook[o.env] is o, o.env


def test_the_settings_defaults_are_the_options_defaults() -> None:
    built = Settings(rules=None, tls_cert=None, tls_key=None)
    for name, o in options_of(Settings).items():
        assert getattr(built, name) == o.default, name
    assert load([], {}) == built
    controller = ControllerSettings()
    for name, o in options_of(ControllerSettings).items():
        assert getattr(controller, name) == o.default, name


@pytest.mark.parametrize(("component", "level"), [("controller", "info"), ("webhook", "INFO")])
def test_an_accepted_log_level_configures_logging_in_a_real_process(
    component: str, level: str, tmp_path: Path
) -> None:
    """The level reaches logging.basicConfig in a fresh interpreter (under pytest the
    root logger already has handlers, so basicConfig would not even look at it)."""
    kubeconfig = _nowhere_kubeconfig(tmp_path)
    if component == "controller":
        code = (
            "import epguard.webhook.controller.__main__ as m\n"
            "m.asyncio.run = lambda coro: coro.close()  # no operator: only the start-up\n"
            "raise SystemExit(m.main([]))\n"
        )
        expect = "starting: namespace=epguard-system"
    else:
        code = (
            "import logging, sys\n"
            "from epguard.webhook.settings import load\n"
            "from epguard.webhook.admission.server import configure_logging\n"
            "configure_logging(load([]).log_level)\n"
            "logging.getLogger('epguard').info('configured')\n"
        )
        expect = "configured"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=_clean_env(
            EPGUARD_LOG_LEVEL=level,
            EPGUARD_PEERING="",
            EPGUARD_LIVENESS="",
            EPGUARD_KUBECONFIG=str(kubeconfig),
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert expect in proc.stderr and "Unknown level" not in proc.stderr


def _nowhere_kubeconfig(tmp_path: Path) -> Path:
    """A valid kubeconfig for a server nobody runs: the client is built, never used."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    return path


def test_the_controller_without_cluster_credentials_exits_2_with_one_line(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "epguard.webhook.controller", "--peering", ""],
        cwd=REPO,
        env={**_clean_env(), "HOME": str(tmp_path)},  # no ~/.kube/config either
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("epguard-controller: no cluster credentials")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_controller_builds_the_backstop_from_the_webhooks_judgement_settings() -> None:
    config = parse(
        [],
        {
            "EPGUARD_BACKSTOP_ENABLED": "true",
            "EPGUARD_BACKSTOP": "eg-backstop",
            "EPGUARD_NAMESPACE": "eg",
            "EPGUARD_MODE": "warn",
            "EPGUARD_ALLOW_SKIP": "false",
            "EPGUARD_EXCLUDE_NAMESPACES": "kube-system, batch,",
            "EPGUARD_OBJECT_SELECTOR": '{"matchLabels": {"team": "ml"}}',
            "EPGUARD_VERDICT_TTL_HOURS": "2",
            "EPGUARD_PEERING": "",
        },
    )
    b = config.backstop
    assert b is not None
    assert (b.name, b.params_namespace, b.default_mode, b.allow_skip) == (
        "eg-backstop", "eg", "warn", False,
    )  # fmt: skip
    # The release's own namespace is always excluded, as in the webhooks.
    assert b.excluded_namespaces == ("kube-system", "batch", "eg")
    assert b.object_selector == {"matchLabels": {"team": "ml"}}
    assert config.tag_ttl.total_seconds() == 2 * 3600


def test_the_backstop_is_off_unless_enabled_and_keeps_its_name_for_removal() -> None:
    config = parse([], {"EPGUARD_BACKSTOP": "eg-backstop"})
    assert config.backstop is None and config.backstop_name == "eg-backstop"


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("EPGUARD_OBJECT_SELECTOR", "[1]", "must be a JSON object"),
        ("EPGUARD_OBJECT_SELECTOR", "{", "not JSON"),
        ("EPGUARD_BACKSTOP_ENABLED", "maybe", "EPGUARD_BACKSTOP_ENABLED"),
    ],
)
def test_bad_backstop_settings_are_one_clear_error(variable: str, value: str, says: str) -> None:
    with pytest.raises(SettingsError, match=says):
        parse([], {variable: value})


def test_declared_architectures_are_read_once_each() -> None:
    """A repeat would count as a second architecture, and two stop all learning."""
    env = {"EPGUARD_ARCHITECTURES": " amd64,amd64 ,, arm64"}
    assert parse([], env).architectures == ("amd64", "arm64")
    assert parse([], {}).architectures == ()
    for bad in ("AMD64", "amd64-", "arm64.", "a" * 64):  # not a label value kubelets write
        with pytest.raises(SettingsError, match=r"no kubernetes\.io/arch value"):
            parse([], {"EPGUARD_ARCHITECTURES": bad})


def test_the_injected_images_pull_secrets_are_secret_names_read_once_each() -> None:
    """Added to tenants' pods: a name the API server refuses would refuse every such pod
    (each a create that fails), so the webhook refuses to start on it instead."""
    env = {"EPGUARD_INJECT_PULL_SECRETS": " corp-pull,corp-pull ,, mirror.creds"}
    assert load([], env).inject_pull_secrets == ("corp-pull", "mirror.creds")
    assert load([], {}).inject_pull_secrets == ()
    for bad in ("Corp", "corp_pull", "-corp", "a" * 254):
        with pytest.raises(SettingsError, match="no Secret name"):
            load([], {"EPGUARD_INJECT_PULL_SECRETS": bad})
