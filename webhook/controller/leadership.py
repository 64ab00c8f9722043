"""Which controller replica leads the loops kopf does not pause itself.

kopf peering pauses every replica but one, but only kopf's own watches and daemons: a
loop a startup handler starts (the preflight passes, the backstop's writer) runs on
every replica. Such a loop asks :class:`Leadership` before each round, which applies
kopf's own rule to the peering object's status (one entry per replica), so it runs where
kopf handles the events. (A loop that acts only on kopf's events, like the preflight's
answer loop, needs no asking: kopf stops its watches on a paused replica.) Shared by the
controller's concerns, like ``background``.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException

from epguard.webhook.cluster.kube import api_message

log = logging.getLogger("epguard.controller.leadership")


class PeersApi(Protocol):
    def peers(self, name: str) -> Mapping[str, Any]:
        """The peering object's ``status``: kopf's entry per replica (empty when none);
        the real one is ``peering.KubePeeringApi``."""


# kopf's own default for a peer that wrote no lifetime (kopf/_core/engines/peering.py).
DEFAULT_LIFETIME = 60
# How long an answer is reused: a pass loop asks before every pass, and passes come in
# bursts of pod events; kopf itself pauses or resumes only when the peering object changes.
REFRESH_SECONDS = 1.0


def leads(peers: Mapping[str, Any], identity: str, priority: int, now: dt.datetime) -> bool:
    """kopf's rule for which replica runs, read from the peering object's ``status`` (one
    entry per replica: priority, lifetime, lastseen): this replica is paused while another
    live replica has a priority higher than or equal to its own (kopf pauses both on a
    tie). An entry that does not parse is no replica."""
    for who, info in peers.items():
        if who == identity or not isinstance(info, Mapping):
            continue
        try:
            their = int(info.get("priority", 0))
            lifetime = dt.timedelta(seconds=int(info.get("lifetime", DEFAULT_LIFETIME)))
            seen = info.get("lastseen")
            # kopf counts a replica that wrote no time as seen now.
            lastseen = now if seen is None else dt.datetime.fromisoformat(seen)
        except (TypeError, ValueError, OverflowError):
            continue
        if lastseen.tzinfo is None:
            lastseen = lastseen.replace(tzinfo=dt.UTC)
        if lastseen + lifetime > now and their >= priority:
            return False
    return True


class Leadership:
    """Whether this replica is the one kopf peering keeps active, for the loops kopf does
    not pause itself (the preflight passes, the backstop's writer): kopf pauses only its
    watches and daemons, so without this both replicas ran every pass and every sync --
    harmless (each write is idempotent) but twice the work for the API server and the
    node. Standalone (no peering): always. ``leads`` makes an API call: call it from a
    thread. When the peering object cannot be read, the answer is yes: a loop that runs
    twice is wasteful, one that never runs would keep pods gated."""

    def __init__(
        self,
        api: PeersApi | None,
        name: str,
        identity: str = "",
        priority: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api, self.name, self.identity, self.priority = api, name, identity, priority
        self.clock = clock
        self._answer: bool | None = None
        self._asked = 0.0
        self._failing = False
        self._lock = threading.Lock()

    def leads(self) -> bool:
        if not self.name or self.api is None:
            return True
        with self._lock:
            if self._answer is not None and self.clock() - self._asked < REFRESH_SECONDS:
                return self._answer
            try:
                peers = self.api.peers(self.name)
            except Exception as exc:
                answer = True
                if not self._failing:  # once per outage, not once a second
                    said = api_message(exc) if isinstance(exc, ApiException) else repr(exc)
                    log.warning("peering %s unreadable (%s): running as if leading",
                                self.name, said)  # fmt: skip
                self._failing = True
            else:
                self._failing = False
                answer = leads(peers, self.identity, self.priority, dt.datetime.now(dt.UTC))
            if answer != self._answer:
                log.info(
                    "%s (peering %s, priority %d)",
                    "this replica leads: preflight passes and backstop syncs run here"
                    if answer
                    else "another replica leads: preflight passes and backstop syncs pause",
                    self.name,
                    self.priority,
                )
            self._answer, self._asked = answer, self.clock()
            return answer


# No peering (or none given): every loop runs.
STANDALONE = Leadership(None, "")
