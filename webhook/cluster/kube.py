"""The official ``kubernetes`` client, configured one way for the webhook and the controller.

Credentials, in order: an explicit kubeconfig (``EPGUARD_KUBECONFIG``); the pod's service
account at ``KUBERNETES_SERVICE_HOST``/``_PORT`` (the client's in-cluster config, which
needs no cluster DNS and re-reads the projected token as the kubelet rotates it);
``$KUBECONFIG``. The webhook stops there: one started by hand must not silently watch
whatever cluster ``~/.kube/config`` points at. The controller, like kopf's own login,
falls back to ``~/.kube/config``.

Every call that is not a watch carries ``REQUEST_TIMEOUT``: the client has no default,
and a call hung on a half-open connection would stall a kopf handler or a sync loop
forever.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from epguard.webhook.engine.verdicts import GROUP, PLURAL, VERSION
from epguard.webhook.engine.workloads import as_list, as_map

# Seconds: (connect, read). Generous for a loaded API server, short against a dead one.
REQUEST_TIMEOUT = (5.0, 30.0)

# A raw JSON object from the API (the shapes the engine reads are typed where read).
Json = dict[str, Any]
# Objects per page of a list call: bounded responses however large the collection.
LIST_PAGE = 500


# How deep an object the API server may hand out. It decodes requests with Go's
# encoding/json rules (sigs.k8s.io/json), which refuse nesting past 10,000 levels; a
# pod's ``metadata.managedFields[].fieldsV1`` is free-form JSON that any tenant may
# write that deep with a PATCH, and the API server stores and serves it (checked on
# v1.35.4). Python's json and msgspec stop at the interpreter's recursion limit, 1,000
# by default: one such pod in a tenant's namespace made every list and watch of pods
# raise RecursionError, kopf's pod watcher too, which then stays dead (found by a
# review helper). Decoded with a deeper limit, it is one more pod.
API_DEPTH = 10_000
# A thread's stack for that: json's C decoder takes ~150 bytes a level, and msgspec's
# ~800 when it builds the objects (measured: 10,000 levels fit in 2 MiB and 8 MiB). The
# usual default (glibc's, from an 8 MiB RLIMIT_STACK), set so that a container without
# that limit (glibc then gives threads 2 MiB) gets it too.
THREAD_STACK = 8 * 1024 * 1024


def allow_api_depth() -> None:
    """Let this process decode and copy any object the API server serves: the recursion
    limit (two frames a level: kopf deep-copies each event's body, and ``copy.deepcopy``
    takes two Python frames per level, which in Python 3.11 use no C stack; found on a
    real API server), and the stack of every thread started after this call (the main
    thread has the process's, 8 MiB in the image; json, repr and ``==`` recurse in C one
    step a level, 10,000 levels measured within it). Call it before any thread starts.
    (Python 3.11, the image's: from 3.12 C code's recursion has a fixed limit of its
    own, which this does not raise.)"""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 2 * API_DEPTH + 2_000))
    threading.stack_size(THREAD_STACK)


class NoCredentials(Exception):
    """No kubeconfig and no service account: there is no cluster to talk to."""


# Connections a client keeps open to the API server: more than the threads that call it
# at once (the controller's pass workers, kopf's handler executor, the background
# writers). The client's default is 5 per CPU, 10 on two cores: a 200-pod preflight run
# on the local node overflowed it ("Connection pool is full, discarding connection", 33
# times), and every discarded connection is a new TLS handshake on a busy API server.
CONNECTIONS = 32


def _client(cfg: client.Configuration) -> client.ApiClient:
    cfg.connection_pool_maxsize = CONNECTIONS
    return client.ApiClient(cfg)


def _from_kubeconfig(path: str | None) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=path, client_configuration=cfg)
    return _client(cfg)


def api_client(explicit: str | None = None, *, home_kubeconfig: bool = False) -> client.ApiClient:
    """A configured ApiClient; NoCredentials when none of the sources exists."""
    if explicit:
        return _from_kubeconfig(explicit)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except ConfigException:
            pass  # the variables without a token: not a pod after all
        else:
            return _client(cfg)
    env_path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    if env_path and os.path.exists(env_path):
        return _from_kubeconfig(env_path)
    if home_kubeconfig:
        try:
            return _from_kubeconfig(None)
        except ConfigException as exc:
            raise NoCredentials(str(exc)) from None
    raise NoCredentials("no EPGUARD_KUBECONFIG, service account or $KUBECONFIG")


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an API error, None for anything else."""
    return exc.status if isinstance(exc, ApiException) else None


