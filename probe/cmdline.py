"""Does a worker's command line ask for ``--elastic-ep-backend mooncake``? The one reader.

The admission webhook, ``epguard check`` and the in-pod probe all ask this question, and
they must never disagree, so all three call ``read()`` here. Its truth is SGLang's own
option table, extracted from real releases (scripts/sglang_options.py writes
sglang_options.json beside this file) and interpreted by the standard library's
argparse, exactly as SGLang does: prefixes and their ambiguity, ``--opt=value``, options
that take no value (``--enable-dp-lm-head`` does not swallow the next word), ``--``, and
the last occurrence wins. Nothing here is a hand-kept list of flags.

- In the probe, the table of the SGLang release installed in the image is used (a
  release newer than the table falls back to the newest table, and says so).
- In the webhook, which cannot see the image, every release in the table is tried and
  the answer is "requested" when any of them would run with mooncake.
- Where SGLang itself would refuse to start (an ambiguous prefix, a missing value), the
  answer comes from a lenient scan: the last spelling of the flag followed by mooncake.
  Refusing to start is no harm; reading such a line as "requested" is the safe side.

Shell scripts, wrappers and launchers are opened up by shell.py. Work is bounded: a
command line larger than shell.BUDGET is judged "requested" if it mentions the flag at
all, never parsed at any cost.

Standard library only, Python >= 3.8.
"""

import argparse
import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

try:
    from . import shell
except ImportError:  # run as `python3 probe`: this directory is on sys.path
    import shell

BACKEND = shell.FLAG
WANTED = "mooncake"
CONFIG = "--config"
TABLE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_options.json")

# Launchers: how SGLang's server arguments start in a simple command.
SGLANG_MODULES = ("sglang.launch_server", "sglang")
DYNAMO_MODULE = "dynamo.sglang"
_PYTHON = re.compile(r"python(?:[0-9](?:\.[0-9]+)?)?$")
# Interpreter options that take the next word (python -X dev -W error -m …).
_PYTHON_OPTS_WITH_ARG = frozenset(("-X", "-W", "--check-hash-based-pycs"))


# --- SGLang's option table ----------------------------------------------------------------

class OptionTable:
    """Every option one SGLang release defines: names and how many values each takes."""

    def __init__(self, release, options, backend_choices):
        self.release = release
        self.options = options  # [(nargs, (name, alias, ...)), ...]
        self.backend_choices = tuple(backend_choices)
        self._parser = None
        self.backend_dest = None
        self.dests = {}  # option name -> dest, for the few options the probe reports

    def parser(self):
        if self._parser is None:
            self._parser = self._build()
        return self._parser

    def _build(self):
        p = _Parser(prog="sglang", add_help=False, allow_abbrev=True)
        for i, (nargs, names) in enumerate(self.options):
            dest = "o" + str(i)
            kwargs = {"dest": dest, "default": None}
            if nargs == 0:
                kwargs.update(action="store_const", const=True)
            elif nargs is not None:
                kwargs["nargs"] = nargs
            p.add_argument(*names, **kwargs)
            for name in names:
                self.dests[name] = dest
        self.backend_dest = self.dests.get(BACKEND)
        return p


class _Refused(Exception):
    """SGLang's argparse would print this and exit 2: the worker would not start."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _Refused(message)


def _version_key(version):
    return tuple(int(x) for x in re.findall(r"[0-9]+", version.split("+", 1)[0]))


_TABLES = None


def tables():
    """Every release's OptionTable, oldest first (read once)."""
    global _TABLES
    if _TABLES is None:
        with open(TABLE_FILE) as f:
            doc = json.load(f)
        out = []
        for release, entry in doc["releases"].items():
            options = [(o[0], tuple(o[1:])) for o in entry["options"]]
            out.append(OptionTable(release, options, entry.get("backend_choices", ())))
        out.sort(key=lambda t: _version_key(t.release))
        _TABLES = tuple(out)
    return _TABLES


