"""Verdicts are per image, not per platform: learn them only where every node shares one
architecture, and forget the probes' verdicts when a node of another one joins.

An ImageVerdict is keyed by the digest the kubelet reports. For a multi-platform image
that is the index's digest, the same on every architecture, while the files the probe
judged are one platform's. A probe on an arm64 node of an image whose arm64 variant
lacks mooncake would otherwise teach "Unusable" for the amd64 variant too, and refuse
every tenant's amd64 pods on it (a tenant chooses where its pod runs). So:

* the recorder learns from a probe only when the node it ran on carries the kubelet's
  ``kubernetes.io/arch`` label and one architecture holds (:func:`placement`): the one
  ``controller.architectures`` declares, or, with none declared, the one every labelled
  node has. The verdict records it (``spec.architecture``, and the label
  ``epguard.io/architecture``). Otherwise the probe's outcome is an Event on the pod and
  its owner, and nothing is learned;
* every ``EPGUARD_ARCHITECTURE_CHECK_SECONDS`` (60) the controller deletes what may be
  wrong (:func:`sweep_once`): with two architectures (on the nodes, or declared), every
  verdict a probe taught; with one, those taught on another (a cluster that moved between
  two checks). A verdict learned before answers a minute at most on a node it may be
  wrong for. A scan's verdicts stay: the scan recorder chose the platform it read.

Node labels are written by each node's kubelet (``kubernetes.io/arch`` is one the
NodeRestriction plugin lets it set), never by a tenant. A node without the label is not
counted: every kubelet sets it, and counting one would stop all learning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.webhook.cluster.kube import (
    REQUEST_TIMEOUT,
    api_message,
    get_object,
    list_items,
    list_pages,
    resource_path,
)
from epguard.webhook.controller import background
from epguard.webhook.controller.leadership import STANDALONE, Leadership
from epguard.webhook.controller.owners import COMPONENT
from epguard.webhook.engine.verdicts import (
    ARCHITECTURE_LABEL,
    GROUP,
    MANAGED_BY_LABEL,
    PLURAL,
    SOURCE_SCAN,
    VERSION,
)
from epguard.webhook.engine.workloads import as_map

log = logging.getLogger("epguard.controller.architectures")

ARCH_LABEL = "kubernetes.io/arch"


class Nodes(Protocol):
    """The two node reads placement needs (the real one is :class:`KubeNodes`)."""

    def architecture_of(self, node: str) -> str | None:
        """The ``kubernetes.io/arch`` label of ``node``; None when it has none or cannot
        be read (gone, or refused)."""

    def other_than(self, architecture: str | None) -> tuple[str, str] | None:
        """(name, architecture) of a node labelled with another architecture than
        ``architecture`` (any labelled node when None); None when there is none. A label
        with an empty value is another architecture, ``""``."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a probe ran, and whether what it saw may be learned for every node."""

    architecture: str | None
    refusal: str | None  # why nothing is learned; None: learn, recording ``architecture``


def placement(nodes: Nodes, node: str | None, declared: tuple[str, ...] = ()) -> Placement:
    """Whether a probe that ran on ``node`` (the pod's ``spec.nodeName``) may teach a
    verdict for every node, and on which architecture it ran. ``declared``: the
    architectures the admin says the cluster's workers run on (``controller.architectures``);
    empty, whether any labelled node has another architecture decides. A node that cannot
    be read, or a list that fails, teaches nothing (never "one architecture")."""
    if not node:
        return Placement(None, "the pod names no node it ran on")
    try:
        arch = nodes.architecture_of(node)
        if arch is None:
            return Placement(None, f"its node {node} has no readable {ARCH_LABEL} label")
        if len(declared) > 1:
            return Placement(arch, f"controller.architectures declares {', '.join(declared)} "
                             "and a verdict is per image, not per platform")  # fmt: skip
        if declared:
            if arch == declared[0]:
                return Placement(arch, None)
            return Placement(arch, f"its node {node} is {arch}, not {declared[0]}, the "
                             "architecture controller.architectures declares")  # fmt: skip
        other = nodes.other_than(arch)
    except Exception as exc:  # a dropped connection, a refused list: learn nothing
        return Placement(None, f"the nodes could not be read ({type(exc).__name__})")
    if other is not None:
        return Placement(
            arch,
            f"this cluster has nodes of more than one architecture ({node} is {arch}, "
            f"{other[0]} is {other[1]}) and a verdict is per image, not per platform",
        )
    return Placement(arch, None)


def _label(obj: Mapping[str, Any]) -> str | None:
    value = as_map(as_map(obj.get("metadata")).get("labels")).get(ARCH_LABEL)
    return value if isinstance(value, str) and value else None


