"""Split a container's command line into the simple commands a shell would run.

Worker manifests hide the launch line inside ``sh -c SCRIPT`` (``bash -o pipefail -c``,
``busybox sh -c``, ``/bin/bash -lc``), behind ``exec``, ``env``, ``nohup``, ``timeout``,
``numactl``, ``taskset`` and variable assignments, in scripts with several commands
(``;``, ``&&``, ``|``, newlines), and sometimes a script runs ``sh -c '…'`` in turn.
This module turns all of that into a flat list of simple commands, each a list of words,
so that the reader (cmdline.py) can hand each one to SGLang's own option table.

It is a reader, not a shell: no globbing, no command substitution, no here-documents.
What matters is that words come out as the shell would make them (quotes, escapes,
``$'…'`` and ``$"…"``, line continuations, ``$NAME`` from the environment, comments):
in particular a quoted piece joins the unquoted text beside it into one word, so
``-''-elastic-ep-backend`` and ``--el"astic"-ep-backend`` are the flag, as the shell
passes it. ``unquoted()`` applies the same quote removal to a whole text without
splitting it, for the cheap "could this mention the flag?" tests. The work is linear
in the input: one regular-expression pass per script, and a budget on the total
number of characters read, nested scripts included. Over budget, the caller is told so
and judges on the safe side instead of reading on.

Standard library only, Python >= 3.8 (the probe runs in images we do not build).
"""

import bisect
import os
import re
from collections import ChainMap
from dataclasses import dataclass
from typing import List

# Total characters of script text one reading may make us read (nested scripts and $NAME
# expansions included); the webhook shares one budget among all containers of a review.
# A real launch script is a few KB (the longest in the public manifests epguard is tested
# on is under 4 KB); 32 KiB is generous, and reading it costs 40-110 ms on one core of
# the 2-core test machine (bench/argv_bench.py, 48 scripts of 30 KB in one review: 37.5
# ms, 26 ms before the token pass that finds where commands start; a review helper
# measured up to 93 ms for 32 KB of `export A=1 A=1 …`, 40 ms before, and 109 ms for
# `f() { :; }` repeated), so a hostile pod costs no more than that however many
# containers it has.
BUDGET = 32 * 1024
MAX_DEPTH = 8

SHELLS = frozenset(("sh", "bash", "dash", "ash", "zsh", "ksh", "mksh"))
# Shell options that take the next word as their argument.
_SHELL_OPTS_WITH_ARG = frozenset(("-o", "+o", "-O", "+O", "--rcfile", "--init-file"))
# Words that start a compound command or stand between commands, never a program.
_KEYWORDS = frozenset(("if", "then", "else", "elif", "fi", "do", "done", "while", "until",
                       "for", "case", "esac", "{", "}", "!", "time", "in"))
# The words that open and close a block where they start a command (foreign).
_OPENERS = frozenset(("if", "case", "for", "while", "until", "select"))
_CLOSERS = frozenset(("fi", "esac", "done"))

_TOKEN_PATTERN = r"""
    (?P<ws>[ \t]+)
  | (?P<nl>\r?\n)
  | (?P<cont>\\\r?\n)
  | (?P<heredoc><<-?[ \t]*BACKSLASH(?P<delim>
        (?:[^\s;&|()<>'"\\`0-9$]|\$?'[^'\n]*'|\$?"(?:[^"\\\n]|\\[^\n])*")
        (?:[^\s;&|()<>'"\\`]|\$?'[^'\n]*'|\$?"(?:[^"\\\n]|\\[^\n])*"|\\[^\n])*))
  | (?P<redir>(?:&>>?|[0-9]*(?:>>|>&|<&|>\||<>|<<<|>|<)(?:&?[0-9]+-?|&-)?))
  | (?P<op>&&|\|\||;;|[;&|()])
  | (?P<ansi>\$'(?P<ansibody>(?:[^'\\]|\\.)*)(?:'|$))
  | (?P<sq>'[^']*(?:'|$))
  | (?P<dq>\$?"(?:[^"\\]|\\.)*(?:"|$))
  | (?P<esc>\\.)
  | (?P<cmdsub>\$\((?:\\.|[^()\\]|\((?:\\.|[^()\\])*\))*\)|`[^`]*`)
  | (?P<pos>\$(?:[@*0-9]|\{[@*0-9]\}))
  | (?P<dollar>\$(?:\{[^}]{0,512}\}|[A-Za-z_][A-Za-z0-9_]*))
  | (?P<lit>[^ \t\r\n;&|()'"\\<>$]+|\$)
"""
_TOKEN = re.compile(_TOKEN_PATTERN.replace("BACKSLASH", ""), re.X | re.S)
# foreign()'s: `<<\EOF` opens a here-document too. words() reads its body as code, where
# a launch line written to a file and run is still read; what it sets is contested.
_SCAN_TOKEN = re.compile(_TOKEN_PATTERN.replace("BACKSLASH", r"\\?"), re.X | re.S)
# Inside $'…' (bash, zsh, ksh, busybox ash; POSIX since 2024): C-like escapes.
_ANSI_ESCAPE = re.compile(
    r"\\(?:([abeEfnrtv\\'\"?])|([0-7]{1,3})|x([0-9A-Fa-f]{1,2})|u([0-9A-Fa-f]{1,4})"
    r"|U([0-9A-Fa-f]{1,8})|c(.))", re.S)
_ANSI_SIMPLE = {"a": "\a", "b": "\b", "e": "\x1b", "E": "\x1b", "f": "\f", "n": "\n",
                "r": "\r", "t": "\t", "v": "\v", "\\": "\\", "'": "'", '"': '"', "?": "?"}
# What quote removal decodes, then drops, in a whole text (see unquoted()).
_ANSI_QUOTED = re.compile(r"\$'((?:[^'\\]|\\.)*)'?", re.S)
_QUOTE_CHARS = str.maketrans("", "", "'\"\\")
# A `${…}` reference as the shell delimits it (references()): quoted text and references
# nested inside it (`${EP:-"mooncake"}`, `${EP:-${DEFAULT_EP:-mooncake}}`, `"${ARGS:-"--tp
# 8 …"}"`), at most REF_CHARS characters long and REF_DEPTH references deep. Cut at its
# first `}` or its inner quotes, such a default was read as text (`"mooncake"`,
# `${DEFAULT_EP:-mooncake`): unresolved, so the worker was probed but never gated. (One
# with no `}` within REF_CHARS is no reference: scanned to the end of the text from each
# `${`, 30 KB of `${a:=` took 113 ms; found by a review helper.)
REF_CHARS = 512
REF_DEPTH = 4
_REF_SPECIAL = re.compile(r"\$\{|\\.|[}\"]", re.S)
# Where a double-quoted text ends: its `${…}` skipped whole (their own quotes inside).
_DQ_SPECIAL = re.compile(r'\\.|"|\$\{', re.S)
# A reference references() did not delimit: up to its first `}` (REF_CHARS at most).
_SHORT_REF = re.compile(r"\$\{[^}]{0,512}\}")  # (as _TOKEN's dollar, REF_CHARS)
# The pieces of a word as the shell makes it (_made): an escape, a reference, a command
# substitution (kept as written), single, ANSI-C and double quotes, plain text.
_WORD_PIECE = re.compile(
    r"(?P<esc>\\.?)|(?P<ref>\$(?:\{|[A-Za-z_][A-Za-z0-9_]*|[@*0-9]))"
    r"|(?P<cmdsub>\$\((?:\\.|[^()\\]|\((?:\\.|[^()\\])*\))*\)|`[^`]*`)"
    r"|(?P<ansi>\$'(?:[^'\\]|\\.)*'?)|(?P<sq>'[^']*'?)|(?P<dq>\")"
    r"|(?P<text>[^\\$`'\"]+|.)", re.S)
_POSITIONAL = re.compile(r"\$\{?([@*0-9])\}?$")
# NAME=value that a script keeps for itself, to learn the variables it sets before it
# uses them (_in_order): a run of assignments (`A=1 B=2`, `export A=1 B=2`) at the start
# of a command in the script's own shell (after `;` or a newline, `export`, `readonly`
# or `declare` before it), with nothing after it on that command. Not in a subshell
# `(…)`, `$(…)`, quotes, a comment or a here-document (foreign), a pipeline or a
# background job (`B=none | cat`, `B=none &`: another process), after `local` (a
# function's own), nor as a prefix of a command (`B=none true` sets B for that command
# only): each was read as lasting, and the last value (`none`) hid a worker asking for
# mooncake (review helpers). Those are _contested. A newline after `;` or a lone `&`
# starts a command in the script's own shell; after `|`, `&&` or `||` it goes on with the
# one before.
_END_OF_COMMAND = re.compile(r"[ \t\r]*(?:[;\n]|&&|\|\||$)|[ \t]+#")  # (# a comment)
_NAME_RE = r"[A-Za-z_][A-Za-z0-9_]*"
# An assigned value's text: in double quotes a `${…}` is one piece, its own quotes inside
# (`ARGS="${ARGS:-"--tp 8 --elastic-ep-backend mooncake"}"` was cut at its first blank); a
# `$` not opening one is plain (the two never overlap: no backtracking between them).
_IN_DQ_BRACES = r"\{(?:[^{}\"]|\"[^\"]*\"){0,512}\}"  # (REF_CHARS)
_RAW = (r"(?:\"(?:[^\"$]|\$" + _IN_DQ_BRACES + r"|\$(?!" + _IN_DQ_BRACES + r"))*\""
        r"|'[^']*'|[^\s;&|()\"'])*")
