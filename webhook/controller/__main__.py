"""``epguard-controller``: run the kopf operator with every handler module loaded.

HA: the chart runs two replicas. kopf peering (a ClusterKopfPeering object, its CRD
shipped by the chart) pauses every replica but the one with the highest priority; each
replica draws a random priority at start, so exactly one handles events and another takes
over within the peering lifetime when it dies. kopf pauses all replicas on a priority
tie, which a random 31-bit draw makes practically impossible. kopf pauses only its own
watches and daemons: the preflight passes and the backstop's writer, loops of their own,
ask ``leadership.Leadership`` (kopf's rule, read from the peering object) before each round.
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

from epguard.webhook.cluster.kube import NoCredentials, allow_api_depth, api_client
from epguard.webhook.controller import HANDLER_MODULES
from epguard.webhook.controller.config import ControllerConfig, parse
from epguard.webhook.controller.leadership import Leadership
from epguard.webhook.controller.peering import KubePeeringApi, ensure_peering
from epguard.webhook.settings import SettingsError

log = logging.getLogger("epguard.controller")


def operator_settings(config: ControllerConfig, priority: int) -> kopf.OperatorSettings:
    """The operator's kopf settings, given to kopf once, at start (a handler module may
    add its own at startup, as the recorder does its pod selector): peering (mandatory
    under ``config.peering``, standalone without it) at this replica's priority; the
    operator's own bookkeeping stays out of the objects' annotations as much as kopf
    allows, and events about handler progress go to the log, not to the API."""
    settings = kopf.OperatorSettings()
    settings.peering.standalone = not config.peering
    settings.peering.mandatory = bool(config.peering)
    if config.peering:
        settings.peering.name = config.peering
    settings.peering.priority = priority
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = "epguard.io/controller"
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    allow_api_depth()  # before kopf and the loops start their threads
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
    # kopf's default identity starts with getpass.getuser(), which raises in the image:
    # UID 65532 has no passwd entry (found when the chart first ran as pods). kopf types
    # it as a str of its own (a NewType in a private module), hence Any.
    identity: Any = f"{socket.gethostname()}/{secrets.token_hex(4)}"
    # The loops kopf does not pause on the other replica ask this before each round.
    leadership = Leadership(KubePeeringApi(api), config.peering, identity, priority)
    asyncio.run(
        kopf.operator(
            settings=operator_settings(config, priority),
            clusterwide=True,  # the operator's scope; kopf's peering follows it
            identity=identity,
            liveness_endpoint=config.liveness or None,
            memo=kopf.Memo(config=config, api=api, leadership=leadership),
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
