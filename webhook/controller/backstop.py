"""Keep the outage backstop (webhook/controller/compiler.py) in the cluster.

The controller owns one ValidatingAdmissionPolicy with three bindings (one per mode),
and the parameter shards (RefusedImageLists labelled ``epguard.io/backstop: <name>``,
which the bindings select) that hold the Unusable verdicts. The policy changes when the
controller's settings or the deny rules do (a rule is a constant in the policy, compiled
once by the API server); the shards follow the ImageVerdicts:

* at once after any ImageVerdict changes (a watch from "now" wakes it), else every
  ``POLL`` seconds, and no sooner than ``PACE`` times the last sync's list of the
  ImageVerdicts took after it, it lists the ImageVerdicts a page at a time into
  an ``EntryIndex`` (the newest verdict per key, as the webhook's store decides, held as
  compact entries, so every verdict up to MAX_BACKSTOP_VERDICTS is read in bounded
  memory) and reads the rules ConfigMap by name (a ConfigMap the webhook would reject
  keeps the last good rules, as the webhook does);
* a tag verdict leaves the list when the webhook stops trusting it (``next_change``).

The parameters are computed from the cluster's state alone, never from what one replica
happened to see: every replica writes the same RefusedImageList, so kopf peering (which pauses
all replicas but one) cannot leave a paused replica writing a stale list.

The policies and the bindings are owned by the chart's ValidatingWebhookConfiguration
(an ownerReference), so ``helm uninstall`` takes them away with it: a backstop left
behind by an uninstalled epguard would refuse pods with nobody to explain why.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import hashlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epguard.webhook.cluster.kube import REQUEST_TIMEOUT, api_message, list_pages, meta
from epguard.webhook.cluster.watch import changes_source, run_watch
from epguard.webhook.controller.compiler import (
    PARAMS_GROUP,
    PARAMS_PLURAL,
    PARAMS_VERSION,
    SHARD_LABEL,
    BackstopConfig,
    EntryIndex,
    Params,
    binding_name,
    compile_params,
    policies,
    rule_checks,
    shard_objects,
)
from epguard.webhook.controller.config import ControllerConfig
from epguard.webhook.controller.leadership import STANDALONE, Leadership
from epguard.webhook.engine.namespaces import MODES
from epguard.webhook.engine.rules import RulesError, RuleSet, load_rules_text
from epguard.webhook.engine.verdicts import (
    GROUP,
    MAX_SCAN_VERDICTS,
    PLURAL,
    VERSION,
    verdict_from_object,
)
from epguard.webhook.metrics import Metrics

log = logging.getLogger("epguard.controller.backstop")

# Seconds between two syncs when nothing changed. A change of any ImageVerdict wakes the
# writer at once (``changes``: a watch of our own, from "now"; not kopf's, which lists
# what it watches at its settings' page size, 4 (recorder.LIST_CHUNK, for tenants' big
# pods), so 50,000 verdicts would be 12,500 requests at every start and relist). The
# poll is what is left when the watch is down, and what expires tag verdicts.
POLL = 5.0
PACE = 2.0  # after a sync, rest at least this many times as long as its list took
# On the replica that does not lead: how often it asks whether it leads now.
FOLLOWER_POLL = 1.0
# VAP's CEL uses flatten() (the list library of Kubernetes 1.34); an older API server
# would compile the policy with an error and, with failurePolicy Ignore, admit anyway.
MIN_SERVER = (1, 34)


@dataclass
class BackstopState:
    """What the writer works from."""

    config: BackstopConfig
    rules_configmap: str
    rules_key: str
    tag_ttl: dt.timedelta
    owner: dict[str, Any] | None = None
    rules: RuleSet = field(default_factory=RuleSet)
    # What was last written: the policy objects, and the shards by name.
    installed: list[dict[str, Any]] | None = None
    written: dict[str, Any] | None = None
    # The last compile and the fingerprint of the verdicts it was made from.
    compiled: tuple[str, Params] | None = None
    # Seconds the last sync's list of the ImageVerdicts took: what the writer's pace is
    # measured against (not the policy's install or the shards' writes, which happen
    # only on a change: a first install that took 12 s on the loaded node held the next
    # sync, and a rules change made meanwhile, for 30 s).
    list_seconds: float = 0.0


def server_supported(api: client.ApiClient) -> tuple[bool, str]:
    info = client.VersionApi(api).get_code()
    try:
        major = int("".join(ch for ch in info.major if ch.isdigit()))
        minor = int("".join(ch for ch in info.minor if ch.isdigit()))
    except ValueError:
        return False, f"cannot read the API server version {info.git_version!r}"
    ok = (major, minor) >= MIN_SERVER
    return ok, info.git_version


def owner_of(api: client.ApiClient, webhook_configuration: str) -> dict[str, Any] | None:
    """An ownerReference to the chart's ValidatingWebhookConfiguration, if it exists."""
    try:
        vwc = client.AdmissionregistrationV1Api(api).read_validating_webhook_configuration(
            webhook_configuration
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    meta = vwc.metadata or client.V1ObjectMeta()
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "name": meta.name,
        "uid": meta.uid,
    }