_RUN_START = re.compile(
    r"(?:^|(?<![;&|]);|(?<!&&)(?<!\|)(?<!\\)(?<!\\\r)\n)[ \t]*"
    r"(?:(?:export|readonly|declare)[ \t]+)?"
    r"(?=" + _NAME_RE + r"\+?=)")
_RUN_ITEM = re.compile(
    r"(?P<name>" + _NAME_RE + r")(?P<append>\+?)=(?P<raw>" + _RAW + ")")
# Between two assignments of one run (an array element's too, which ends the run).
_RUN_GAP = re.compile(r"(?=[ \t]|\\\r?\n)[ \t]*(?:\\\r?\n[ \t]*)*"
                      r"(?=" + _NAME_RE + r"(?:\[[^\]\s;&|(){}]*\])?\+?=)")  # `\⏎` too
# A case pattern: the word before `)` or `|` (`case $R in⏎for) …`), no block's opener.
_PATTERN_END = re.compile(r"[ \t]*[|)]")
# A here-document's delimiter is a word (`<<EOF-X`, `<<'END 1'`, `<<E"O"F`, `<<'1'`), the
# line that closes it that word with its quotes removed (_delimiter). With names only, such
# a body was read as code, and its `B=none` hid the script's mooncake (review helper). Not
# a bare digit or `$` first: `<< 1` in `$(( (RANK << 1) ))` or `(( x<<1 ))` is a shift,
# and a later line `1` (a here-document's body) closed it, hiding the launch between
# (review helper). (`<<N` with a letter stays ambiguous: one with no closing line is no
# body.)
_DELIMITER_PIECE = re.compile(
    r"\$?'([^'\n]*)'|\$?\"((?:[^\"\\\n]|\\[^\n])*)\"|\\([^\n])")
_DQ_DELIMITER_ESCAPE = re.compile(r"\\([\\$`\"])")


def _delimiter(word):
    """The line that closes a here-document opened with ``word``: its quotes removed, and
    in double quotes the backslashes before `\\`, `$`, backquote and `"` (as the shell
    does; `$'…'` and `$"…"` read as plain quotes)."""
    def piece(m):
        if m.group(2) is not None:
            return _DQ_DELIMITER_ESCAPE.sub(r"\1", m.group(2))
        return m.group(1) if m.group(1) is not None else m.group(3)
    return _DELIMITER_PIECE.sub(piece, word)


class _Lines:
    """Where each line that could close a here-document is, by its text: the closing line
    of a here-document from any point is a lookup, not a scan (an unclosed one, searched
    for again from each later opener, made 8,000 `<<a` lines take 24 s: review helper)."""

    def __init__(self, script):
        self.script = script
        self.starts = {}  # (text, tabs stripped) -> line starts, ascending
        pos = 0
        for line in script.split("\n"):
            text = line.rstrip("\r")
            for key in ((text, False), (text.lstrip("\t"), True)):
                if key[0]:
                    self.starts.setdefault(key, []).append(pos)
            pos += len(line) + 1

    def closing(self, delim, strip_tabs, pos):
        """Where the line after the first at or after ``pos`` that closes ``delim`` starts;
        None when none does."""
        starts = self.starts.get((delim, strip_tabs), ())
        i = bisect.bisect_left(starts, pos)
        if i == len(starts):
            return None
        end = self.script.find("\n", starts[i])
        return len(self.script) + 1 if end < 0 else end + 1
# The pieces of a contested name's value, to tell what it names (_unquote; the value an
# assignment stores is made by _made): double-quoted, single-quoted, or bare. (First, a
# `${NAME:-word}` whose word holds quotes, one piece: `ARGS=${ARGS:-"--tp 8
# --elastic-ep-backend mooncake"}` was cut at its inner quotes and read as the literal
# text, its last word `mooncake}`: review helper. A `}` within 512 characters and no `{`
# before it, so that no attempt scans further.)
_VALUE_PIECE = re.compile(
    r"(\$\{(?=[^{}]{0,512}\})[A-Za-z_][A-Za-z0-9_]*:?[-=+?](?:\"[^\"{}]*\"|'[^'{}]*'|[^{}\"'])*\})"
    r"|\"([^\"]*)\"|'([^']*)'|([^\"']+)")
_BRACED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*])(?:(:?[-=+?])(.*))?\}$", re.S)
_REF_NAME = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
# Where a command starts (and the words that may come before its assignments): an
# assignment or a variable-setting command is read only there, not in an argument or a
# comment (`echo B=none`, `# ARGS=…` made names unknown: found by a review helper).
_COMMAND_START = (
    r"(?:^|[;&|(){}\n])[ \t]*"
    r"(?:(?:then|do|else|elif|!|time|eval|env|command|builtin|typeset|declare|local|export"
    r"|readonly)(?:[ \t]+-[A-Za-z]+)*[ \t]+)*")
# Every assignment at a command's start, array elements too: what the in-order model
# (_in_order) may not follow (_contested).
_ANY_ITEM = re.compile(r"(" + _NAME_RE + r")(\[[^\]\s;&|(){}]*\])?(\+?)=")
_ANY_ASSIGNMENT = re.compile(_COMMAND_START + _ANY_ITEM.pattern)
_RAW_VALUE = re.compile(_RAW)
# A declaration command (`export A B=mooncake`, `local -x A B=1`) and its words: a name
# without a value declares it and sets nothing, so it is read as blank space
# (_declarations). Kept as a word, it ended the run, and `B=none; export A B=mooncake`
# read as none: the worker admitted unjudged (left out by the last session's note). A
# name made read-only (`readonly`, `-r`) keeps its value where a later assignment fails
# (bash goes on, dash stops): contested (`B=mooncake; readonly B; B=none` read none).
_DECLARATION = re.compile(
    r"(?:^|[;&|(){}\n])[ \t]*(?:(?:then|do|else|elif|!|time|command|builtin)[ \t]+)*"
    r"(?:(?P<readonly>readonly)|export|declare|typeset|local)"
    r"(?P<flags>(?:[ \t]+(?:-[A-Za-z]+|--))*)(?=[ \t])")
_DECLARED = re.compile(
    r"(?:[ \t]|\\\r?\n)+(?:(?P<bare>" + _NAME_RE + "|'" + _NAME_RE + "'|\"" + _NAME_RE
    + r"\")(?=[ \t\r\n;&|)]|\\\r?\n|$)|"
    r"(?P<name>" + _NAME_RE + r")(?:\[[^\]\s;&|(){}]*\])?\+?=" + _RAW + ")")
_END_OF_OPTIONS = re.compile(r"(?<![^ \t])--(?![^ \t])")
# The commands that set a variable without an assignment.
_WRITER = re.compile(
    _COMMAND_START + r"(?:printf[ \t]+(?:-[^\s;&|(){}]+[ \t]+)*?-v[ \t]*|"
    r"(?:read|mapfile|readarray|unset)(?:[ \t]+-[^\s;&|(){}]+)*[ \t]+|"
    r"getopts[ \t]+[^\s;&|(){}]+[ \t]+|"
    r"(?:for|select)[ \t]+)((?:[A-Za-z_][A-Za-z0-9_]*[ \t]*)+)")
_DEFAULT_ASSIGN = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?=([^{}]*)\}")
_NAME = re.compile(_NAME_RE)
_KNOWN_REF = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
# The flag (cmdline.BACKEND is this), and what a contested name reads as when its values
# name the flag but none asks for mooncake and one is unknown here: the flag, then the
# name itself (kept as written).
FLAG = "--elastic-ep-backend"
FLAG_UNKNOWN = FLAG + " "
_CONTROL = re.compile(r"(?:^|(?<=[\s;&|(]))(?:if|case|while|until|for|select)\s|&&|\|\|")
# A function's definition: it runs where it is called, not where it is defined (`f() { …
# $B; }; B=mooncake; f; B=none` runs mooncake), so it counts as a branch (_contested),
# where the script's own shell reads it (not `gethostname()` in a quoted Python line).
_FUNCTION = re.compile(r"(?:^|(?<=[\s;&|{}]))(?:function[ \t]+" + _NAME_RE + "|" + _NAME_RE
                       + r"[ \t]*\([ \t]*\))")