def table_for(version):
    """(table, note) for an installed SGLang version; note is None on an exact match."""
    all_ = tables()
    if not version:
        newest = all_[-1].release
        return all_[-1], f"SGLang's version is unknown here; read with the table of {newest}"
    for t in all_:
        if t.release == version:
            return t, None
    key = _version_key(version)
    older = [t for t in all_ if _version_key(t.release) <= key]
    if not older:
        oldest = all_[0].release
        return all_[0], f"SGLang {version} is older than epguard's tables; read with {oldest}"
    t = older[-1]
    if t is all_[-1]:
        return t, f"SGLang {version} is newer than epguard's option tables; read with {t.release}"
    return t, f"SGLang {version} has no option table of its own; read with {t.release}"


# --- the reading ----------------------------------------------------------------------------

@dataclass
class Reading:
    """What a command line asks of SGLang's elastic EP."""

    requested: bool = False
    backend: Optional[str] = None  # the value in force where it was decided, as written
    where: Optional[str] = None  # "argv", "sh -c script", "config <path>"
    launcher: Optional[str] = None  # "sglang.launch_server", "sglang serve", …
    # a release under which the line runs with mooncake (the newest such; the search
    # stops there), or "lenient" when no release would start with it at all
    releases: Tuple[str, ...] = ()
    # (release, argparse's message) where SGLang would refuse to start
    refusals: List[Tuple[str, str]] = field(default_factory=list)
    values: List[str] = field(default_factory=list)  # every value given to the flag
    unresolved: Optional[str] = None  # a value still holding $NAME: unknown until launch
    config_file: Optional[str] = None  # `--config FILE`: settings may hide in that file
    over_budget: bool = False
    dp_attention: bool = False
    attn_dp_size: Optional[int] = None
    notes: List[str] = field(default_factory=list)
    # The program of the command that requested it, as written (``python3``,
    # ``/opt/venv/bin/python``): the interpreter whose packages the worker imports.
    program: Optional[str] = None
    # What in the command line changes which interpreter, packages or libraries the
    # launch finds (``source /opt/venv/bin/activate``, ``export PATH=…``, ``conda run``),
    # as written (clipped); None when nothing does. See steering().
    steered: Optional[str] = None

    @property
    def unplaced(self):
        """Requested only on the safe side (_unplaced): judged by rules and verdicts, never
        probed or gated, since what runs the text cannot be told."""
        return self.requested and self.where == UNPLACED

    def describe(self):
        out = "{} {} ({})".format(BACKEND, (self.backend or "").strip(), self.where)
        if self.over_budget:
            out += "; command line too large to read exactly"
        if self.dp_attention:
            out += "; DP attention on"
            if self.attn_dp_size:
                out += f" (--attn-dp-size {self.attn_dp_size})"
        return out


def _is_mooncake(value):
    return value is not None and str(value).strip().lower() == WANTED


def min_prefix():
    """The shortest spelling of the flag that some release accepts on its own."""
    best = len(BACKEND)
    for t in tables():
        names = [n for _, ns in t.options for n in ns if n.startswith("--")]
        for k in range(3, len(BACKEND) + 1):
            if [n for n in names if n.startswith(BACKEND[:k])] == [BACKEND]:
                best = min(best, k)
                break
    return BACKEND[:best]


def _flag_spelling(word, shortest):
    """Is ``word`` (or its ``--x=`` head) a prefix of the flag that a release accepts?"""
    head = word.split("=", 1)[0]
    return len(head) >= len(shortest) and BACKEND.startswith(head)


def mentions_flag(text: str) -> bool:
    """Cheap test: can anything in ``text`` be read as the flag (in some release)? As
    written, or once a shell has removed its quotes (``-''-elastic-ep-backend`` is the
    flag to a shell): shell.unquoted, free for text without quotes or backslashes."""
    shortest = _shortest()
    return shortest in text or shortest in shell.unquoted(text)


_SHORTEST = None


def _shortest():
    global _SHORTEST
    if _SHORTEST is None:
        _SHORTEST = min_prefix()
    return _SHORTEST


