"""``epguard-controller``: run the kopf operator with every handler module loaded.

HA: the chart runs two replicas. kopf peering (a ClusterKopfPeering object, its CRD
shipped by the chart) pauses every replica but the one with the highest priority; each
replica draws a random priority at start, so exactly one handles events and another takes
over within the peering lifetime when it dies. kopf pauses all replicas on a priority
tie, which a random 31-bit draw makes practically impossible.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import secrets
import socket
import sys
from collections.abc import Sequence
from typing import Any

import kopf
from kopf._core.engines.peering import Identity

from epguard.webhook.cluster.kube import NoCredentials, api_client
from epguard.webhook.controller import HANDLER_MODULES
from epguard.webhook.controller.config import ControllerConfig, parse
from epguard.webhook.controller.peering import KubePeeringApi, ensure_peering
from epguard.webhook.settings import SettingsError

log = logging.getLogger("epguard.controller")


def _configure_settings(config: ControllerConfig, priority: int) -> Any:
    @kopf.on.startup()
    def _settings(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.peering.priority = priority
        settings.peering.mandatory = bool(config.peering)
        settings.peering.clusterwide = True
        # The operator's own bookkeeping stays out of the objects' annotations as much as
        # kopf allows; events about handler progress go to the log, not to the API.
        settings.posting.level = logging.WARNING
        settings.persistence.finalizer = "epguard.io/controller"

    return _settings


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse(argv)
    except SettingsError as exc:
        print(f"epguard-controller: {exc}", file=sys.stderr)
        return 2
    level = config.log_level.upper()  # parsed: one of debug, info, warning, error
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # One line per API request at INFO drowns the controller's own log.
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
    try:
        api = api_client(config.kubeconfig, home_kubeconfig=True)
    except NoCredentials as exc:
        print(f"epguard-controller: no cluster credentials: {exc}", file=sys.stderr)
        return 2
    for module in HANDLER_MODULES:
        importlib.import_module(module)
    priority = secrets.randbelow(2**31 - 1) + 1
    _configure_settings(config, priority)
    if config.peering:
        try:
            ensure_peering(KubePeeringApi(api), config.peering)
        except Exception:
            # kopf retries on its own and reports a missing peering object loudly; a
            # transient API error here must not keep the controller from starting.
            log.exception("could not ensure ClusterKopfPeering %s", config.peering)
    log.info(
        "starting: namespace=%s manage_certs=%s peering=%s priority=%d backstop=%s",
        config.namespace,
        config.manage_certs,
        config.peering or "(standalone)",
        priority,
        config.backstop.name if config.backstop else "(off)",
    )
    asyncio.run(
        kopf.operator(
            clusterwide=True,
            standalone=not config.peering,
            peering_name=config.peering or None,
            priority=priority,
            # kopf's default identity starts with getpass.getuser(), which raises in the
            # image: UID 65532 has no passwd entry (found when the chart first ran as pods).
            identity=Identity(f"{socket.gethostname()}/{secrets.token_hex(4)}"),
            liveness_endpoint=config.liveness or None,
            memo=kopf.Memo(config=config, api=api),
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