# IFS set on its own (not as one command's prefix: `IFS=, read -ra H`).
_IFS = re.compile(r"(?:^|[;&|(){}\n])[ \t]*(?:export[ \t]+)?IFS="
                  r"(?:\"[^\"]*\"|'[^']*'|[^\s;&|\"'])*[ \t]*(?:[;&|\n]|$)")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\[[^]]*\])?\+?=")
_COMMENT_LINE = re.compile(r"^[ \t]*#[^\n]*", re.M)


class OverBudget(Exception):
    """The command line is larger than we agree to read."""


# Words of server arguments argparse may read per review (every table counted): argparse
# costs about 0.03 ms a word, so this keeps parsing under about 70 ms; past it, lines are
# read leniently (linear). A real launch line has well under 100 words.
PARSE_WORDS = 2048


class Budget:
    """What one review may still spend, shared by all its containers."""

    def __init__(self, chars: int = BUDGET) -> None:
        self.left = chars
        self.parse_words = PARSE_WORDS
        # ${NAME:-default} for a NAME this reading cannot know: the default was assumed.
        self.guesses = []

    def spend(self, n):
        self.left -= n
        if self.left < 0:
            raise OverBudget()

    def parse(self, n):
        """May argparse read ``n`` more words? (spends them if so)"""
        if n > self.parse_words:
            return False
        self.parse_words -= n
        return True


@dataclass
class Command:
    """One simple command: its words, and where it was found ("argv" or "sh -c script")."""

    words: List[str]
    where: str


_UNSET = object()  # a positional parameter the words after the script do not give


class _Shifting(tuple):
    """``$0 $1 …`` of a script that may change them (`set -- …`, `shift`, a function's
    own): past the words given, a parameter is unknown, not unset (`set -- mooncake;
    … ${1:-none}` launches mooncake, and was read as none: review helper)."""


# What may change a script's positional parameters, at a command's start (after `then`,
# `do`, `eval` too: review helper): `shift`, `eval`, `set` with words after its options
# (_may_shift). Not an argument (`echo env set up`, `find . -name`), nor a sourced file
# (`source /opt/venv/bin/activate` changes none: both made `${1:-…}` unknown, a false
# request one way and a lost one the other: review helper).
_SHIFTERS = re.compile(_COMMAND_START + r"(?:(?:shift|eval)\b|set(?=[ \t]))")
_SET_WORDS = re.compile(r"[^;&|)\n#]*")


def _may_shift(script):
    """May ``script`` change its positional parameters (then ``$1`` past the words given
    is unknown, not unset)? `set -euo pipefail` does not: an option word ending in `o`
    takes the next word (a pattern read `pipefail` as a parameter: review helper)."""
    if _FUNCTION.search(script):
        return True  # a function's own parameters
    for m in _SHIFTERS.finditer(script):  # (each command's words read once: linear)
        if not m.group().endswith("set"):
            return True
        words = _SET_WORDS.match(script, m.end()).group().split()
        i = 0
        while i < len(words):
            word = words[i]
            if word == "--" or word[:1] not in "-+" or len(word) < 2:
                return True
            i += 2 if word.endswith("o") else 1
    return False


def _expand(ref, env, budget, positional=(), depth=0, quoted=False, refs=None, at=0):
    """The value of ``$NAME`` / ``${NAME}`` / ``${NAME:-word}`` / ``$1`` / ``${1:-word}``
    / ``$@``, or None when it cannot be known here (then the text is kept as written).

    A name the environment does not hold is unknown (it may come from the image or an
    envFrom), not unset; its default (``:-``) or alternative (``:+``) is assumed, the
    side on which more of the line is seen, and noted in ``budget.guesses``. A positional
    parameter past the words after the script is unset (``positional`` empty: unknown).
    The word is made as the shell makes it (_made: quotes removed, references put in;
    ``quoted``: the reference is in double quotes, where a single quote or a backslash
    before a letter in its word stays as it is; ``refs``: the references() of a text
    holding ``ref`` at ``at``)."""
    m = _POSITIONAL.match(ref)
    if m is not None:
        which = m.group(1)
        if which in "@*":
            return " ".join(positional[1:]) if positional else None
        n = int(which)
        return positional[n] if n < len(positional) else None
    if not ref.startswith("${"):
        return env.get(ref[1:])
    m = _BRACED.match(ref)
    if m is None or depth > REF_DEPTH:
        return None
    name, op, word = m.group(1), m.group(2), m.group(3)

    def made():  # the word, as the shell makes it (its references found once, in refs)
        return _made(word, env, budget, positional, depth + 1, quoted, None,
                     refs, at + m.start(3) if refs is not None else 0)

    if name[0] in "0123456789@*":
        if not positional or isinstance(positional, _Shifting):
            value = None  # unknown here: a default is assumed, not certain
        elif name in "@*":
            value = " ".join(positional[1:]) if len(positional) > 1 else _UNSET
        else:
            value = positional[int(name)] if int(name) < len(positional) else _UNSET
        if op is not None and op.endswith("="):
            return None  # the shell refuses to assign a positional parameter
    else:
        value = env.get(name)
    if op is None:
        return None if value is _UNSET else value
    if value is None:
        if op.endswith(("-", "=", "+")):
            budget.guesses.append(ref)
            return made()
        return None
    unset = value is _UNSET or (op.startswith(":") and value == "")
    if op.endswith(("-", "=")):
        return made() if unset else value
    if op.endswith("+"):
        return "" if unset else made()
    return None if value is _UNSET else value


def references(text):
    """``{start: end}`` of each ``${…}`` of ``text`` that closes within REF_CHARS
    characters and REF_DEPTH references, as the shell delimits it: inside it a ``}`` in
    double quotes or escaped ends nothing, and a nested ``${…}`` is one piece. One pass
    over the text (the text around a reference is not read: its quotes do not matter
    here). A single quote is no quote here: in a double-quoted `"${MSG:-it's}"` sh takes
    it as a letter, and read as one it swallowed the script up to the next quote, the
    launch line with it (review helper)."""
    ends = {}
    stack = []  # [quoted, start]: a reference (False) or a "…" inside one (True)
    open_refs = 0
    pos = 0
    while True:
        m = _REF_SPECIAL.search(text, pos)
        if m is None:
            return ends
        at, token = m.start(), m.group()
        pos = m.end()
        while stack and at - stack[0][1] > REF_CHARS:
            open_refs -= not stack.pop(0)[0]  # no `}` within REF_CHARS: not a reference
        if token == "${":
            if open_refs >= REF_DEPTH:
                stack, open_refs = [], 0  # too deep: none of them is read
            stack.append((False, at))
            open_refs += 1
        elif not stack or token[0] == "\\":
            continue
        elif stack[-1][0]:  # in "…" inside a reference
            if token == '"':
                stack.pop()
        elif token == "}":
            ends[stack.pop()[1]] = pos
            open_refs -= 1
        else:  # '"'
            stack.append((True, at))


def _dq_end(text, pos, refs, base=0):
    """(where the body of the double-quoted text that starts at ``pos`` ends, whether a
    closing quote ends it): a ``${…}`` in it (``refs``, of a text holding ``text`` at
    ``base``) is one piece, its own quotes inside."""
    while True:
        m = _DQ_SPECIAL.search(text, pos)
        if m is None:
            return len(text), False
        if m.group() == '"':
            return m.start(), True
        end = refs.get(base + m.start()) if m.group() == "${" else None
        pos = m.end() if end is None else end - base


def _made(text, env, budget, positional=(), depth=0, quoted=False, limit=None, refs=None,
          base=0):
    """``text`` as the shell makes one word of it, without splitting it: quotes removed,
    escapes decoded, every reference put in (_expand) and one it cannot know kept as
    written, command substitutions kept as written. ``quoted``: ``text`` is the body of
    a double-quoted string (quotes and escapes inside it as there). ``env`` is a mapping,
    or a function giving the mapping for a reference (env_at). OverBudget
    as soon as the word would pass ``limit`` characters (a line that doubles itself at
    each step is not built). ``refs``: the references() of a text that holds ``text`` at
    ``base`` (a nested word is not scanned again)."""
    if limit is None:
        limit = len(text) + budget.left
    if refs is None:
        refs, base = (references(text) if "${" in text else {}), 0
    out = []
    size = pos = 0
    n = len(text)
    while pos < n:
        m = _WORD_PIECE.match(text, pos)
        kind, piece = m.lastgroup, m.group()
        pos = m.end()
        if quoted and kind in ("sq", "ansi"):
            got, pos = piece[0], m.start() + 1  # no quote inside double quotes
        elif kind == "esc":
            if text.startswith("\r\n", m.start() + 1):
                got, pos = "", pos + 1  # a line continuation
            elif quoted and piece[1:] not in ("\\", '"', "$", "`", "\n"):
                got = piece  # in double quotes only these are escapes
            else:
                got = "" if piece[1:] in ("", "\n") else piece[1:]
        elif kind == "ref":
            start = m.start()
            if piece == "${":
                end = refs.get(base + start)
                if end is not None:
                    end -= base
                else:
                    short = _SHORT_REF.match(text, start)
                    end = short.end() if short is not None else pos
                pos = end
                piece = text[start:end]
            mapping = env(piece) if callable(env) else env
            got = _expand(piece, mapping, budget, positional, depth, quoted, refs, base + start)
            if got is None:
                got = piece
        elif kind == "dq":  # (in double quotes, only inside a reference's word)
            end, closed = _dq_end(text, pos, refs, base)
            got = _made(text[pos:end], env, budget, positional, depth, True, limit - size,
                        refs, base + pos)
            pos = end + closed
        elif kind == "sq":
            got = piece[1:-1] if piece.endswith("'") and len(piece) > 1 else piece[1:]
        elif kind == "ansi":
            body = piece[2:-1] if piece.endswith("'") and len(piece) > 2 else piece[2:]
            got = ansi_c(body)
        else:
            got = piece
        size += len(got)
        if size > limit:
            raise OverBudget()
        out.append(got)
    return "".join(out)