def server_args(words):
    """(launcher, the words SGLang's parser reads) for one simple command."""
    if not words:
        return None, []
    if words[0].startswith("-") and words[0] != "-":
        # `args` without `command`, or a shell array literal (`ARGS=(--tp 8 …)`): the
        # image entrypoint's (or a later command's) arguments, every word of them.
        return "entrypoint", list(words)
    prog = os.path.basename(words[0])
    if prog in shell.REMOTE_LAUNCHERS:
        return prog, []
    if prog == "sglang" and len(words) > 1 and words[1] == "serve":
        return "sglang serve", words[2:]
    if _PYTHON.match(prog):
        i = 1
        while i < len(words):
            w = words[i]
            if w == "-m" and i + 1 < len(words):
                module = words[i + 1]
                if module in SGLANG_MODULES:
                    name = "sglang serve" if module == "sglang" else module
                    rest = words[i + 2:]
                    if module == "sglang" and rest[:1] == ["serve"]:
                        rest = rest[1:]
                    return name, rest
                if module == DYNAMO_MODULE or module.startswith(DYNAMO_MODULE + "."):
                    return module, words[i + 2:]
                return "python -m " + module, words[i + 2:]
            if w.startswith("-m") and len(w) > 2:
                return server_args([words[0], "-m", w[2:]] + words[i + 1:])
            if w in _PYTHON_OPTS_WITH_ARG:
                i += 2
            elif w.startswith("-") and w != "-":
                i += 1
            else:
                return "python " + os.path.basename(w), words[i + 1:]
        return "python", []
    return prog, words[1:]


def _lenient(args, shortest):
    """The last value given to any spelling of the flag, argparse or not."""
    value = None
    for i, w in enumerate(args):
        if w == "--":
            break
        if not w.startswith("--") or not _flag_spelling(w, shortest):
            continue
        if "=" in w:
            value = w.split("=", 1)[1]
        elif i + 1 < len(args) and not args[i + 1].startswith("-"):
            value = args[i + 1]
    return value


def _config_settings(path, read_config):
    """Top-level settings of a SGLang --config file as (key, value) pairs, or None."""
    text = read_config(path) if read_config is not None else None
    return None if text is None else list(parse_simple_yaml(text).items())


_YAML_TRUE = frozenset(("true", "yes", "on"))
_YAML_FALSE = frozenset(("false", "no", "off"))


def _scalar(value):
    """A YAML scalar as written: comments, anchors (&a), tags (!!str) and quotes removed."""
    value = value.strip()
    if " #" in value:
        value = value.split(" #", 1)[0].strip()
    while value[:1] in ("&", "!") and " " in value:
        value = value.split(" ", 1)[1].strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    return value


def parse_simple_yaml(text):
    """Top-level ``key: value`` pairs of a SGLang --config file: block mappings (a value
    on the next, indented line too), quoted keys, anchors and tags, and a one-line flow
    mapping ``{key: value, …}``. Nested mappings are not server arguments."""
    out = {}
    stripped = text.strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        lines = [part for part in stripped[1:-1].split(",")]
    else:
        lines = text.splitlines()
    pending = None  # a key whose value is on the next line
    for raw in lines:
        if pending is not None and raw[:1] in (" ", "\t") and raw.strip():
            body = raw.strip()
            if ": " not in body and not body.endswith(":") and body[:1] != "-":
                out[pending] = _scalar(body)  # a scalar on the next line, not a mapping
            pending = None
            continue
        pending = None
        line = raw.strip() if raw[:1] not in (" ", "\t") or stripped.startswith("{") else ""
        if not line or line[0] in "#-" or ":" not in line:
            continue
        key, _, value = line.partition(":")
        key = _scalar(key).replace("_", "-")
        value = _scalar(value)
        if value:
            out[key] = value
        else:
            pending = key
    return out


