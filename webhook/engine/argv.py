"""What a container will run, the Kubernetes half: ``command``/``args`` and ``$(VAR)``.

Whether that asks for mooncake elastic EP is decided by the one reader the probe uses
too (probe/cmdline.py: SGLang's own option table read by argparse, shells and wrappers
opened up), so the admission decision and the in-pod check cannot disagree. What lives
here is only what Kubernetes adds: the kubelet builds argv as ``command + args`` after
expanding ``$(VAR)`` from the container's literal ``env``, and a script's ``$NAME`` may
come from that same env. Everything is lenient: wire input is untrusted, so odd types
degrade to "nothing found", never to an exception. Work is bounded: a ``$(VAR)`` chain
that doubles at each step stops at a fixed size and the container is judged on the safe
side ("requested", when it mentions the flag at all).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epguard.probe import cmdline, shell

FLAG = cmdline.BACKEND
WANTED = cmdline.WANTED
# The most text env expansion may produce for one container (every value together): far
# above any real worker, far below what would hurt the webhook.
MAX_EXPANSION = shell.BUDGET

# The kubelet's $(VAR) (k8s.io/kubernetes third_party/forked/golang/expansion): "$$" is
# "$", and "$(" takes every character up to the next ")" as the name, whatever they are
# (env names may start with "." or "-", and with RelaxedEnvironmentVariableValidation,
# on by default since 1.32, hold any printable character but "="); a name the mapping
# lacks is left as written (expand).
# $NAME or ${NAME…} inside a shell script; the shell takes them from the environment.
_SHELL_REF = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)|([A-Za-z_][A-Za-z0-9_]*))")

ShellEnv = tuple[tuple[str, str], ...]


class ExpansionTooLarge(Exception):
    """``$(VAR)`` expansion would produce more than MAX_EXPANSION characters."""


@dataclass(frozen=True, slots=True)
class ArgvReport:
    """What the reader saw in one container's argv."""

    requests_mooncake: bool
    # The raw values given to the flag (after expansion), for messages.
    values: tuple[str, ...] = ()
    # A value that still holds an unexpanded variable: it cannot be judged here.
    unresolved_value: str | None = None
    # "--config FILE" is present: the flag may be set in a file we cannot read.
    config_file: str | None = None
    looks_like_sglang: bool = False
    # Too large to read exactly: judged as requesting mooncake (the safe side).
    over_budget: bool = False
    # Requested only on the safe side (cmdline.UNPLACED): the flag and mooncake in text no
    # command read places (eval, a script on a shell's stdin, a here-document, an env
    # value). Judged by rules and verdicts; never probed or gated, since what runs it
    # cannot be told (a busybox helper writing a script would get a probe it cannot run).
    unplaced: bool = False

    @property
    def worker(self) -> bool:
        """Requests mooncake on a line epguard reads: a worker to probe and to gate."""
        return self.requests_mooncake and not self.unplaced

    @property
    def may_request_mooncake(self) -> bool:
        """A worker, or may be one where admission cannot see (the flag's value from a
        Secret, ConfigMap, field or shell variable; an SGLang line with ``--config``):
        the pod is probed, and the probe, which sees the values, decides when it starts."""
        return (
            self.worker
            or self.unresolved_value is not None
            or (self.config_file is not None and self.looks_like_sglang)
        )


NOTHING = ArgvReport(requests_mooncake=False)
OVER_BUDGET = ArgvReport(requests_mooncake=True, over_budget=True, looks_like_sglang=True)


def _as_str_list(value: Any) -> list[str]:
    if not isinstance(value, list):
        return []
    return [v if isinstance(v, str) else str(v) for v in value if v is not None]


class _Spend:
    def __init__(self) -> None:
        self.left = MAX_EXPANSION

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise ExpansionTooLarge()


def env_mapping(env: Any, spend: _Spend | None = None) -> dict[str, str]:
    """Literal env values, each expanded against the ones before it, as the kubelet does.

    ``valueFrom`` entries are left out: their values live in Secrets, ConfigMaps or the
    downward API and are unknown at admission. Raises ExpansionTooLarge past the budget.
    """
    spend = spend or _Spend()
    mapping: dict[str, str] = {}
    if not isinstance(env, list):
        return mapping
    for item in env:
        if not isinstance(item, dict):
            continue
        name = item.get("name")
        value = item.get("value")
        if not isinstance(name, str) or not name:
            continue
        if item.get("valueFrom") is not None:
            mapping.pop(name, None)
            continue
        if value is None:
            # `value: ""` is stored without the field (omitempty): the kubelet sets the
            # variable to "". Unknown, it made `moon$(E)cake` unresolved here while
            # `epguard check` of the same manifest (value "") refused it.
            value = ""
        mapping[name] = expand(value if isinstance(value, str) else str(value), mapping, spend)
    return mapping