def ansi_c(body):
    """The text of ``$'body'``: its C-like escapes decoded, as bash does; an escape it does
    not know keeps its backslash."""
    def one(m):
        simple, octal, hex_, u4, u8, ctl = m.groups()
        if simple is not None:
            return _ANSI_SIMPLE[simple]
        if octal is not None:
            return chr(int(octal, 8) & 0xFF)
        if hex_ is not None:
            return chr(int(hex_, 16))
        code = u4 or u8
        if code is not None:
            n = int(code, 16)
            return chr(n) if n <= 0x10FFFF and not 0xD800 <= n <= 0xDFFF else ""
        return chr(ord(ctl) & 0x1F)
    return _ANSI_ESCAPE.sub(one, body)


def unquoted(text):
    """``text`` as if the shell's quote removal ran over all of it as one word: ``$'…'``
    decoded, every other ``'``, ``"`` and ``\\`` dropped. So ``-''-elastic-ep-backend``
    (which a shell passes as ``--elastic-ep-backend``) shows the flag to a substring test.
    It over-approximates (a quote inside other quotes is dropped too, words are not
    split), which only errs towards reading a line; linear, and free without quotes."""
    if "'" not in text and '"' not in text and "\\" not in text:
        return text
    if "$'" in text:
        text = _ANSI_QUOTED.sub(lambda m: ansi_c(m.group(1)), text)
    return text.translate(_QUOTE_CHARS)


class Parts:
    """Where a script is not read in order as commands of its own shell (foreign), as
    ascending, non-overlapping (start, end) ranges. ``other``: what never sets the
    script's own variables, or is data: quoted text, `$(…)` and backquotes, whatever is in
    parentheses (subshells, and also `(( … ))`, `A=(…)` and `f()`: an assignment there is
    contested, never lost; one never closed runs to the end), comments, closed
    here-documents' bodies, and a pipeline's command after `|` (also on the next line).
    ``conditional``: the command after `&&` or `||`, which the script's own shell runs
    or not. ``blocks``: `if … fi`, `case … esac`, loops to their `done`, and `{ … }`
    (a function's body among them), where a line of its own may be skipped or run again
    (one never closed runs to the end). ``comments``: the comments alone."""

    def __init__(self, other, conditional, blocks, comments):
        self.other = _merged(other + comments)
        self.conditional = _merged(conditional)
        self.blocks = _merged(blocks)
        self.comments = comments


def _merged(ranges):
    merged = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def foreign(script, lastpipe=False):
    """The Parts of ``script``, tokens as words() makes them (backquotes and parentheses
    inside a word found too, and `<<\\EOF` as an opener). What is set in ``other`` does
    not last in the script's own shell, and what is set in ``conditional`` may not
    (`(⏎B=none⏎)`, `X=$(cat <<E⏎B=none⏎E⏎)`, `sh -c 'B=none'`, `# ;B=none`, `a |⏎B=none`
    were each read as lasting and hid a worker asking for mooncake: review helpers), so
    neither is read in order: contested (_contested reads it on the safe side). A
    tokenizer cannot tell `(( x = 1 <<true ))`, a shift, from a here-document's opener:
    one with no closing line is no body, and words() reads it as code. ``lastpipe``
    (bash's option, on where the script or the environment's BASHOPTS names it): the
    last command of a pipeline runs in the script's own shell, so what comes after `|`
    is ``conditional``, not ``other`` (a step in `a | while …; do ARGS="$ARGS …"; done`
    was dropped: review helper). One pass, linear in the script."""
    other, conditional, blocks, comments = [], [], [], []
    piped = conditional if lastpipe or "lastpipe" in script else other
    opened = []  # where each `(` not yet closed is
    opened_blocks = []  # where each block not yet closed starts
    command = True  # the next word is a command's first
    joining = None  # (where, ranges) of a `|`, `&&` or `||` whose next command is to come
    joined = None  # (where, ranges) of that command, until it ends
    # A joined command that is a block (`a | {⏎B=none⏎}`, `a && while …⏎done`) is
    # conditional to where the block ends, not only foreign to its first line's end (a
    # `B=none` on its later lines was read as lasting): its values contested, its steps
    # taken, since after `|` bash may run it in the script's own shell (lastpipe, which
    # `bash -O lastpipe`, BASH_ENV or a sourced file can set unseen). Its end is never
    # later than the shell's (read too far, it dropped the steps after it: review
    # helpers): a block opens only where a command starts (not an argument `{`, nor a
    # case pattern `for)`), and any `}`, `fi`, `done` or `esac` word closes one (`[[ … ]]
    # }` too; an argument `}` ends it early). One that never closes adds nothing.
    block, depth = None, 0  # where it starts, and how many blocks are open in it
    pipe_end = -1  # just after the last `|` (`|&` is one)
    lines, pending, pos, started = None, [], 0, False
    while pos < len(script):
        m = _SCAN_TOKEN.match(script, pos)
        if m is None:
            pos, started = pos + 1, True
            continue
        pos, kind, text = m.end(), m.lastgroup, m.group()
        if kind == "lit" and text.startswith("#") and not started:
            end = script.find("\n", pos)
            pos = len(script) if end < 0 else end
            comments.append((m.start(), pos))
            continue
        if kind == "op" and text == "&" and m.start() == pipe_end:
            continue  # `|&`: the pipe goes on
        started = kind not in ("ws", "nl", "op", "cont", "heredoc", "redir")
        at_command = command
        if kind == "lit":
            if text == "{" or command and text in _OPENERS:
                opened_blocks.append(m.start())
            elif (text == "}" or command and text in _CLOSERS) and opened_blocks:
                blocks.append((opened_blocks.pop(), pos))
            command = command and text in _KEYWORDS
        elif kind in ("nl", "op"):
            command = True
        elif kind not in ("ws", "cont", "redir", "heredoc"):
            command = False
        if joining is not None and kind not in ("ws", "nl", "cont"):
            if block is None and kind == "lit" and (text == "{" or text in _OPENERS):
                block, depth = joining[0], 0
            joined, joining = joining, None
        if block is not None and kind == "lit":
            if (at_command and (text == "{" or text in _OPENERS)
                    and not _PATTERN_END.match(script, pos)):
                depth += 1
            elif text == "}" or text in _CLOSERS:
                depth -= 1
                if depth <= 0:
                    conditional.append((block, pos))
                    block = None
        if joined is not None and (kind == "nl" or kind == "op" and text != "("):
            joined[1].append((joined[0], m.start()))
            joined = None
        if kind == "op" and text in ("|", "&&", "||"):
            joining = (m.start(), piped if text == "|" else conditional)
            pipe_end = pos if text == "|" else -1
        elif kind in ("sq", "dq", "ansi", "cmdsub"):
            other.append((m.start(), pos))
        elif kind == "lit" and "`" in text:  # `X=`…``: to the closing backquote
            pos = _backquotes(script, m.start(), pos, other)
        elif kind == "op" and text == "(":
            opened.append(m.start())
        elif kind == "op" and text == ")" and opened:
            other.append((opened.pop(), pos))
        elif kind == "heredoc":
            pending.append((_delimiter(m.group("delim")), text.startswith("<<-")))
        elif kind == "nl" and pending:
            lines = lines or _Lines(script)
            end, closed = _heredoc_end(script, pos, pending, lines)
            pending = []
            if closed:
                other.append((pos, end))
                pos = end
    if joined is not None:
        joined[1].append((joined[0], len(script)))
    other.extend((start, len(script)) for start in opened)
    blocks.extend((start, len(script)) for start in opened_blocks)
    return Parts(other, conditional, blocks, comments)