def read(
    argv: Sequence[str],
    env: Optional[Mapping[str, str]] = None,
    release: Optional[str] = None,
    read_config: Optional[Callable[[str], Optional[str]]] = None,
    budget: Optional["shell.Budget"] = None,
) -> "Reading":
    """Read ``argv`` (the container's command + args, ``$(VAR)`` already expanded).

    ``env``: values for ``$NAME`` in shell scripts. ``release``: the installed SGLang
    version (None: every release in the table). ``read_config(path)``: the text of a
    ``--config`` file, or None when it cannot be read here.
    """
    r = Reading()
    argv = [a if isinstance(a, str) else str(a) for a in argv]
    env = {str(k): v if isinstance(v, str) else str(v) for k, v in (env or {}).items()}
    shortest = _shortest()
    flagged = any(mentions_flag(a) for a in argv) or any(mentions_flag(v) for v in env.values())
    if not flagged and not any(CONFIG in a for a in argv):
        return r  # nothing can be read as the flag: skip the work
    budget = budget if budget is not None else shell.Budget()
    guessed = len(budget.guesses)
    if release is not None:
        table, note = table_for(release)
        chosen = (table,)
        if note:
            r.notes.append(note)
    else:
        # Newest first: the release a new workload most likely runs, and the first one
        # that runs the line with mooncake settles the answer (the rest need not parse).
        chosen = tables()[::-1]
    try:
        cmds = shell.commands(argv, env, budget)
    except shell.OverBudget:
        _over_budget(r, flagged)
        return r
    for cmd in cmds:
        _read_command(r, cmd, chosen, shortest, read_config, budget)
    guesses = budget.guesses[guessed:]
    if guesses and r.values and r.unresolved is None and not r.requested:
        # The answer rests on a default assumed for a variable this reading cannot see.
        r.unresolved = guesses[-1]
    if not r.requested and r.unresolved is None:
        _unplaced(r, argv, env, shortest, budget)
    if r.requested:
        # The line as written, and each command as the reader made it (text that came
        # through a variable: `bash -c "$LAUNCH"`, `eval "$PRE"`).
        r.steered = steering(list(argv) + [" ".join(c.words) for c in cmds])
    return r


# What a command line can do before (or around) its launch that makes the launch find
# another interpreter, other packages or other libraries than the image's own
# environment gives: a variable that steers the search set in the line itself
# (``PATH=…``, ``export PYTHONPATH=…``, ``env LD_LIBRARY_PATH=… python3``), a file
# sourced (``source /opt/venv/bin/activate``, ``. /etc/conda.sh``), an environment
# manager's activate or run. The pod's own env is not this (the probe checks with and
# without it); these the probe cannot follow, so what it finds missing in the image's
# own environment may be there for the worker (found by a review helper: "torch is not
# installed", scope image, for a venv image launched with `source …/activate && python`).
# Read anywhere in the line: a change after the launch only costs a verdict not learned.
_STEERING = re.compile(
    r"(?:^|[\s;&|(){}`]|\$\()(?:export[ \t]+|declare[ \t]+-x[ \t]+)?[\"']?"
    r"((?:PATH|PYTHON[A-Z_]*|LD_LIBRARY_PATH|LD_PRELOAD|CUDA_HOME|CUDA_PATH|HOME"
    r"|VIRTUAL_ENV|CONDA_PREFIX|BASH_ENV|ENV|MOONCAKE_[A-Z0-9_]*)\+?=)"
    r"|(?:^|[;&|(){}\n]|&&|\|\|)[ \t]*(?:(?:then|do|else|elif|!|time)[ \t]+)*"
    r"((?:source|\.)[ \t]+[^\s;&|]+)"
    r"|\b((?:conda|mamba|micromamba)\s+(?:activate|run)|"
    r"(?:uv|pixi|poetry|pipenv|hatch|rye|pdm)\s+run)\b"
    # A login or interactive shell reads /etc/profile and ~/.bashrc (where `conda init`
    # puts its activate; Debian's /etc/profile sets PATH): `bash -lc …`, `sh -i`.
    r"|(?:^|\n)(?:\S*/)?((?:ba|z|k|mk|da)?sh\n(?:-[A-Za-z]*[li][A-Za-z]*|--login)\b)")


def steering(argv):
    """The first thing in ``argv`` (a container's command + args) that changes what the
    launch finds (_STEERING), as written and clipped; None when there is none. (Words
    are joined by newlines: each starts a command as far as the pattern is concerned.)"""
    m = _STEERING.search("\n".join(argv))
    return " ".join(next(g for g in m.groups() if g).split())[:80] if m is not None else None


_NAMED = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
# A reference as the lenient reading puts it in: `$NAME`, `${NAME}`, or a whole
# `${NAME:-word}` (`:=`, `:+`, `:?`, with or without the colon). Only `${NAME` was put in,
# and `set -- ${EXTRA_ARGS:-}` read `… mooncake:-}`: the worker admitted unjudged
# (review helper).
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-=+?])([^{}]{0,512}))?\}"
                        r"|\$([A-Za-z_][A-Za-z0-9_]*)")
