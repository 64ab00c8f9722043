"""``python -m epguard.webhook`` / ``epguard-webhook``: run the admission webhook server."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from epguard.webhook.admission.tls import TLSReloadError
from epguard.webhook.engine.rules import RulesError
from epguard.webhook.settings import SettingsError, load

log = logging.getLogger("epguard")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load(argv)
    except SettingsError as exc:
        print(f"epguard-webhook: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from epguard.webhook.admission.server import Runtime, configure_logging

    configure_logging(settings.log_level)
    try:
        runtime = Runtime(settings)
    except (RulesError, TLSReloadError) as exc:
        print(f"epguard-webhook: {exc}", file=sys.stderr)
        return 2
    if runtime.tls is None:
        log.warning("no --tls-cert/--tls-key: serving plain HTTP (the API server needs HTTPS)")
    server = uvicorn.Server(runtime.uvicorn_config())
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