# The kube-controller-manager writes the policy's status once it has type-checked a new
# generation (~12 s after it on the 2-core node): a replace read before that write gets
# a 409, and the next sync came a whole pace later (a rule's refusal missed a 30 s wait
# in CI). Such a conflict is read again and retried at once, a few times.
PUT_ATTEMPTS = 5


def _put(read: Any, create: Any, replace: Any, obj: dict[str, Any]) -> None:
    """Create, or replace at the resourceVersion read, read again after a conflict (a raw
    object: the policy is built as the JSON the API takes, which the client passes
    through as is)."""
    name = obj["metadata"]["name"]
    for attempt in range(PUT_ATTEMPTS):
        try:
            current = read(name)
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                create(obj)
                return
            except ApiException as exc:
                # Created meanwhile (both replicas install at start: the one that lost
                # started all over 2 s later, another install of ~12 s on the loaded
                # node): read it, and replace it.
                if exc.status != 409 or attempt == PUT_ATTEMPTS - 1:
                    raise
                continue
        obj["metadata"]["resourceVersion"] = current.metadata.resource_version
        try:
            replace(name, obj)
            return
        except ApiException as exc:
            if exc.status != 409 or attempt == PUT_ATTEMPTS - 1:
                raise


def install(
    api: client.ApiClient,
    config: BackstopConfig,
    owner: dict[str, Any] | None,
    rules: RuleSet | None = None,
) -> list[dict[str, Any]]:
    """Create or replace the policy and its bindings (idempotent), and remove the three
    per-mode policies an earlier release kept. Returns what was written."""
    adm = client.AdmissionregistrationV1Api(api)
    objects = policies(config, rules)
    for obj in copy.deepcopy(objects):
        if owner is not None:
            obj["metadata"]["ownerReferences"] = [owner]
        if obj["kind"] == "ValidatingAdmissionPolicy":
            _put(
                adm.read_validating_admission_policy,
                adm.create_validating_admission_policy,
                adm.replace_validating_admission_policy,
                obj,
            )
        else:
            _put(
                adm.read_validating_admission_policy_binding,
                adm.create_validating_admission_policy_binding,
                adm.replace_validating_admission_policy_binding,
                obj,
            )
    for mode in MODES:
        _delete_quietly(adm.delete_validating_admission_policy, binding_name(config, mode))
    return objects


def _delete_quietly(delete: Any, *args: Any) -> bool:
    """Delete; False when it was not there (404) or may not be (403, said once)."""
    try:
        delete(*args, _request_timeout=REQUEST_TIMEOUT)
    except ApiException as exc:
        # 404: never installed. 403: a chart without the rights to remove it (an older
        # release); said, so an admin can delete it by hand.
        if exc.status == 403:
            log.warning("not allowed to remove %s; delete it by hand", args[-1])
        elif exc.status != 404:
            raise
        return False
    return True