def expand(text: str, mapping: Mapping[str, str], spend: _Spend | None = None) -> str:
    """Kubelet ``$(VAR)`` expansion: defined names are replaced, undefined ones kept, and
    ``$$`` is an escaped ``$``; a ``$(`` with no ``)`` after it is kept as written. The
    result's size is checked before it is built. One pass: each ``)`` is looked for once
    (a regular expression scanned to the end from every unclosed ``$(``: 2.9 s for 40 KB
    of them, found by a review helper)."""
    if "$" not in text:
        return text
    spend = spend or _Spend()
    parts: list[str] = []
    pos = i = 0
    n = len(text)
    close = -1  # the first ")" at or after the last search (-2: there is none)
    while True:
        j = text.find("$", i)
        if j < 0 or j + 1 >= n:
            break
        after = text[j + 1]
        if after == "$":
            parts.append(text[pos:j])
            parts.append("$")
            pos = i = j + 2
            continue
        if after != "(" or close == -2:
            i = j + 1
            continue
        if close < j + 2:
            close = text.find(")", j + 2)
            if close < 0:
                close = -2
                i = j + 1
                continue
        value = mapping.get(text[j + 2 : close])
        if value is not None:
            spend.take(len(value))
            parts.append(text[pos:j])
            parts.append(value)
            pos = close + 1
        i = close + 1
    parts.append(text[pos:])
    return "".join(parts)


def container_argv(container: Mapping[str, Any]) -> tuple[str, ...]:
    """command + args after ``$(VAR)`` expansion; raises ExpansionTooLarge."""
    parts = _as_str_list(container.get("command")) + _as_str_list(container.get("args"))
    if not any("$(" in p for p in parts):
        # Nothing to expand: skip building the env mapping, which for a worker with
        # dozens of variables is most of the cost of judging it.
        return tuple(parts)
    spend = _Spend()
    env = env_mapping(container.get("env"), spend)
    return tuple(expand(p, env, spend) for p in parts)


# The cache of judged argvs, bounded by entries and by the characters its keys hold:
# a key is the argv *and* the env values its scripts name, both a tenant's choice, so
# an entry is kept only when the two together are within one reading budget, and the
# whole cache, keys and reports' strings, within CACHE_CHARS. Before
# the env counted, an `sh -c "echo '$A'"` beside a worker, with a 1.3 MB A different in
# each pod, kept 1.3 MB an entry: 2,048 of them would be 2.6 GB, in the webhook and in
# the controller, which judges every gated pod's containers each pass.
CACHE_SIZE = 2048
CACHE_CHARS = 4 * 1024 * 1024
_Key = tuple[tuple[str, ...], ShellEnv]
_cache: OrderedDict[_Key, tuple[ArgvReport, int]] = OrderedDict()
_cache_chars = 0
_cache_lock = threading.Lock()  # the webhook judges on a pool of threads


def key_chars(argv: tuple[str, ...], shell_env: ShellEnv) -> int:
    """What a cache key holds, in characters: every argv word and every env name and value."""
    return sum(map(len, argv)) + sum(len(name) + len(value) for name, value in shell_env)


def _cached(key: _Key) -> ArgvReport | None:
    with _cache_lock:
        hit = _cache.get(key)
        if hit is None:
            return None
        _cache.move_to_end(key)
        return hit[0]


def _remember(key: _Key, report: ArgvReport, chars: int) -> None:
    global _cache_chars
    with _cache_lock:
        if key in _cache:
            return
        _cache[key] = (report, chars)
        _cache_chars += chars
        while len(_cache) > CACHE_SIZE or _cache_chars > CACHE_CHARS:
            _, (_, gone) = _cache.popitem(last=False)
            _cache_chars -= gone