_SEGMENTS = re.compile(r"[;&|\n()`]+")
_BLANKS = re.compile(r"[\s<>]+")
_BRACES = re.compile(r"(?<!\$)\{([^{},]*(?:,[^{},]*)+)\}")
_QUOTED = re.compile(r"['\"\\]")
_SET = re.compile(r"(?:^|(?<=[\s;&|(){}]))([A-Za-z_][A-Za-z0-9_]*)=([^\s;&|(){}]*)")
UNPLACED = "text no command places, read leniently"


def _unplaced(r, argv, env, shortest, budget):
    """The safe side for the flag where no command read requests it: `eval "$CMD"`, `set
    -- … mooncake; exec … "$@"`, a script fed to a shell on its stdin (`bash <<EOF`,
    `echo … | sh`), brace expansion (`{--elastic-ep-backend,mooncake}`), a decoy line
    saying `none` before any of these, an entrypoint that reads its arguments from an env
    value. Each argv word, with every `$NAME` the env holds put in (one level), and each
    other env value that mentions the flag, is read with its quotes removed, in pieces
    split at `;`, `&`, `|`, newlines, parentheses and backquotes (comments and
    here-document bodies are read too), each piece's words split at blanks and `{a,b}`
    groups expanded. A piece whose last value for a spelling of the flag is `mooncake` is
    a request (UNPLACED: judged by rules and verdicts, never probed or gated, since what
    runs it cannot be told). What the env and the expansions add is charged to the
    reading budget; past it, over budget (the safe side)."""
    named = set()
    texts = []
    try:
        for a in argv:
            texts.append(_REFERENCE.sub(lambda m: _put_in(m, env, named, budget), a)
                         if "$" in a else a)
        extra = [v for k, v in env.items() if k not in named and mentions_flag(v)]
        budget.spend(sum(map(len, extra)))
        texts += extra
        if not any(mentions_flag(t) for t in texts):
            return
        # The second reading below (quotes kept) has a budget of its own, one for all
        # texts, as large as what is left: the text was charged once already.
        again = shell.Budget(budget.left)
        for text in texts:
            plain = shell.unquoted(text)
            pieces = [_last_value(_BLANKS.split(piece), shortest, budget)
                      for piece in _SEGMENTS.split(plain)
                      if mentions_flag(piece)]
            # And each line with its quotes kept, its words as a shell makes them: a
            # quoted 'x --elastic-ep-backend none' after the real flag is one word, not
            # the last value (with the quotes removed it was: found by a review helper).
            # (Only lines with quotes or backslashes read differently.)
            pieces += [_last_value([w for w in shell.words(line, {}, again)
                                    if isinstance(w, str)], shortest, again)
                       for line in text.splitlines()
                       if _QUOTED.search(line) and mentions_flag(line)]
            # A name the text sets to mooncake and to nothing else, where no command placed
            # the flag (`EP=mooncake` in a script written to a file and run:
            # `--elastic-ep-backend $EP` there was no request, and the worker was admitted
            # unwarned: review helper). Where a command did, its value is the reading's.
            moon = (_set_to_mooncake(shell.unquoted(shell.without_comments(text)))
                    if "$" in plain and not r.values else set())
            for value in pieces:
                ref = _NAMED.fullmatch(value or "")
                if ref is not None and ref.group(1) in moon:
                    value = "mooncake"
                if _is_mooncake(value):
                    if value not in r.values:
                        r.values.append(value)
                    r.requested = True
                    r.backend, r.where, r.releases = value, UNPLACED, ("lenient",)
                    return
    except shell.OverBudget:
        _over_budget(r, True)


def _set_to_mooncake(text):
    """The names ``text`` (comments and quotes removed) sets to mooncake, and to nothing
    else (`EP=mooncake; EP=none` is not one; `# B=none` is no value)."""
    values = {}
    for m in _SET.finditer(text):
        values.setdefault(m.group(1), set()).add(m.group(2))
    return {name for name, vs in values.items() if vs == {"mooncake"}}


def _last_value(piece, shortest, budget):
    """The last value one piece of text (its words) gives a spelling of the flag, read
    leniently: an assignment's value taken as a word (`A=--flag`), `{a,b}` groups
    expanded; None when it gives none."""
    words = []
    for w in piece:
        if w[:1].isalpha() and "=" in w:
            w = w.split("=", 1)[1]
        if w:
            words.extend(x for x in _braced(w, budget) if x)
    value = None
    for i, w in enumerate(words):
        if w.startswith("--") and _flag_spelling(w, shortest):
            if "=" in w:
                value = w.split("=", 1)[1]
            elif i + 1 < len(words):
                value = words[i + 1]
    return value