def _backquotes(script, start, end, ranges):
    """Where reading goes on after the backquoted parts of the word ``script[start:end]``
    (each added to ``ranges``): after the word, or after a closing backquote past it.
    Each backquote is looked at once (a word of 30,000 backquotes is not re-read from
    each pair)."""
    at = script.find("`", start, end)
    while at >= 0:
        close = script.find("`", at + 1)
        if close < 0:
            ranges.append((at, len(script)))  # never closed: to the end
            return len(script)
        ranges.append((at, close + 1))
        if close >= end:
            return close + 1
        at = script.find("`", close + 1, end)
    return end


def _outside(ranges):
    """Whether a position is outside every one of ``ranges`` (foreign)."""
    starts = [r[0] for r in ranges]

    def outside(at):
        i = bisect.bisect_right(starts, at) - 1
        return i < 0 or at >= ranges[i][1]

    return outside


def _in_order(text, outside):
    """The assignments of ``text`` that last in the script's own shell, in order: each
    run (_RUN_START) whose assignments end the command; none of a run followed by a
    command word (prefixes of that command), and none whose name ``outside`` says is in
    a foreign part. Linear: a run is read once, from its start."""
    for start in _RUN_START.finditer(text):
        run, pos = [], start.end()
        if not outside(pos):
            continue
        while True:
            item = _RUN_ITEM.match(text, pos)
            if item is None:  # an array element (`A=1 B[0]=2`): not followed
                run = []
                break
            run.append(item)
            pos = item.end()
            gap = _RUN_GAP.match(text, pos)
            if gap is None:
                break
            pos = gap.end()
        if run and _END_OF_COMMAND.match(text, pos):
            for item in run:
                if outside(item.start("name")):
                    yield item


def script_env(script, env, budget):
    """(``env`` plus the plain values a script assigns to itself, ``FLAGS="…"; run
    $FLAGS``, the last assignment's; each name's assignments in order, as ``(positions,
    values)``): one pass, not an interpreter. A use of a name assigned more than once
    takes the value of the last assignment before it (env_at); one before any, the
    last's. An assignment that names its own variable (`ARGS="$ARGS --host $IP"`,
    `ARGS+=" --tp 8"`) builds on the value before it, when that is known: the common way
    to build a launch line step by step (kept as written, the flag set in the first step
    was lost). Such a step is read as taken where the script's own shell may skip it
    (after `then`, `&&`, `||` …, or on a line of its own in a block, foreign()'s:
    `if [ "$ROLE" = decode ]; then ARGS="$ARGS --elastic-ep-backend $EP"; fi` was
    dropped, and the worker admitted unjudged: review helper), the side on which more of
    the line is seen, unless what it adds gives the flag a value known here other than
    mooncake (_another_backend; then it is read as skipped: a `--elastic-ep-backend
    none` added on one side would hide the request of the other). A value still to come
    (`$EP_BACKEND`, or a default assumed for one, `${EP_BACKEND:-none}`) keeps the
    step. A name whose value
    at a use this pass cannot order (_contested) is either left out, so that ``$NAME``
    stays as written (unknown here), or read as one chosen value, to which the steps
    that build on it still add. What the values add is charged to ``budget``; past it,
    OverBudget (the safe side)."""
    parts = foreign(script, "lastpipe" in env.get("BASHOPTS", ""))
    bare, readonly = _declarations(_blanked(script, parts.comments))
    script = _blanked(script, bare)
    lasting = _outside(_merged(parts.other + parts.conditional))
    events = [(m.start("name"), m.group("name"), m.group("append"), m.group("raw"), m.end(),
               False) for m in _in_order(script, lasting)]
    modelled = {e[0] for e in events}
    unknown, chosen, taken = _contested(script, env, parts, modelled, readonly)
    outside_blocks = _outside(parts.blocks)
    local = {k: v for k, v in env.items() if k not in unknown and k not in chosen}
    guessed = set()  # names whose value rests on a default assumed for an unknown one
    for name, raw in chosen.items():  # seen by the assignments in order too
        guesses = len(budget.guesses)
        local[name] = _value_of(raw, local, budget)
        if len(budget.guesses) > guesses:
            guessed.add(name)
    events.extend(taken)
    events.sort()
    steps = {}
    for where, name, append, raw, end, conditional in events:
        if name in unknown:
            continue
        builds = bool(append) or _names_itself(name, raw)
        if name in chosen:
            if not builds:
                continue  # read as its chosen value
            steps.setdefault(name, ([0], [local[name]]))
        before = local.get(name)
        guesses = len(budget.guesses)
        value = _value_of(raw, local, budget)
        added = value if append else value.replace(before, "", 1) if before else value
        guess = len(budget.guesses) > guesses or any(
            n in guessed for n in _REF_NAME.findall(raw) if n != name)
        if builds and (conditional or not outside_blocks(where)) and not guess and (
                _another_backend(added)):  # (`${EP_BACKEND:-none}` is a guess, not known)
            continue  # read as skipped
        if guess:
            guessed.add(name)
        elif not builds:
            guessed.discard(name)
        if append:
            value = (before if before is not None else "$" + name) + value
            budget.spend(len(before or ""))
        local[name] = value
        at, values = steps.setdefault(name, ([], []))
        at.append(end)
        values.append(value)
    for name, raw in chosen.items():
        if name not in steps:
            local[name] = _value_of(raw, local, budget)
    return local, {k: v for k, v in steps.items() if len(v[1]) > 1}


def _own_default(name, raw):
    """The word of the ``${NAME:-word}`` or ``${NAME:=word}`` (colon or not) that ``raw``,
    a value given to NAME, holds, references nested in it (`EP=${EP:-${DEFAULT_EP:-
    mooncake}}`: a pattern with no braces inside never saw that default, and a contested
    EP read as none: review helper); None if it holds none."""
    if "${" not in raw:
        return None
    for start, end in sorted(references(raw).items()):
        m = _BRACED.match(raw, start, end)
        if m is not None and m.group(1) == name and (m.group(2) or "+")[-1] in "-=":
            return m.group(3)
    return None


def _names_itself(name, raw):
    """Does the value ``raw`` given to ``name`` use it (`$EP_DECODE` is not `$EP`)?"""
    return re.search(r"\$\{?" + name + r"(?![A-Za-z0-9_])", raw) is not None


class _Literal(str):
    """A value as it is, not shell text to make (the pod's env value of a contested
    name: made again, 32 KB of quotes took 170 ms: review helper)."""


def _value_of(raw, local, budget):
    """The value an assignment's ``raw`` text stores, as the shell stores it (_made: one
    word, `ARGS=$ARGS" mooncake"` is one value, quotes removed, names the script or the
    environment knows put in now, so a later assignment to them does not change it).
    What it adds is charged to ``budget``; past it, OverBudget."""
    if isinstance(raw, _Literal) or not any(c in raw for c in "$'\"\\"):
        return str(raw)
    value = _made(raw, local, budget)
    if len(value) > len(raw):
        budget.spend(len(value) - len(raw))
    return value


