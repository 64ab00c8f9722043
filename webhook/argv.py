"""What a container will actually run, and whether that asks for mooncake elastic EP.

The kubelet builds argv as ``command + args`` after expanding ``$(VAR)`` from the
container's environment; many manifests then hide the real launch line inside
``sh -c SCRIPT``. SGLang parses it with plain argparse, so ``--flag=value`` and
unambiguous prefixes (``--elastic-ep-b mooncake``) count, and the last
occurrence wins. Everything here is lenient: wire input is untrusted, so odd
types degrade to "nothing found", never to an exception.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

FLAG = "--elastic-ep-backend"
# argparse accepts any unique prefix. "--elastic" is the shortest that can be
# unique (in SGLang 0.5.9/0.5.10 no other option starts with it); later
# versions add --elastic-ep-rejoin/-join-mode, where SGLang itself would reject
# a short prefix as ambiguous. Over-detecting a pod that cannot start anyway is
# the safe direction.
MIN_PREFIX = "--elastic"
WANTED = "mooncake"
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh", "busybox"})
SHELL_OPERATORS = frozenset({";", "&&", "||", "|", "&", "\n", "(", ")", ";;"})
MAX_SHELL_DEPTH = 4
MAX_SHLEX_CHARS = 64 * 1024

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
# $NAME or ${NAME} inside a shell script; the shell takes them from the environment.
_SHELL_REF = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")

ShellEnv = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class ArgvReport:
    """What the detector saw in one container's argv."""

    requests_mooncake: bool
    # The raw values given to the flag (after expansion), for messages.
    values: tuple[str, ...] = ()
    # A value that still holds an unexpanded variable: it cannot be judged here.
    unresolved_value: str | None = None
    # "--config FILE" is present: the flag may be set in a file we cannot read.
    config_file: str | None = None
    looks_like_sglang: bool = False


NOTHING = ArgvReport(requests_mooncake=False)


def _as_str_list(value: Any) -> list[str]:
    if not isinstance(value, list):
        return []
    return [v if isinstance(v, str) else str(v) for v in value if v is not None]


def env_mapping(env: Any) -> dict[str, str]:
    """Literal env values, each expanded against the ones before it, as the kubelet does.

    ``valueFrom`` entries are left out: their values live in Secrets, ConfigMaps
    or the downward API and are unknown at admission.
    """
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
        if value is None or ("valueFrom" in item and item.get("valueFrom") is not None):
            mapping.pop(name, None)
            continue
        mapping[name] = expand(value if isinstance(value, str) else str(value), mapping)
    return mapping


def expand(text: str, mapping: Mapping[str, str]) -> str:
    """Kubelet ``$(VAR)`` expansion: defined names are replaced, undefined ones kept,
    and ``$$`` is an escaped ``$``."""
    if "$" not in text:
        return text

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return mapping.get(name, m.group(0))

    return _VAR_REF.sub(sub, text)


def container_argv(container: Mapping[str, Any]) -> tuple[str, ...]:
    parts = _as_str_list(container.get("command")) + _as_str_list(container.get("args"))
    if not any("$(" in p for p in parts):
        # Nothing to expand: skip building the env mapping, which for a worker with
        # dozens of variables is most of the cost of judging it.
        return tuple(parts)
    env = env_mapping(container.get("env"))
    return tuple(expand(p, env) for p in parts)


def _shell_script_index(tokens: Sequence[str], i: int) -> int | None:
    """If tokens[i] is a shell invoked with -c, the index of its SCRIPT operand."""
    base = tokens[i].rsplit("/", 1)[-1]
    if base not in SHELLS:
        return None
    j = i + 1
    if base == "busybox" and j < len(tokens) and tokens[j] in SHELLS:
        j += 1
    has_c = False
    while j < len(tokens):
        t = tokens[j]
        if t.startswith("-") and len(t) > 1 and not t.startswith("--"):
            # clustered short options such as -c, -ec, -lc, -xc
            has_c = has_c or "c" in t[1:]
            j += 1
            continue
        if t.startswith("--") and t != "--":
            j += 1  # --login, --norc …
            continue
        break
    if has_c and j < len(tokens):
        return j
    return None


def _substitute(script: str, env: dict[str, str]) -> str:
    """Expand $NAME / ${NAME} that the container's literal env defines (the shell would;
    unquoted, its result is then word-split, which splitting the text afterwards mimics).
    Unknown names stay as written, and are reported as unresolved if they hold the flag's
    value."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return env.get(name, m.group(0))

    return _SHELL_REF.sub(sub, script)


def _split_script(script: str, env: dict[str, str]) -> list[str]:
    if env and "$" in script:
        script = _substitute(script, env)
    # Line continuations must go before shlex sees them, and newlines are command
    # separators, so turn them into ";".
    text = script.replace("\\\r\n", " ").replace("\\\n", " ").replace("\r\n", "\n")
    if len(text) > MAX_SHLEX_CHARS:
        # shlex costs about a microsecond per character; a huge script would stall the
        # event loop past the API server's timeout. Whitespace splitting still finds
        # the flag in any sane launch line.
        return [t.strip("'\"") for t in text.replace("\n", " ; ").split()]
    lexer = shlex.shlex(text.replace("\n", " ; "), posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:
        # Unbalanced quotes: the shell would fail too; split on whitespace so the
        # flag is still seen.
        return [t.strip("'\"") for t in text.replace("\n", " ; ").split()]


def flatten(argv: Sequence[str], depth: int = 0, env: dict[str, str] | None = None) -> list[str]:
    """argv with every ``sh -c SCRIPT`` replaced by the script's own tokens (nested too)."""
    out: list[str] = []
    i = 0
    n = len(argv)
    while i < n:
        tok = argv[i]
        script_at = _shell_script_index(argv, i) if depth < MAX_SHELL_DEPTH else None
        if script_at is not None:
            out.extend(argv[i:script_at])
            out.append(";")
            out.extend(flatten(_split_script(argv[script_at], env or {}), depth + 1, env))
            out.append(";")
            # Words after the script are $0 $1 … of the script, not commands.
            i = n
            continue
        out.append(tok)
        i += 1
    return out