def uninstall(api: client.ApiClient, config: BackstopConfig) -> bool:
    """Remove what ``install`` and the writer made (the backstop turned off after it was
    on); True when something was removed."""
    adm = client.AdmissionregistrationV1Api(api)
    custom = client.CustomObjectsApi(api)
    removed = False
    for obj in policies(config):
        delete = (
            adm.delete_validating_admission_policy
            if obj["kind"] == "ValidatingAdmissionPolicy"
            else adm.delete_validating_admission_policy_binding
        )
        removed |= _delete_quietly(delete, obj["metadata"]["name"])
    for mode in MODES:  # an earlier release's per-mode policies
        removed |= _delete_quietly(
            adm.delete_validating_admission_policy, binding_name(config, mode)
        )
    # An earlier release's single parameter object, then every shard.
    args = (PARAMS_GROUP, PARAMS_VERSION, PARAMS_PLURAL)
    removed |= _delete_quietly(custom.delete_cluster_custom_object, *args, config.name)
    try:
        gone = custom.delete_collection_cluster_custom_object(
            *args,
            label_selector=f"{SHARD_LABEL}={config.name}",
            _request_timeout=REQUEST_TIMEOUT,
        )
    except ApiException as exc:
        if exc.status == 403:
            log.warning("not allowed to remove the backstop's shards; delete them by hand")
        elif exc.status != 404:
            raise
    else:
        removed |= bool(isinstance(gone, dict) and gone.get("items"))
    return removed