def analyse(
    argv: tuple[str, ...], shell_env: ShellEnv = (), budget: shell.Budget | None = None
) -> ArgvReport:
    """Judge one (expanded) argv; ``shell_env`` holds the literal env values that shell
    scripts in it reference; ``budget`` is shared by everything one review reads, so a
    pod of many huge containers costs no more than one.

    Cached, because the pods of one workload repeat the same argv: only argvs of
    reasonable size, env values included (a few huge ones cannot pin megabytes of keys
    in memory), and never an over-budget answer (it says nothing about the argv, only
    about the review)."""
    chars = key_chars(argv, shell_env)
    small = chars <= shell.BUDGET
    key = (argv, shell_env)
    if small and (hit := _cached(key)) is not None:
        return hit
    report = _analyse(argv, shell_env, budget or shell.Budget())
    if small and not report.over_budget:
        _remember(key, report, chars + _report_chars(report))
    return report


def _report_chars(report: ArgvReport) -> int:
    """What a report holds beside its key, in characters (its values may be expansions,
    new strings: "$A$A")."""
    return (
        sum(map(len, report.values))
        + len(report.unresolved_value or "")
        + len(report.config_file or "")
    )


def _analyse(argv: tuple[str, ...], shell_env: ShellEnv, budget: shell.Budget) -> ArgvReport:
    reading = cmdline.read(argv, env=dict(shell_env), budget=budget)
    if (
        reading.launcher is None
        and not reading.requested  # read on the safe side, no command placing it
        and reading.config_file is None
        and not reading.over_budget
        and reading.unresolved is None
    ):
        return NOTHING  # the common case (read() saw nothing at all): no strings to build
    return ArgvReport(
        requests_mooncake=reading.requested,
        values=tuple(reading.values),
        unresolved_value=reading.unresolved,
        config_file=reading.config_file,
        looks_like_sglang=reading.over_budget or any("sglang" in a for a in argv),
        over_budget=reading.over_budget,
        unplaced=reading.unplaced,
    )


def _script_refs(argv: tuple[str, ...]) -> frozenset[str]:
    """Names a shell script in argv references as $NAME / ${NAME} (none without a shell)."""
    if not any("$" in a for a in argv):
        return frozenset()
    return frozenset(a or b for part in argv for a, b in _SHELL_REF.findall(part))


def _shell_env(container: Mapping[str, Any], argv: tuple[str, ...]) -> ShellEnv:
    """The literal env values that shell scripts in argv reference, and those that mention
    the flag (an entrypoint may read its arguments from one: cmdline's safe side reads
    them, as the probe, which has the whole env, does), if any (cheap when none)."""
    names = set(_script_refs(argv))
    env = container.get("env")
    if not isinstance(env, list):
        return ()
    for item in env:
        if type(item) is dict:
            value = item.get("value")
            if isinstance(value, str) and cmdline.mentions_flag(value):
                name = item.get("name")
                if isinstance(name, str):
                    names.add(name)
    if not names:
        return ()
    # Only literal values can be known; a script that references only valueFrom
    # variables (a pod index, a secret) costs no env expansion at all.
    wanted: set[str] = set()
    for item in env:
        if type(item) is dict:
            name = item.get("name")
            # Without value (stored so when it was ""): the empty string, env_mapping's.
            if isinstance(name, str) and name in names and item.get("valueFrom") is None:
                wanted.add(name)
    if not wanted:
        return ()
    mapping = env_mapping(env)
    return tuple(sorted((k, v) for k, v in mapping.items() if k in wanted))


def _mentions_the_flag(container: Mapping[str, Any]) -> bool:
    texts = _as_str_list(container.get("command")) + _as_str_list(container.get("args"))
    env = container.get("env")
    if isinstance(env, list):
        texts += [str(e.get("value")) for e in env if isinstance(e, dict) and e.get("value")]
    return any(cmdline.mentions_flag(t) for t in texts)


def analyse_container(
    container: Mapping[str, Any], budget: shell.Budget | None = None
) -> ArgvReport:
    """Judge one container. Pass one ``budget`` for every container of a review."""
    budget = budget or shell.Budget()
    try:
        argv = container_argv(container)
        report = analyse(argv, (), budget)
        if report.worker and report.unresolved_value is None:
            # Settled on the command line: skip scanning env (a worker may carry dozens
            # of variables). Only a later "$VAR" that resets the flag to another value
            # would be missed, and that errs towards judging the pod, never towards
            # letting one through.
            return report
        shell_env = _shell_env(container, argv)
        return analyse(argv, shell_env, budget) if shell_env else report
    except ExpansionTooLarge:
        return OVER_BUDGET if _mentions_the_flag(container) else NOTHING