def _is_flag_prefix(name: str) -> bool:
    return len(name) >= len(MIN_PREFIX) and FLAG.startswith(name)


CACHE_ARGV_BYTES = 16 * 1024


def analyse(argv: tuple[str, ...], shell_env: ShellEnv = ()) -> ArgvReport:
    """Judge one (expanded) argv; ``shell_env`` holds the literal env values that shell
    scripts in it reference. Cached, because the pods of one workload repeat the same
    argv; only argvs of reasonable size are cached, so a few huge ones cannot pin
    megabytes of keys in memory."""
    if sum(len(a) for a in argv) <= CACHE_ARGV_BYTES:
        return _analyse_cached(argv, shell_env)
    return _analyse(argv, shell_env)


@lru_cache(maxsize=2048)
def _analyse_cached(argv: tuple[str, ...], shell_env: ShellEnv) -> ArgvReport:
    return _analyse(argv, shell_env)


def _analyse(argv: tuple[str, ...], shell_env: ShellEnv) -> ArgvReport:
    if not argv:
        return NOTHING
    # Cheap pre-filter: shlex is slow and nearly every container has nothing to see.
    joined = "\x00".join(argv)
    # (The flag may also arrive through an env value a script expands.)
    seen = ("--elastic" in joined or "--config" in joined) or any(
        "--elastic" in v or "--config" in v for _, v in shell_env
    )
    if not seen:
        return NOTHING
    tokens = flatten(argv, env=dict(shell_env))
    looks_like_sglang = "sglang" in joined
    values: list[str] = []
    requested = False
    unresolved: str | None = None
    config_file: str | None = None
    segment_value: str | None = None
    n = len(tokens)
    for i, tok in enumerate(tokens):
        if tok in SHELL_OPERATORS:
            # One launch line ends here; argparse's "last one wins" is per command.
            if segment_value is not None and segment_value.strip().lower() == WANTED:
                requested = True
            segment_value = None
            continue
        if not tok.startswith("--"):
            continue
        name, eq, inline = tok.partition("=")
        if name == "--config" or name == "--config-file":
            config_file = inline if eq else (tokens[i + 1] if i + 1 < n else "")
            continue
        if not _is_flag_prefix(name):
            continue
        if eq:
            value: str | None = inline
        elif i + 1 < n and not tokens[i + 1].startswith("-"):
            value = None if tokens[i + 1] in SHELL_OPERATORS else tokens[i + 1]
        else:
            value = None  # argparse: "expected one argument"; SGLang would not start.
        if value is None:
            continue
        values.append(value)
        segment_value = value
        if "$" in value:
            unresolved = value
    if segment_value is not None and segment_value.strip().lower() == WANTED:
        requested = True
    return ArgvReport(
        requests_mooncake=requested,
        values=tuple(values),
        unresolved_value=unresolved,
        config_file=config_file,
        looks_like_sglang=looks_like_sglang,
    )


@lru_cache(maxsize=2048)
def _script_refs(argv: tuple[str, ...]) -> frozenset[str]:
    """Names a shell script in argv references as $NAME / ${NAME} (none without a shell)."""
    if not any("$" in a for a in argv) or not any(a.rsplit("/", 1)[-1] in SHELLS for a in argv):
        return frozenset()
    return frozenset(a or b for part in argv for a, b in _SHELL_REF.findall(part))


def _shell_env(container: Mapping[str, Any], argv: tuple[str, ...]) -> ShellEnv:
    """The literal env values that shell scripts in argv reference, if any (cheap when none)."""
    names = (
        _script_refs(argv)
        if sum(len(a) for a in argv) <= CACHE_ARGV_BYTES
        else (_script_refs.__wrapped__(argv))
    )
    env = container.get("env")
    if not names or not isinstance(env, list):
        return ()
    # Only literal values can be known; a script that references only valueFrom
    # variables (a pod index, a secret) costs no env expansion at all. (A plain loop:
    # this scans every env entry of every shell-launched container.)
    wanted: set[str] = set()
    for item in env:
        if type(item) is dict:
            name = item.get("name")
            if name in names and item.get("value") is not None and item.get("valueFrom") is None:
                wanted.add(name)
    if not wanted:
        return ()
    mapping = env_mapping(env)
    return tuple(sorted((k, v) for k, v in mapping.items() if k in wanted))


def analyse_container(container: Mapping[str, Any]) -> ArgvReport:
    argv = container_argv(container)
    report = analyse(argv)
    if report.requests_mooncake and report.unresolved_value is None:
        # Settled on the command line: skip scanning env (a worker may carry dozens of
        # variables). Only a later "$VAR" that resets the flag to another value would be
        # missed, and that errs towards judging the pod, never towards letting one through.
        return report
    shell_env = _shell_env(container, argv)
    return analyse(argv, shell_env) if shell_env else report