class KubeNodes:
    """:class:`Nodes` on the official client (blocking; callers run it in an executor)."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)

    def architecture_of(self, node: str) -> str | None:
        try:
            return _label(get_object(self.api, resource_path("v1", "nodes", None, node)))
        except ApiException as exc:
            log.warning("cannot read node %s (%s %s)", node, exc.status, exc.reason)
            return None

    def other_than(self, architecture: str | None) -> tuple[str, str] | None:
        selector = ARCH_LABEL
        if architecture is not None:
            selector += f",{ARCH_LABEL}!={architecture}"
        # One page of one node: a single request, however many nodes match.
        for item in list_items(self.core.list_node, page_size=1, label_selector=selector):
            name = as_map(item.get("metadata")).get("name")
            # The selector matched the label: an empty value is still another
            # architecture than the one asked about (unknown, so never "the same").
            return (name if isinstance(name, str) else "?"), _label(item) or ""
        return None


def mixed(nodes: Nodes) -> tuple[tuple[str, str], tuple[str, str]] | None:
    """Two nodes of different architectures, or None when all labelled nodes share one."""
    first = nodes.other_than(None)
    if first is None:
        return None
    second = nodes.other_than(first[1])
    return None if second is None else (first, second)


class Verdicts(Protocol):
    """The verdicts the sweep reads and deletes (the real one is :class:`KubeVerdicts`)."""

    def taught(self, off: str | None) -> list[tuple[str, str]]:
        """(name, resourceVersion) of every ImageVerdict a probe taught (``off`` None), or
        of those taught on another architecture than ``off``."""

    def delete(self, name: str, version: str) -> None:
        """Delete one as it was listed; gone, or written since, is no error."""


class KubeVerdicts:
    """:class:`Verdicts` on the official client, listed by the labels the controller
    writes (``verdicts.verdict_object``): in the steady state, one architecture and
    nothing taught on another, each check lists nothing, however many verdicts exist."""

    def __init__(self, api: client.ApiClient) -> None:
        self.custom = client.CustomObjectsApi(api)

    def taught(self, off: str | None) -> list[tuple[str, str]]:
        selector = f"{MANAGED_BY_LABEL}={COMPONENT}"
        if off is not None:
            selector += f",{ARCHITECTURE_LABEL},{ARCHITECTURE_LABEL}!={off}"
        pages = list_pages(
            self.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL,
            label_selector=selector,
        )  # fmt: skip
        out = []
        for page, _ in pages:
            for v in page:
                meta = as_map(v.get("metadata"))
                if as_map(v.get("spec")).get("source") != SOURCE_SCAN:
                    out.append((str(meta.get("name")), str(meta.get("resourceVersion"))))
        return out

    def delete(self, name: str, version: str) -> None:
        # At the version listed: a verdict taught again since (on the architecture that
        # now holds) is not deleted.
        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(resource_version=version)
        )
        try:
            self.custom.delete_cluster_custom_object(
                GROUP, VERSION, PLURAL, name, body=options, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone already, or written since
                raise


def sweep_once(nodes: Nodes, verdicts: Verdicts, declared: tuple[str, ...] = ()) -> int:
    """One check; how many verdicts it deleted. With nodes of two architectures (or two
    declared), every verdict probes taught goes. With one architecture (declared, or the
    one every labelled node has), the verdicts taught on another go: a cluster that moved
    from one architecture to another between two checks keeps none of the old one's."""
    one: str | None
    if len(declared) > 1:
        one, why = None, f"controller.architectures declares {', '.join(declared)}"
    elif declared:
        one, why = declared[0], f"controller.architectures declares {declared[0]}"
    else:
        pair = mixed(nodes)
        if pair is not None:
            (a, arch_a), (b, arch_b) = pair
            one, why = None, f"nodes of two architectures ({a} is {arch_a}, {b} is {arch_b})"
        else:
            any_node = nodes.other_than(None)
            if any_node is None or not any_node[1]:
                return 0  # no labelled node: nothing says which architecture holds
            one, why = any_node[1], f"every labelled node is {any_node[1]}"
    gone = verdicts.taught(one)
    for name, version in gone:
        verdicts.delete(name, version)
    if gone:
        log.warning(
            "%s: deleted %d ImageVerdicts probes taught %s (a verdict is per image, not "
            "per platform)", why, len(gone),
            "on any architecture" if one is None else f"on another architecture than {one}",
        )  # fmt: skip
    return len(gone)


async def run_sweep(
    api: client.ApiClient,
    stop: asyncio.Event,
    every: float,
    declared: tuple[str, ...] = (),
    leadership: Leadership | None = None,
) -> None:
    """:func:`sweep_once` every ``every`` seconds until ``stop``, on the active replica."""
    loop = asyncio.get_running_loop()
    leadership = leadership or STANDALONE
    nodes, verdicts = KubeNodes(api), KubeVerdicts(api)
    while not stop.is_set():
        try:
            if await loop.run_in_executor(None, leadership.leads):
                await loop.run_in_executor(None, sweep_once, nodes, verdicts, declared)
        except ApiException as exc:
            log.warning("architecture check failed (%s %s: %s); retrying", exc.status,
                        exc.reason, api_message(exc))  # fmt: skip
        except Exception as exc:  # a dropped connection must not end the loop
            log.warning("architecture check failed (%s: %s); retrying", type(exc).__name__, exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


# --- kopf wiring ---------------------------------------------------------------------

NAME = "architectures"


@kopf.on.startup(id="epguard-architectures-start")
async def _start(memo: kopf.Memo, **_: Any) -> None:
    api, leadership = memo["api"], memo.get("leadership")
    config = memo["config"]
    every, declared = config.architecture_check_seconds, config.architectures
    background.start(memo, NAME, lambda stop: run_sweep(api, stop, every, declared, leadership))


@kopf.on.cleanup(id="epguard-architectures-stop")
async def _stop(memo: kopf.Memo, **_: Any) -> None:
    await background.stop(memo, NAME)