def _contested(script, env, parts, modelled, readonly):
    """(names unknown here, {name: the raw value to read it as}, the steps that build on
    a name where the script's own shell may skip them (or keeps them for one command
    only, `ARGS="$ARGS …" cmd`: read as kept, more of the line seen), as (position,
    name, append, raw, end, True)) for the names whose value at a use one pass cannot
    order (``modelled``: where the names _in_order reads are; ``parts``: foreign()'s).
    Found by review helpers: each was read as the value set before it (`none`), and a
    worker asking for mooncake went unjudged and unwarned.

    A name is contested when it is set at the start of a command the in-order model
    (_in_order) does not follow (after `then`, `do`, `else`, `{`, `&&`, `||`, `typeset
    -x`, `eval` …, or in foreign() parts), unless that only adds to the value
    before it (`then ARGS="$ARGS --host $IP"`: script_env reads it as taken, or as
    skipped); when it is set to two values in a script with branches, loops or a
    function's definition (where the script's own shell reads it), or once made
    read-only (``readonly``: _declarations; a later assignment fails); and by `${EP:=word}`
    where the environment does not hold EP (unknown, unless a value asks for mooncake).
    Of a contested name's values, one that asks for mooncake (names the flag, or is the
    word mooncake) is read everywhere (the side on which more is seen, as for an unknown
    variable's default); of values that are
    all plain text without it, the last is (whichever runs, no request); otherwise it is
    unknown. One set only where it does not last has the environment's value, or is
    unknown. Either way the steps that build on it (`ARGS="$ARGS …"`) still add to it
    (script_env). A default the script gives a contested name in its own step
    (`EP=${EP:-word}`) is one of its values when it asks for mooncake; so are, where
    nothing that always runs (the script's own shell, outside any block and branch) set
    the name before, a default at a use (`${EP:-word}`) and the pod's env value, which
    makes the name contested. Unknown outright: a name set by a command (`printf -v`, `read`,
    `mapfile`, `unset`, `getopts`, `for`, `select`) or as an array element, and every
    name a script assigns once it sets IFS on its own (words split where this reading
    does not). Comments are not read."""
    text = _blanked(script, parts.comments)
    in_shell = _outside(parts.other)
    taken = []
    values = {}  # name -> the raw values it is set to, not from itself
    contested = set()
    unknown = set()
    assigned = set()
    set_in_shell = set()  # names set somewhere the script's own shell keeps them
    defaults = {}  # name -> the words of `NAME=${NAME:-word}` (not values of their own)
    # Where each name is set by what always runs (the script's own shell, no block, no
    # branch, no `&&`/`||`): from there on the environment's value is gone, and, where
    # the value is known not to be empty, a default at a use no longer applies.
    outside_blocks = _outside(parts.blocks)
    unconditional = _outside(_merged(parts.conditional)) if parts.conditional else None
    lasting, valued = {}, {}  # name -> positions
    left = [BUDGET]  # what the environment's values may add to them all, in characters

    def made(word, mapping):
        """``word`` made as the shell makes it, or None past the budget."""
        try:
            out = _made(word, mapping, Budget(max(left[0], 0)))
        except OverBudget:
            return None
        left[0] -= len(out)
        return out

    def always(name, raw, pos):
        if (in_shell(pos) and outside_blocks(pos)
                and (unconditional is None or unconditional(pos))):
            lasting.setdefault(name, []).append(pos)
            value = made(raw, env)
            if value and value.strip() and "$" not in value and "`" not in value:
                valued.setdefault(name, []).append(pos)

    end = 0
    for m in _ANY_ASSIGNMENT.finditer(text):
        if m.start(1) < end:
            continue  # inside the value of the one before (`{V={V=…`): no assignment
        item = m
        while item is not None:  # the run it starts: `A=1 B=mooncake`, `local A= B=`
            name, element, append = item.group(1), item.group(2), item.group(3)
            assigned.add(name)
            raw = _RAW_VALUE.match(text, item.end()).group()
            end = item.end() + len(raw)
            if element:
                unknown.add(name)
            elif not append and not _names_itself(name, raw):
                values.setdefault(name, []).append(raw)
                always(name, raw, item.start(1))
                if item.start(1) not in modelled:
                    contested.add(name)
                if in_shell(item.start(1)):
                    set_in_shell.add(name)
            else:
                always(name, raw, item.start(1))  # (`EP="${EP:-none}"` too)
                own = _own_default(name, raw)
                if own is not None and not env.get(name):
                    # `EP=${EP:-mooncake}`: where the environment does not hold EP, the
                    # word is a value it may have (a contested name set to `none` in a
                    # piped loop was read as none, built on by this step: review helper)
                    defaults.setdefault(name, []).append(own)
                if item.start(1) not in modelled and in_shell(item.start(1)):
                    # a step on the value before it, where the shell may skip it
                    taken.append((item.start(1), name, append, raw, end, True))
            gap = _RUN_GAP.match(text, end)
            item = _ANY_ITEM.match(text, gap.end()) if gap is not None else None
    functions = any(in_shell(f.start()) for f in _FUNCTION.finditer(text))
    if functions or _CONTROL.search(text):
        contested.update(n for n, vs in values.items() if len(set(vs)) > 1)
        # a step's own default beside another value (`EP_ARGS="${EP_ARGS:-"… mooncake"}"`,
        # then `EP_ARGS=""` in a block): two values too
        contested.update(n for n in defaults if n in values)
    contested.update(n for n in readonly if len(set(values.get(n, ()))) > 1)
    defaulted = set()  # `${EP:=word}` where the environment does not hold EP
    for m in _DEFAULT_ASSIGN.finditer(text):
        if not env.get(m.group(1)):
            contested.add(m.group(1))
            defaulted.add(m.group(1))
            values.setdefault(m.group(1), []).append(m.group(2))
            if in_shell(m.start()):
                set_in_shell.add(m.group(1))
    for m in _WRITER.finditer(text):
        unknown.update(_NAME.findall(m.group(1)))
    if _IFS.search(text):
        unknown |= assigned
    # The values the script gives a name once, by what always runs, for the words below
    # (`${EP:-$DEFAULT_EP}` with DEFAULT_EP=mooncake set by the script read none: review
    # helper; one set in a block is no certain value: review helper).
    known = ChainMap({n: _plain(vs[0], env, left) for n, vs in values.items()
                      if len(set(vs)) == 1 and n in valued and n not in contested}, env)

    def asks(word):
        """Does ``word`` (a default's, made as the shell makes it; the pod's env value as
        it is) ask for mooncake?"""
        value = word if isinstance(word, _Literal) else made(word, known)
        if value is None:
            return False
        return value.strip() == "mooncake" or (_names_flag(value) and "mooncake" in value
                                               and not _another_backend(value))

    def before(positions, pos):
        return any(p < pos for p in positions)

    # Where what sets a name may not have run at a use (a branch, a block, a loop, or
    # nothing that always runs before it), the value it has there is a default at that
    # use (`if [ "$ROLE" = prefill ]; then EP=none; fi; … ${EP:-mooncake}`) or the
    # environment's (EP=mooncake in the pod's env): the decode workers launch mooncake,
    # and EP was read as none everywhere (review helpers). Either is one of its values
    # when it asks for mooncake.
    first_use = {}
    for m in _REF_NAME.finditer(text):
        first_use.setdefault(m.group(1), m.start())
    for name in sorted(n for n in assigned - unknown if env.get(n) and n in first_use):
        if not before(lasting.get(name, ()), first_use[name]) and asks(_Literal(env[name])):
            contested.add(name)
            defaults.setdefault(name, []).append(_Literal(env[name]))
    if "${" in text:
        for start, end in references(text).items():
            m = _BRACED.match(text, start, end)
            if (m is not None and m.group(1) in assigned and not env.get(m.group(1))
                    and not before(valued.get(m.group(1), ()), start)
                    and (m.group(2) or "+")[-1] in "-=" and asks(m.group(3))):
                contested.add(m.group(1))
                defaults.setdefault(m.group(1), []).append(m.group(3))
    chosen = {}
    for name in sorted(contested - unknown):  # one answer, whatever the hash seed
        raws = values.get(name, [])
        plain = [_plain(v, env, left) for v in raws]
        names = [_names_flag(p) for p in plain]
        mooncake_asked = [v for v, p, n in zip(raws, plain, names)
                          if p.strip() == "mooncake" or (n and "mooncake" in p)]
        bare = [v for v, p, n in zip(raws, plain, names) if not n and "$" not in p]
        if not mooncake_asked:
            # A default of its own, or at a use, or the environment's value, that asks
            # for it, made as the shell makes it (the flag's last value mooncake:
            # `mooncake --elastic-ep-backend none` asks for none, and was chosen over a
            # value unknown here: review helper).
            mooncake_asked = [word for word in defaults.get(name, ()) if asks(word)]
        if mooncake_asked:
            chosen[name] = mooncake_asked[0]
        elif name in defaulted:
            # The image may hold it (`: ${EP_BACKEND:=none}` keeps the image's value):
            # unknown, as for `${EP_BACKEND:-none}` (read as `none`, unwarned: review
            # helper).
            unknown.add(name)
        elif name not in set_in_shell:
            # Set only where it does not last (`( export B=none )`, `B=none | cat`): the
            # script's own shell has the environment's value, or the image's, unknown
            # here (read as `none`, a worker the old reading warned about was admitted:
            # review helper).
            if name not in env:
                unknown.add(name)
        elif any(n and not _another_backend(p) for p, n in zip(plain, names)):
            # One value names the flag with a value unknown here (`--elastic-ep-backend
            # ${EP_BACKEND}`): unresolved (warned, probed), whatever the others say.
            chosen[name] = "'" + FLAG_UNKNOWN + "'$" + name
        elif any(names) and bare:
            # One value names the flag with another backend, one names nothing: the
            # latter leaves the line's own flag standing (`EXTRA=""` beside `EXTRA=
            # "--elastic-ep-backend none"` after `… mooncake $EXTRA`).
            chosen[name] = bare[0]
        elif any(names):
            # Every value names the flag, none with mooncake, one unknown here: the flag
            # with a value known only at launch (unresolved: warned, probed).
            chosen[name] = "'" + FLAG_UNKNOWN + "'$" + name
        elif any("$" in p or "`" in p for p in plain):
            unknown.add(name)  # a value unknown here
        elif raws:
            chosen[name] = raws[-1]  # plain text naming neither: whichever, no request
    return unknown, chosen, taken


def without_comments(script):
    """``script`` with its comments made spaces: those foreign() finds, and every line
    that starts with `#` (in a here-document's body too, a script written to a file:
    `# EP=none for prefill` there was read as a value: review helper)."""
    if "#" not in script:
        return script
    return _COMMENT_LINE.sub(lambda m: " " * len(m.group()),
                             _blanked(script, foreign(script).comments))