def _put_in(m, env, named, budget):
    """A _REFERENCE replaced as the shell would with the env's value (shell.put_in:
    `${NAME:-word}` is the word where the env lacks NAME or holds it empty); a reference
    to a name the env lacks is kept (the image may hold it), except a default's word."""
    name = m.group(1) or m.group(4)
    if name in env:
        named.add(name)
    elif (m.group(2) or "")[-1:] not in ("-", "="):
        return m.group(0)
    return shell.put_in(m.group(0), env, budget)


def _braced(word, budget):
    """The words bash makes of ``word``'s ``{a,b}`` groups, every one of them, innermost
    and leftmost first (``mooncake{,}{,}`` is four words; only the first group was made:
    found by a review helper); ``[word]`` when it has none. What they add is charged to
    ``budget`` first (a group of 8,000 commas in a 16 KB word would make 61 MiB; groups
    side by side multiply)."""
    done, todo = [], [word]
    while todo:
        w = todo.pop()
        m = _BRACES.search(w) if "{" in w else None
        if m is None:
            done.append(w)
            continue
        head, tail = w[:m.start()], w[m.end():]
        alternatives = m.group(1).split(",")
        budget.spend(len(alternatives) * (len(head) + len(tail)) + sum(map(len, alternatives)))
        todo.extend(head + alt + tail for alt in reversed(alternatives))
    return done


def _over_budget(r, flagged):
    r.over_budget = True
    # Not read, so not known not to change what the launch finds (and the pattern is
    # not run over text this large: the webhook shares this reader).
    r.steered = "a command line too large to read"
    if flagged:  # only a line that mentions the flag is judged on the safe side
        r.requested = True
        r.where = "argv"
        r.backend = WANTED
    r.notes.append(f"the command line is larger than epguard reads ({shell.BUDGET} "
                   "characters of scripts)" + ("; judged as requesting mooncake"
                                               if flagged else ""))


def _read_command(r, cmd, chosen, shortest, read_config, budget):
    launcher, args = server_args(cmd.words)
    in_argv = any(w.startswith("--") and _flag_spelling(w, shortest) for w in args)
    if not in_argv and r.unresolved is None and not r.requested:
        # `--elastic-ep-$(S) mooncake`: a spelling of the flag only once S is known.
        hidden = next((w for w in args if _hidden_spelling(w)), None)
        if hidden is not None:
            r.unresolved = hidden
    where = cmd.where
    if CONFIG in args:
        # SGLang merges the file only for this exact token (prepare_server_args).
        i = args.index(CONFIG)
        path = args[i + 1] if i + 1 < len(args) else None
        r.config_file = path
        settings = None
        if path and not path.lower().endswith((".yaml", ".yml")):
            r.notes.append(f"config {path} is not YAML: SGLang refuses it")
        elif path:
            settings = _config_settings(path, read_config)
            if settings is None:
                r.notes.append(f"config {path} not readable here")
        if settings is not None:
            # The file's settings go before the command line, which then wins.
            front = []
            for key, value in settings:
                truth = value.strip().lower()
                if truth in _YAML_FALSE:
                    continue  # SGLang adds a boolean setting only when it is true
                front += ["--" + key] if truth in _YAML_TRUE else ["--" + key, value]
            if not in_argv and any(_flag_spelling("--" + k, shortest) for k, _ in settings):
                where = "config " + path
            args = front + args[:i] + args[i + 2:]
    else:
        # "--config=FILE" is parsed but never merged by SGLang; still worth a mention.
        given = [w.split("=", 1)[1] for w in args if w.startswith(CONFIG + "=")]
        if given:
            r.config_file = given[-1]
        if not in_argv:
            return
    values = _values(r, args, shortest)
    if not any(_is_mooncake(v) for v in values):
        # argparse can only give the flag a word that follows one of its spellings (or
        # its "=" part): with no "mooncake" among those, no release runs this line with
        # mooncake, so no parser need run (a line saying "none" costs no argparse at all).
        if values and not r.requested:
            r.backend, r.where, r.launcher = values[-1], where, launcher
            later = _set_again(args, shortest)
            if later is not None and r.unresolved is None:
                r.unresolved = f"{values[-1]} (then {later})"
        return
    releases = []
    decided = None
    accepted = 0
    for table in chosen:
        if not budget.parse(len(args)):
            r.notes.append("too many words to parse exactly; read leniently")
            break
        try:
            ns, _unknown = table.parser().parse_known_args(args)
        except _Refused as exc:
            r.refusals.append((table.release, str(exc)))
            continue
        accepted += 1
        value = getattr(ns, table.backend_dest) if table.backend_dest else None
        if _is_mooncake(value):
            releases.append(table.release)
            decided = value
            _dp(r, table, ns)
            break
        if decided is None and value is not None:
            decided = value
    if not accepted:
        # SGLang would not start with this line: read it leniently (the safe side).
        decided = _lenient(args, shortest)
        if _is_mooncake(decided):
            releases.append("lenient")
    if decided is None or (r.requested and not releases):
        return
    r.backend, r.where, r.launcher = decided, where, launcher
    if releases:
        r.requested = True
        r.program = cmd.words[0] if cmd.words else None
        r.releases = tuple(sorted(set(r.releases) | set(releases), key=_version_key))