def read_rules(api: client.ApiClient, state: BackstopState) -> RuleSet:
    """The live rules, or the last good ones when the ConfigMap is broken or unreadable."""
    namespace = state.config.params_namespace
    try:
        cm = client.CoreV1Api(api).read_namespaced_config_map(state.rules_configmap, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return RuleSet((), "<no rules ConfigMap>")
        log.warning("cannot read the rules ConfigMap (%s); keeping the last rules", exc.reason)
        return state.rules
    text = (cm.data or {}).get(state.rules_key)
    if text is None:
        return RuleSet((), f"configmap {namespace}/{state.rules_configmap}")
    try:
        return load_rules_text(text, f"configmap {namespace}/{state.rules_configmap}")
    except RulesError as exc:
        log.warning("rules ConfigMap rejected, keeping the last good rules: %s", exc)
        return state.rules


def write_params(
    api: client.ApiClient,
    config: BackstopConfig,
    params: Params,
    written: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the shards (each created or replaced at the resourceVersion read; one equal
    to what was last written is left alone), then remove the shards of another count and
    an earlier release's single object, only once the new set is all there, so no entry
    is ever missing. Returns the shards' data by name."""
    custom = client.CustomObjectsApi(api)
    args = (PARAMS_GROUP, PARAMS_VERSION, PARAMS_PLURAL)
    bodies = shard_objects(config, params)
    now: dict[str, Any] = {}
    for body in bodies:
        name = body["metadata"]["name"]
        now[name] = body["data"]
        if written is not None and written.get(name) == body["data"]:
            continue
        try:
            current = custom.get_cluster_custom_object(
                *args, name, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            custom.create_cluster_custom_object(*args, body, _request_timeout=REQUEST_TIMEOUT)
            continue
        body["metadata"]["resourceVersion"] = meta(
            current if isinstance(current, dict) else {}
        ).get("resourceVersion")
        custom.replace_cluster_custom_object(*args, name, body, _request_timeout=REQUEST_TIMEOUT)
    listed = custom.list_cluster_custom_object(
        *args, label_selector=f"{SHARD_LABEL}={config.name}", _request_timeout=REQUEST_TIMEOUT
    )
    for item in listed.get("items", []) if isinstance(listed, dict) else []:
        name = meta(item).get("name")
        if isinstance(name, str) and name not in now:
            _delete_quietly(custom.delete_cluster_custom_object, *args, name)
    if written is None:
        _delete_quietly(custom.delete_cluster_custom_object, *args, config.name)
    return now


# ImageVerdicts the backstop reads: the controller's memory. At 100,000 the index holds
# 54 MiB and a compile peaks at 122 MiB of Python allocations (bench/backstop_compile.py),
# within the chart's 256Mi limit beside the process's own ~70 MiB; 64 shards would hold
# more. Past it the rest are left to the webhook, and the log says so.
MAX_BACKSTOP_VERDICTS = 125_000


def read_verdicts(
    api: client.ApiClient, tag_ttl: dt.timedelta, now: dt.datetime
) -> tuple[EntryIndex, str]:
    """Every ImageVerdict (up to MAX_BACKSTOP_VERDICTS), a page at a time, into the
    entries they compile to, and a fingerprint of what was read (every object's name and
    resourceVersion, in the API's order): an unchanged fingerprint means unchanged
    entries. Never more than one page of whole objects is held."""
    custom = client.CustomObjectsApi(api)
    index = EntryIndex(tag_ttl, now)
    fingerprint = hashlib.sha256()
    scans = 0  # scan verdicts have their own share, as in the webhook's store
    for page, _ in list_pages(custom.list_cluster_custom_object, GROUP, VERSION, PLURAL):
        for obj in page:
            named = f"{meta(obj).get('name')}\0{meta(obj).get('resourceVersion')}\n"
            fingerprint.update(named.encode())
            v = verdict_from_object(obj)
            if v is not None and v.from_scan:
                scans += 1
                if scans > MAX_SCAN_VERDICTS:
                    continue
            if v is not None:
                index.add(v)
        if index.verdicts >= MAX_BACKSTOP_VERDICTS:
            log.warning(
                "backstop: more than %d ImageVerdicts; the rest are left to the webhook",
                MAX_BACKSTOP_VERDICTS,
            )
            break
    return index, fingerprint.hexdigest()


def sync_once(api: client.ApiClient, state: BackstopState, now: dt.datetime) -> Params:
    """Reinstall the policy when the rules changed, then compile and, when they changed,
    write the shards. Returns what was compiled."""
    state.rules = read_rules(api, state)
    wanted = policies(state.config, state.rules)
    if wanted != state.installed:
        state.installed = install(api, state.config, state.owner, state.rules)
        _, left = rule_checks(state.rules)
        log.info("backstop policy written (%d deny rules left to the webhook)", left)
    listing = time.monotonic()
    try:
        index, fingerprint = read_verdicts(api, state.tag_ttl, now)
    finally:
        # A list that failed midway (a 504 after seconds at 100,000 verdicts) counts too.
        state.list_seconds = time.monotonic() - listing
    last = state.compiled
    if (
        last is not None
        and last[0] == fingerprint
        and (last[1].next_change is None or now < last[1].next_change)
    ):
        # Nothing to recompile (at 100,000 verdicts a compile takes seconds, and this
        # runs every POLL seconds): the verdicts and the tag expiries are as they were.
        params = last[1]
    else:
        params = compile_params(index, now)
        state.compiled = (fingerprint, params)
    wanted_data = {o["metadata"]["name"]: o["data"] for o in shard_objects(state.config, params)}
    if wanted_data != state.written:
        state.written = write_params(api, state.config, params, state.written)
        log.info(
            "backstop parameters written: %d refused images in %d shards (%d did not fit)",
            params.kept,
            len(params.shards),
            params.dropped,
        )
    return params


class ChangeSync:
    """The writer's wake-up: any ImageVerdict event (or a relist after 410 Gone, which
    may have missed some) sets ``changed``; nothing of the verdicts is kept."""

    resource = "imageverdict-changes"
    off_loop = False

    def __init__(self) -> None:
        self.changed = asyncio.Event()

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> None:
        self.changed.set()

    def event(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.changed.set()


async def _rest(wait: float, floor: float, changed: asyncio.Event) -> None:
    """Rest ``floor`` seconds, then until ``wait`` has passed or ``changed`` is set."""
    await asyncio.sleep(floor)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(changed.wait(), max(0.0, wait - floor))


async def run_writer(
    api: client.ApiClient,
    state: BackstopState,
    leadership: Leadership | None = None,
    changed: asyncio.Event | None = None,
) -> None:
    """Keep the parameters current until cancelled; on the replica kopf peering keeps
    active only (``leadership``: the other would list every verdict as often, for
    nothing). A sync follows ``changed`` (cleared as the sync starts, so a change during
    a sync brings the next) as soon as the pace allows (PACE times as long as the last
    list of the ImageVerdicts took), else every POLL seconds."""
    loop = asyncio.get_running_loop()
    leadership = leadership or STANDALONE
    changed = changed or asyncio.Event()  # without a watch: never set, the poll alone
    followed = False
    while True:
        now = dt.datetime.now(dt.UTC)
        started = time.monotonic()
        changed.clear()
        try:
            wait = POLL
            if not await loop.run_in_executor(None, leadership.leads):
                followed = True
                await asyncio.sleep(FOLLOWER_POLL)
                continue
            if followed:
                # Taking over: what this replica installed at its start may have been
                # replaced by the leader since; install what the rules say now.
                state.installed, followed = None, False
            params = await loop.run_in_executor(None, sync_once, api, state, now)
            if params.next_change is not None:
                wait = min(wait, max(0.5, (params.next_change - now).total_seconds()))
            rest = PACE * state.list_seconds
        except Exception as exc:  # a dropped connection must not end the writer
            if isinstance(exc, ApiException):
                log.warning("backstop sync failed (%s %s: %s); retrying", exc.status,
                            exc.reason, api_message(exc))  # fmt: skip
            else:
                log.warning("backstop sync failed (%s: %s); retrying", type(exc).__name__, exc)
            wait, rest = POLL, PACE * (time.monotonic() - started)
        # A sync lists every ImageVerdict (100,000 take seconds of the API server's time
        # too): rest at least twice as long as that list took, so the backstop keeps the
        # API server's list busy a third of the time at most; after a failed sync, twice
        # as long as the whole attempt (its writes may be what fails, again and again).
        await _rest(wait, rest, changed)


# --- kopf wiring ---------------------------------------------------------------------


async def start(api: client.ApiClient, config: ControllerConfig) -> BackstopState | None:
    """Install the policies (or remove them when off) and return the writer's state."""
    loop = asyncio.get_running_loop()
    backstop = config.backstop
    if backstop is None:
        off = BackstopConfig(params_namespace=config.namespace, name=config.backstop_name)
        if await loop.run_in_executor(None, uninstall, api, off):
            log.info("outage backstop %s removed (it is off)", off.name)
        return None
    ok, version = await loop.run_in_executor(None, server_supported, api)
    if not ok:
        log.warning(
            "the API server (%s) is older than %d.%d: the outage backstop is not installed",
            version,
            *MIN_SERVER,
        )
        return None
    owner = await loop.run_in_executor(None, owner_of, api, config.validating_webhook)
    state = BackstopState(
        config=backstop,
        rules_configmap=config.rules_configmap,
        rules_key=config.rules_key,
        tag_ttl=config.tag_ttl,
        owner=owner,
    )
    # Installed with the live rules, so that the first sync does not install it again
    # (each write of the policy has the API server compile its CEL: seconds of a core on
    # the loaded node).
    state.rules = await loop.run_in_executor(None, read_rules, api, state)
    state.installed = await loop.run_in_executor(None, install, api, backstop, owner, state.rules)
    log.info("outage backstop installed: %s-{enforce,warn,audit}", backstop.name)
    return state


async def keep(api: client.ApiClient, config: ControllerConfig, memo: kopf.Memo) -> None:
    """Install (retrying: a just-started API server answered 422 on the node while its
    storage initialized), then keep the parameters current until cancelled."""
    delay = 2.0
    while True:
        try:
            state = await start(api, config)
            break
        except Exception as exc:
            # The webhook still judges; the backstop is only for its outages. It must
            # not keep the controller (and certificate rotation) from starting.
            said = (
                f"{exc.status} {exc.reason}: {api_message(exc)}"
                if isinstance(exc, ApiException)
                else f"{type(exc).__name__}: {exc}"
            )
            log.error("outage backstop not installed (%s); retrying in %.0f s", said, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 60.0)
    if state is not None:
        memo["backstop"] = state
        changes = ChangeSync()
        custom = client.CustomObjectsApi(api)
        source = changes_source(custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
        watching = asyncio.create_task(run_watch(changes, source, Metrics()))
        try:
            await run_writer(api, state, memo.get("leadership"), changes.changed)
        finally:
            watching.cancel()


@kopf.on.startup(id="epguard-backstop-start")
async def _start(memo: kopf.Memo, **_: Any) -> None:
    config: ControllerConfig = memo["config"]
    memo["backstop_task"] = asyncio.create_task(keep(memo["api"], config, memo))


@kopf.on.cleanup(id="epguard-backstop-stop")
async def _stop(memo: kopf.Memo, **_: Any) -> None:
    task: asyncio.Task[None] | None = memo.get("backstop_task")
    if task is not None:
        task.cancel()