def _declarations(text):
    """(where the names without a value of each declaration command in ``text`` are
    (_DECLARATION), ascending; the names it makes read-only). Made blank, the assignments
    beside those names are one run, as the shell reads them. Linear: a command's words
    are read once (a declaration found inside the words of the one before, in a quoted
    value, is not read again)."""
    spans, readonly, end = [], set(), 0
    for m in _DECLARATION.finditer(text):
        if m.start() < end:
            continue
        end = m.end()
        fixed = m.group("readonly") is not None or "r" in m.group("flags")
        # `--` (the end of the options) is blank too: `export -- A B=…` as `export A B=…`
        flags_at = m.start("flags")
        spans.extend((flags_at + d.start(), flags_at + d.end())
                     for d in _END_OF_OPTIONS.finditer(m.group("flags")))
        while True:
            word = _DECLARED.match(text, end)
            if word is None:
                break
            if word.group("bare") is not None:
                spans.append(word.span("bare"))
            if fixed:
                readonly.add((word.group("bare") or word.group("name")).strip("'\""))
            end = word.end()
    return spans, readonly


def _blanked(script, comments):
    """``script`` with its ``comments`` (foreign) made spaces: a `#` in quotes is none
    (`MSG="phase #1"` blanked to the next line hid the assignments after it: review
    helper)."""
    pieces, pos = [], 0
    for start, end in comments:
        pieces.append(script[pos:start])
        pieces.append(" " * (end - start))
        pos = end
    pieces.append(script[pos:])
    return "".join(pieces)


def _another_backend(text):
    """Does ``text`` give the flag a value known here that is not mooncake? A value still
    to come (`$EP_BACKEND` from the image or an `envFrom`, `$(cat f)`, or the next step's
    word) is not known: reading it as another backend admitted a worker the old reading
    warned about and probed (review helper)."""
    words_ = text.split()
    value = None
    for i, w in enumerate(words_):
        if _spells_flag(w):
            value = w.split("=", 1)[1] if "=" in w else (
                words_[i + 1] if i + 1 < len(words_) else None)
    return bool(value) and value != "mooncake" and "$" not in value and "`" not in value


def _names_flag(text):
    """Does a word of ``text`` spell the flag?"""
    return any(_spells_flag(w) for w in text.split())


def _spells_flag(word):
    """Is ``word`` the flag (``--el…``, a prefix of it, ``=`` or not)?"""
    return word.startswith("--el") and FLAG.startswith(word.split("=", 1)[0])


def _plain(raw, env, left):
    """An assignment's raw text, quotes removed and the environment's values put in while
    ``left[0]`` characters last (a 1 MB value named a thousand times is not built); past
    that the names stay as written (the value is then unknown here)."""
    text = _unquote(raw)
    if "$" not in text:
        return text
    out, pos = [], 0
    for m in _KNOWN_REF.finditer(text):
        value = env.get(m.group(1))
        if value is None or len(value) > left[0]:
            continue
        left[0] -= len(value)
        out.append(text[pos:m.start()])
        out.append(value)
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


def _unquote(raw):
    """An assignment's raw text with its quotes removed (nothing put in)."""
    return "".join(piece.group(1).translate(_QUOTE_CHARS) if piece.group(1) is not None
                   else next(x for x in piece.groups() if x is not None)
                   for piece in _VALUE_PIECE.finditer(raw))


def env_at(env, steps, ref, pos):
    """The mapping to expand ``ref`` (``$NAME``, ``${NAME…}``) with at ``pos`` of a
    script: for a name assigned more than once (``steps``, from script_env), the value
    of its last assignment before ``pos``, or, before any, its last (`B=mooncake; run $B
    &; B=none; run $B` runs mooncake first: the last value alone read none for both);
    ``env`` itself for any other name."""
    if not steps:
        return env
    # Every name such a reference holds (its own, and those in a default's word: `${EP:-$B}`
    # took B's last value, not the one at its place: review helper).
    at_pos = {}
    for name in _REF_NAME.findall(ref):
        seq = steps.get(name)
        if seq is not None:
            at, values = seq
            i = bisect.bisect_left(at, pos)
            at_pos[name] = values[i - 1] if i else values[-1]
    return ChainMap(at_pos, env) if at_pos else env


def words(script, env, budget, positional=(), steps=None):
    """The words and operators of ``script``: a list of str, with operators as the
    one-element tuples ``(";",)``, ``("&&",)``, … so that a quoted ";" stays a word.
    ``positional`` is ``$0 $1 …`` (the words after ``sh -c SCRIPT``); ``steps`` the
    script's names assigned more than once (script_env), expanded where they are used."""
    budget.spend(len(script))
    heredocs = []  # (delimiter, strip leading tabs) waiting for the end of the line
    lines = None  # _Lines of the script, made at its first here-document
    out = []
    cur = []  # pieces of the word being built
    started = False  # a quoted empty string still makes a word
    pos = 0
    n = len(script)
    skip_next_word = False
    refs = references(script) if "${" in script else {}

    def flush():
        nonlocal cur, started, skip_next_word
        if started:
            word = "".join(cur)
            if skip_next_word:
                skip_next_word = False
            else:
                out.append(word)
        cur = []
        started = False

    def _splice(parts, space_before=True, space_after=True):
        # An unquoted expansion (or "$@"): its words join the line as separate words.
        nonlocal cur, started
        if not parts:
            return
        if space_before:
            flush()
        for i, part in enumerate(parts):
            if i:
                flush()
            cur.append(part)
            started = True
        if space_after:
            flush()

    while pos < n:
        at = pos
        if pos in refs:  # a `${…}` with quotes or references inside: one piece
            kind, text, pos = "dollar", script[pos:refs[pos]], refs[pos]
        else:
            m = _TOKEN.match(script, pos)
            if m is None:  # a lone `\` at the end: kept as it is
                cur.append(script[pos])
                started = True
                pos += 1
                continue
            kind, text, pos = m.lastgroup, m.group(), m.end()
        if kind == "ws":
            flush()
        elif kind == "cont":
            continue
        elif kind == "nl" or kind == "op":
            flush()
            out.append((";" if kind == "nl" else text,))
            if kind == "nl" and heredocs:
                lines = lines or _Lines(script)
                pos = _heredoc_end(script, pos, heredocs, lines)[0]
                heredocs = []
        elif kind == "heredoc":
            flush()
            heredocs.append((_delimiter(m.group("delim")), text.startswith("<<-")))
        elif kind == "redir":
            if started and "".join(cur).isdigit():
                cur, started = [], False  # the "2" of "2>&1" is a file descriptor
            flush()
            # "2>&1" names its target; "> file" takes the next word, which is not an argument.
            if not re.search(r"[&0-9-]$", text) or text.endswith((">", "<")):
                skip_next_word = True
        elif kind == "sq":
            cur.append(text[1:-1] if text.endswith("'") and len(text) > 1 else text[1:])
            started = True
        elif kind == "ansi":
            cur.append(ansi_c(m.group("ansibody")))
            started = True
        elif kind == "dq":
            # ($"…" is bash's translated "…"; a `${…}` inside is one piece, quotes and all.)
            start = at + (2 if text.startswith("$") else 1)
            end, closed = _dq_end(script, start, refs)
            pos = end + closed
            body = script[start:end]
            if body in ("$@", "${@}") and positional:
                _splice(positional[1:])  # "$@": each argument its own word
                continue
            if "$" in body or "\\" in body:
                made = _made(body, lambda ref, at=at: env_at(env, steps, ref, at), budget,
                             positional, quoted=True, refs=refs, base=start)
                budget.spend(max(0, len(made) - len(body)))
                body = made
            cur.append(body)
            started = True
        elif kind == "cmdsub":
            cur.append(text)  # $(…) and `…` run at launch time: kept as written
            started = True
        elif kind == "esc":
            cur.append(text[1])
            started = True
        elif kind == "dollar" or kind == "pos":
            value = _expand(text, env_at(env, steps, text, at), budget, positional,
                            refs=refs, at=at)
            if value is None:
                cur.append(text)  # unknown here: kept as written, so it is visible
                started = True
                continue
            budget.spend(len(value))
            _splice(value.split(), value[:1].isspace(), value[-1:].isspace())
        elif kind == "lit":
            if text.startswith("#") and not started:
                end = script.find("\n", pos)
                pos = n if end < 0 else end
                continue
            cur.append(text)
            started = True
    flush()
    return out


def _heredoc_end(script, pos, heredocs, lines):
    """(where the bodies of the here-documents opened on the line that just ended end,
    whether each was closed; ``lines``: the script's _Lines). Not closed: ``pos`` itself,
    so the lines after are read as code (the safe side: `(( x = 1 <<EOF ))` is a shift in
    bash, and the rest of its script went unread: review helper)."""
    start = pos
    for delim, strip_tabs in heredocs:
        pos = lines.closing(delim, strip_tabs, pos)
        if pos is None:
            return start, False
    return pos, True