def _status(exc: ApiException) -> dict[str, Any]:
    """The Status object in an error's body ({} when there is none)."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def api_message(exc: ApiException) -> str:
    """The API server's own message in an error (its Status body: a policy's or RBAC's
    refusal), else its reason; bounded."""
    return str(_status(exc).get("message") or exc.reason)[:500]


def status_causes(exc: ApiException) -> list[str]:
    """The ``details.causes[].type`` of an error's Status body (``NamespaceTerminating``
    when a create lands in a namespace being deleted); empty when there are none."""
    causes = as_list(as_map(_status(exc).get("details")).get("causes"))
    return [str(c["type"]) for c in causes[:100] if isinstance(c, dict) and "type" in c]


def raw(response: Any) -> Json:
    """The JSON object of a ``_preload_content=False`` response (no model round trip)."""
    data = response.data if hasattr(response, "data") else response.read()
    obj = json.loads(data)
    return obj if isinstance(obj, dict) else {}


def _list_call(
    fn: Callable[..., Any], args: tuple[Any, ...], limit: int, token: str | None, selectors: Any
) -> Any:
    """One page of a list call, unparsed (``_preload_content=False``)."""
    return fn(
        *args,
        limit=limit,
        _continue=token,
        _preload_content=False,
        _request_timeout=REQUEST_TIMEOUT,
        **selectors,
    )


class _Page(msgspec.Struct):
    """A list call's body as the listers read it: the list's metadata, and each item as
    ``msgspec.Raw`` (a view of the body's bytes, not decoded), in whatever order the
    server wrote them (a custom resource's list has ``items`` before ``metadata``)."""

    metadata: dict[str, Any] | None = None
    items: list[msgspec.Raw] | None = None


_PAGE = msgspec.json.Decoder(_Page)


def _pages(
    fn: Callable[..., Any], args: tuple[Any, ...], page_size: int, selectors: Any
) -> Iterator[tuple[list[msgspec.Raw], str]]:
    """Each page of a list call as its items' bytes, undecoded, with the resourceVersion
    of the snapshot: the first page's, since every page of a paginated list is one
    snapshot. A page is read uncached (urllib3 keeps ``.data``); its body lives only as
    long as the views of its items, so a caller that empties the list it is handed holds
    nothing of the page while the next is read. A caller that stops iterating stops the
    listing."""
    token: str | None = None
    first_rv = ""
    while True:
        resp = _list_call(fn, args, page_size, token, selectors)
        data = resp.read() if hasattr(resp, "read") else resp.data
        del resp
        if not isinstance(data, bytes):
            data = str(data).encode("utf-8")
        page = _PAGE.decode(data)
        del data
        metadata = page.metadata or {}
        first_rv = first_rv or str(metadata.get("resourceVersion") or "")
        token = metadata.get("continue") or None
        items = page.items or []
        del page
        yield items, first_rv
        del items
        if not token:
            return


def list_pages(
    fn: Callable[..., Any], *args: Any, **selectors: Any
) -> Iterator[tuple[list[Mapping[str, Any]], str]]:
    """Each page of a list call (``LIST_PAGE`` objects), decoded as raw JSON (no model
    round trip), with the snapshot's resourceVersion."""
    for raws, version in _pages(fn, args, LIST_PAGE, selectors):
        # Yielded straight from the call, never named here: a generator suspended at
        # its yield keeps its locals, and so the previous page while the next is read.
        yield _decoded(raws), version


def _decoded(raws: list[msgspec.Raw]) -> list[Mapping[str, Any]]:
    page = [json.loads(bytes(r)) for r in raws]
    raws.clear()
    return [i for i in page if isinstance(i, Mapping)]


def list_items(
    fn: Callable[..., Any], *args: Any, page_size: int, **selectors: Any
) -> Iterator[Json]:
    """Every object of a list call, one at a time: a page is ``page_size`` objects, split
    into its items' bytes; each item is decoded alone (``json.loads``, as the official
    client does) and let go before the next, so at most one object is ever parsed at once
    (a 1.5 MiB pod of 50,000 small entries is ~12 MB of Python objects). A page costs its
    bytes and one object."""
    for raws, _ in _pages(fn, args, page_size, selectors):
        raws.reverse()
        while raws:
            item = json.loads(bytes(raws.pop()))
            if isinstance(item, dict):
                yield item
            del item


def snapshot_version(fn: Callable[..., Any], *args: Any, **selectors: Any) -> str:
    """The resourceVersion of a list call's snapshot, read with one object at most: where
    a watch of everything after "now" starts."""
    for _, version in _pages(fn, args, 1, selectors):
        return version
    return ""


def list_all(
    fn: Callable[..., Any],
    *args: Any,
    max_items: int | None = None,
    slim: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    **selectors: Any,
) -> tuple[list[Mapping[str, Any]], str]:
    """Every object a list call returns (each cut down by ``slim`` as its page is read,
    so only one page is ever held whole), and the snapshot's resourceVersion. Stops
    after the page that reaches ``max_items``."""
    items: list[Mapping[str, Any]] = []
    snapshot = ""
    for page, version in list_pages(fn, *args, **selectors):
        items.extend(page if slim is None else map(slim, page))
        del page
        snapshot = version
        if max_items is not None and len(items) >= max_items:
            break
    return items, snapshot


def resource_path(api_version: str, plural: str, namespace: str | None, name: str = "") -> str:
    """The REST path of a resource of any group, core (``v1``) included."""
    group, _, version = api_version.rpartition("/")
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{ns}/{plural}" + (f"/{name}" if name else "")


def get_object(api: client.ApiClient, path: str) -> Json:
    """GET any object by path, as raw JSON (owner kinds the typed APIs do not know)."""
    resp = api.call_api(
        *api.param_serialize(method="GET", resource_path=path, auth_settings=["BearerToken"]),
        _request_timeout=REQUEST_TIMEOUT,
    )
    resp.read()
    if not 200 <= resp.status <= 299:
        raise ApiException(status=resp.status, reason=resp.reason, body=resp.data)
    return raw(resp)


def get_verdict(custom: client.CustomObjectsApi, name: str) -> dict[str, Any] | None:
    """The ImageVerdict ``name`` as raw JSON, None when there is none (other API errors
    raise)."""
    try:
        got = custom.get_cluster_custom_object(
            GROUP, VERSION, PLURAL, name, _request_timeout=REQUEST_TIMEOUT
        )
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None
    return got if isinstance(got, dict) else None


def meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    m = obj.get("metadata")
    return m if isinstance(m, Mapping) else {}


def post_event(
    api: client.ApiClient,
    about: client.V1ObjectReference,
    reason: str,
    message: str,
    *,
    warning: bool,
    component: str,
    key: str,
) -> bool:
    """Post one Event about ``about``; False when it could not be posted (an Event is a
    courtesy and never the reason something else fails). ``key`` names the Event, so the
    same occurrence posted twice is one Event (the second create is a 409)."""
    now = dt.datetime.now(dt.UTC)
    digest = hashlib.sha256(f"{about.kind}/{about.name}/{key}".encode()).hexdigest()[:16]
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(
            name=f"{str(about.name)[:200]}.epguard.{digest}", namespace=about.namespace
        ),
        involved_object=about,
        reason=reason,
        message=message[:1000],
        type="Warning" if warning else "Normal",
        source=client.V1EventSource(component=component),
        first_timestamp=now,
        last_timestamp=now,
        count=1,
    )
    try:
        client.CoreV1Api(api).create_namespaced_event(
            str(about.namespace), event, _request_timeout=REQUEST_TIMEOUT
        )
    except ApiException as exc:
        return bool(exc.status == 409)
    except Exception:
        return False
    return True