def _values(r, args, shortest):
    """Every word that could become the flag's value in ``args`` (also noted on ``r``). A
    value still holding an expansion (``$NAME``, ``$(…)``, a backquote) is unresolved:
    known only at launch. (A brace group, ``mooncake{,}``, is the safe side's.)"""
    found = []
    for i, w in enumerate(args):
        if not (w.startswith("--") and _flag_spelling(w, shortest)):
            continue
        value = w.split("=", 1)[1] if "=" in w else (args[i + 1] if i + 1 < len(args) else None)
        if value is not None:
            found.append(value)
            if _unknown(value):
                r.unresolved = value
    r.values.extend(found)
    return found


def _unknown(word):
    """Does ``word`` still hold an expansion the reader could not make (kept as written)?"""
    return "$" in word or "`" in word


def _hidden_spelling(word):
    """``--elastic-ep-$(S)``, ``--el${X}``: a word whose text before its first expansion
    is the start of the flag (``--`` at least), which the expansion may complete."""
    if not word.startswith("--") or not _unknown(word):
        return False
    return BACKEND.startswith(_before_expansion(word).split("=", 1)[0])


def _before_expansion(word):
    """``word``'s text before its first ``$`` or backquote."""
    return re.split(r"[$`]", word, maxsplit=1)[0]


_VALUE_FREE = None


def _value_free():
    """Option names that take no value in any release (``--enable-eplb``): the word after
    one stands on its own."""
    global _VALUE_FREE
    if _VALUE_FREE is None:
        free = set()
        for t in tables():
            free.update(n for nargs, names in t.options if nargs == 0 for n in names)
        _VALUE_FREE = frozenset(free)
    return _VALUE_FREE


def _set_again(args, shortest):
    """After the flag's last spelling and its value, the first word that is an expansion
    the reader could not make and stands as a word of its own (not the value of the
    option before it): at launch it may give the flag again, and argparse takes the last
    (``--elastic-ep-backend none $EXTRA`` with ``EXTRA`` from an envFrom: found by a
    review helper). None when there is none."""
    last = None
    for i, w in enumerate(args):
        if w.startswith("--") and _flag_spelling(w, shortest):
            last = i if "=" in w else i + 1
    if last is None:
        return None
    free = _value_free()
    for i in range(last + 1, len(args)):
        w = args[i]
        if not _unknown(w):
            continue
        if w.startswith("-") and "=" in _before_expansion(w) and not _hidden_spelling(w):
            continue  # `--host=$POD_IP`: that option's value
        before = args[i - 1]
        takes_value = before.startswith("-") and "=" not in before and before not in free
        if not takes_value or i - 1 == last:
            return w
    return None


def _dp(r, table, ns):
    dest = table.dests.get("--enable-dp-attention")
    if dest and getattr(ns, dest):
        r.dp_attention = True
    dest = table.dests.get("--attn-dp-size")
    size = getattr(ns, dest) if dest else None
    try:
        size = int(str(size).strip()) if size is not None else None
    except ValueError:
        size = None
    if size:
        r.attn_dp_size = size
        if size > 1:
            r.dp_attention = True