def put_in(ref, env, budget, positional=()):
    """``ref`` (``$NAME``, ``${NAME:-word}`` …) replaced by its value (_expand), charged
    to ``budget``; kept as written where its value cannot be known here."""
    value = _expand(ref, env, budget, positional)
    if value is None:
        return ref
    budget.spend(len(value))
    return value


def _split_commands(items):
    """Simple commands (lists of words) from a list of words and operator tuples."""
    commands = []
    cur = []
    for item in items:
        if isinstance(item, tuple):
            if cur:
                commands.append(cur)
            cur = []
        elif not cur and item in _KEYWORDS:
            continue
        else:
            cur.append(item)
    if cur:
        commands.append(cur)
    return commands


def shell_script(words_):
    """If ``words_`` runs a shell with ``-c``, the index of its SCRIPT word, else None."""
    if not words_:
        return None
    i = 0
    base = os.path.basename(words_[0])
    if base == "busybox":
        i = 1
        if i >= len(words_) or os.path.basename(words_[i]) not in SHELLS:
            return None
        base = os.path.basename(words_[i])
    if base in ("su", "runuser"):
        # su [options] [user] -c COMMAND: the option may come anywhere.
        for j in range(1, len(words_) - 1):
            if words_[j] in ("-c", "--command"):
                return j + 1
        return None
    if base not in SHELLS:
        return None
    i += 1
    has_c = False
    while i < len(words_):
        w = words_[i]
        if w in _SHELL_OPTS_WITH_ARG:
            i += 2
            continue
        if w == "--":
            i += 1
            break
        if w.startswith("--") or (w[:1] in "-+" and len(w) > 1):
            # clustered short options: -c, -ec, -lc, -euxc, +x
            if not w.startswith("--") and "c" in w[1:]:
                has_c = True
            i += 1
            continue
        break
    if has_c and i < len(words_):
        return i
    return None


def commands(argv, env=None, budget=None):
    """Every simple command in ``argv``, with shell scripts (nested too) opened up.

    ``env`` gives the values of ``$NAME`` references in scripts (unknown names stay as
    written). Raises OverBudget when the scripts are larger than the budget.
    """
    budget = budget if budget is not None else Budget()
    env = env or {}
    out = []
    _collect(list(argv), "argv", env, budget, 0, out)
    return out


def _collect(words_, where, env, budget, depth, out):
    if depth >= MAX_DEPTH:
        raise OverBudget()
    raw = words_
    if depth == 0 and sum(map(len, raw)) > budget.left:
        # Over budget whatever unwrap would skip (the words below are charged either way,
        # a script word when it is read): not walked word by word.
        raise OverBudget()
    words_ = unwrap(words_)
    if len(words_) > 1 and words_[0] == "eval":
        # eval joins its words and runs them as a script: read them as one (a second
        # round of expansion, as the shell makes it), not as the arguments of a program.
        if depth == 0:  # the words before it too (wrappers unwrap skipped)
            budget.spend(sum(map(len, raw[: len(raw) - len(words_) + 1])))
        script = " ".join(words_[1:])
        if len(script) > budget.left:
            raise OverBudget()
        local, steps = script_env(script, env, budget)
        for cmd in _split_commands(words(script, local, budget, steps=steps)):
            _collect(cmd, "sh -c script", local, budget, depth + 1, out)
        return
    at = shell_script(words_)
    if depth == 0:
        # The argv counts too, the wrappers unwrap skipped included (a script word is
        # counted when it is read): a container of a million words is not read word by
        # word.
        script_at = -1 if at is None else at + len(raw) - len(words_)
        budget.spend(sum(len(w) for i, w in enumerate(raw) if i != script_at))
    if at is None:
        out.append(Command(words_, where))
        if words_ and os.path.basename(words_[0]) in REMOTE_LAUNCHERS:
            return  # what it runs, it runs elsewhere
        # A program we do not know may run the rest of its argv (gosu, su-exec, sudo,
        # chroot, uv run, mpirun, …): the first shell -c or launcher behind it is read
        # too. Only a few candidates are tried, so a line of a thousand "su" stays cheap.
        tried = 0
        for i in range(1, len(words_)):
            if os.path.basename(words_[i]) in REMOTE_LAUNCHERS:
                break  # `gosu u kubectl exec p -- python3 …`: what follows runs elsewhere
            if not _could_start(words_[i]):
                continue
            tried += 1
            if tried > 8:
                break
            if _starts_command(words_[i:]):
                _collect(words_[i:], where, env, budget, depth + 1, out)
                break
        return
    script = words_[at]
    if len(script) > budget.left:
        raise OverBudget()  # before any pass over it
    local, steps = script_env(script, env, budget)
    # $0 $1 … of the script; with no words after it, $0 is the shell and "$@" is empty.
    positional = tuple(words_[at + 1:]) or (os.path.basename(words_[0]),)
    if _may_shift(script):
        positional = _Shifting(positional)
    for cmd in _split_commands(words(script, local, budget, positional, steps)):
        _collect(cmd, "sh -c script", local, budget, depth + 1, out)


# Programs that run the words after them in another pod, host or container: the SGLang
# they start is not this image's, so none of their words is this container's launch line
# (`kubectl exec sglang-0 -- python3 -m sglang.launch_server ...` in a kubectl image was
# read as a worker, and the probe injected into an image with no python3).
REMOTE_LAUNCHERS = frozenset(("kubectl", "oc", "ssh", "docker", "podman", "nerdctl", "crictl"))
_LAUNCH = re.compile(r"python(?:[0-9](?:\.[0-9]+)?)?|sglang")
_STARTERS = SHELLS | {"busybox", "su", "runuser"}


def _could_start(word):
    base = os.path.basename(word)
    return base in _STARTERS or _LAUNCH.fullmatch(base) is not None


def _starts_command(w):
    """Does ``w`` start with a shell -c or an interpreter/SGLang launcher?"""
    return shell_script(w) is not None or _LAUNCH.fullmatch(os.path.basename(w[0])) is not None


# --- wrappers: programs that run the rest of their argv as a command -------------------

def _after_env(w, at):
    i = at + 1
    while i < len(w):
        t = w[i]
        if t in ("-u", "--unset", "-C", "--chdir", "-S", "--split-string"):
            i += 2
        elif t == "--":
            return i + 1
        elif t.startswith("-") or _ASSIGNMENT.match(t):
            i += 1
        else:
            break
    return i


def _after_options(w, at, with_arg, positional=0):
    """Skip the options of the program at ``at`` (``with_arg`` ones take the next
    word), then ``positional`` words: where its command starts."""
    i = at + 1
    while i < len(w):
        t = w[i]
        if t == "--":
            i += 1
            break
        if t in with_arg:
            i += 2
        elif t.startswith("-") and len(t) > 1:
            i += 1
        else:
            break
    return i + positional


_WRAPPERS = {
    "exec": lambda w, at: _after_options(w, at, ("-a",)),
    "command": lambda w, at: _after_options(w, at, ()),
    "nohup": lambda w, at: at + 1,
    "setsid": lambda w, at: _after_options(w, at, ()),
    "env": _after_env,
    "timeout": lambda w, at: _after_options(
        w, at, ("-s", "--signal", "-k", "--kill-after"), 1),
    "nice": lambda w, at: _after_options(w, at, ("-n", "--adjustment")),
    "ionice": lambda w, at: _after_options(
        w, at, ("-c", "-n", "-p", "--class", "--classdata")),
    "stdbuf": lambda w, at: _after_options(
        w, at, ("-i", "-o", "-e", "--input", "--output", "--error")),
    "numactl": lambda w, at: _after_options(
        w, at, ("-C", "-N", "-m", "-i", "-p", "-P", "--physcpubind", "--cpunodebind",
                "--membind", "--interleave", "--preferred", "--weighted-interleave")),
    "tini": lambda w, at: _after_options(w, at, ("-e", "-p")),
    "dumb-init": lambda w, at: _after_options(w, at, ()),
}


def unwrap(w):
    """``w`` without variable assignments and wrapper programs in front of the command.

    One pass over the words by index, one copy at the end: a line of a hundred thousand
    ``A=1`` or ``nohup`` words costs what its length does (a copy a word made it
    quadratic: 0.9 s for 40,000 words, minutes for a pod the API server still sends)."""
    at = 0
    while at < len(w):
        if _ASSIGNMENT.match(w[at]):
            at += 1
            continue
        base = os.path.basename(w[at])
        if base == "taskset":
            at = _after_taskset_words(w, at)
        elif base in _WRAPPERS:
            at = _WRAPPERS[base](w, at)
        else:
            break
    return w[at:] if at else w


def _after_taskset_words(w, at):
    # `taskset [-a] MASK cmd`, `taskset -c LIST cmd`: options, then one word (the mask or
    # the list), then the command.
    i = at + 1
    while i < len(w) and w[i].startswith("-") and w[i] != "--":
        i += 1
    if i < len(w) and w[i] == "--":
        i += 1
    return i + 1
