"""Does the worker's argv ask for ``--elastic-ep-backend mooncake``?

SGLang parses its arguments with plain argparse, so the flag may be spelled
``--elastic-ep-backend mooncake``, ``--elastic-ep-backend=mooncake`` or any prefix
that is unambiguous among SGLang's options (``--elastic-ep-b mooncake``); the last
occurrence wins; values are compared lower-cased and stripped, as Dynamo does.
Kubernetes manifests often wrap the launch line in ``sh -c "..."``, and SGLang's
``--config file.yaml`` merges YAML keys in front of the command line.
"""

import os
import shlex

BACKEND = "--elastic-ep-backend"
# Every long option of SGLang 0.5.9 .. 0.5.23 that shares a prefix with the backend
# flag: a prefix is only accepted by argparse when it selects exactly one option.
ELASTIC_FLAGS = (
    BACKEND,
    "--elastic-ep-rejoin",
    "--elastic-ep-join-mode",
    "--elastic-ep-initial-size",
    "--elastic-ep-join-rank-offset",
    "--elastic-ep-scale-timeout",
)
DP_ATTENTION = "--enable-dp-attention"
ATTN_DP_SIZE = "--attn-dp-size"
_OTHER_FLAGS = (DP_ATTENTION, "--enable-dp-lm-head", ATTN_DP_SIZE)
_KNOWN = ELASTIC_FLAGS + _OTHER_FLAGS
_SHELLS = ("sh", "bash", "dash", "ash", "zsh", "ksh")


class Request:
    def __init__(self):
        self.backend = None  # last value given, as written
        self.where = None  # "argv", "sh -c script", "config <path>"
        self.dp_attention = False
        self.attn_dp_size = None
        self.notes = []

    @property
    def requested(self):
        return self.backend is not None and self.backend.strip().lower() == "mooncake"

    def describe(self):
        out = "{} {} ({})".format(BACKEND, (self.backend or "").strip(), self.where)
        if self.dp_attention:
            out += "; DP attention on"
            if self.attn_dp_size:
                out += f" ({ATTN_DP_SIZE} {self.attn_dp_size})"
        return out


def resolve_flag(name):
    """The known option argparse would select for ``name``, or None."""
    if name in _KNOWN:
        return name
    if len(name) < 3:
        return None
    hits = [f for f in _KNOWN if f.startswith(name)]
    if len(hits) == 1:
        return hits[0]
    # Ambiguous only among the --elastic-ep-* options: SGLang 0.5.9/0.5.10 had just the
    # backend flag and accept it; later releases refuse to start. Either way, checking
    # is the safe side (and it is what the admission webhook assumes too).
    if hits and BACKEND in hits and all(h in ELASTIC_FLAGS for h in hits):
        return BACKEND
    return None


def _shell_script(argv):
    """The script of ``sh -c SCRIPT`` / ``bash -lc SCRIPT`` argv, or None."""
    if not argv or os.path.basename(argv[0]) not in _SHELLS:
        return None
    i = 1
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("-") and not tok.startswith("--") and "c" in tok[1:]:
            return argv[i + 1] if i + 1 < len(argv) else None
        if tok in ("-o", "+o", "-O", "+O"):  # `bash -o pipefail -c ...`
            i += 2
            continue
        if not tok.startswith(("-", "+")):
            return None
        i += 1
    return None


def _split_script(script):
    # A line continuation inside the script is just whitespace to the shell.
    script = script.replace("\\\r\n", " ").replace("\\\n", " ")
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:
        # Unbalanced quotes: the shell would refuse it too; scan it word by word.
        return script.split()


def tokens(argv, depth=0):
    """argv with every ``sh -c`` script expanded in place; tagged with its origin."""
    out = [(t, "argv" if depth == 0 else "sh -c script") for t in argv]
    script = _shell_script(argv)
    if script is not None and depth < 4:
        words = _split_script(script)
        out.extend((w, "sh -c script") for w in words)
        # A script may run `exec bash -c '...'` in turn: expand that script too.
        for i, w in enumerate(words):
            inner = _shell_script(words[i:]) if os.path.basename(w) in _SHELLS else None
            if inner is not None:
                nested = tokens(words[i:], depth + 1)[len(words) - i:]
                out.extend((t, "sh -c script") for t, _ in nested)
    return out


def parse_simple_yaml(text):
    """Top-level ``key: value`` pairs: all SGLang's --config needs for these flags."""
    out = {}
    for raw in text.splitlines():
        if not raw or raw[0] in " \t#-" or ":" not in raw:
            continue
        key, _, value = raw.partition(":")
        value = value.strip()
        if " #" in value:
            value = value.split(" #", 1)[0].strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip().replace("_", "-")] = value
    return out


def _truthy(value):
    return str(value).strip().lower() in ("true", "yes", "on", "1")


def _apply(req, flag, value, where):
    if flag == BACKEND:
        req.backend, req.where = value, where
    elif flag == DP_ATTENTION:
        req.dp_attention = True if value is None else _truthy(value)
    elif flag == ATTN_DP_SIZE:
        try:
            size = int(str(value).strip())
        except (TypeError, ValueError):
            return
        req.attn_dp_size = size
        if size > 1:
            req.dp_attention = True


def _config_path(toks):
    for i, (tok, _) in enumerate(toks):
        if tok == "--config" and i + 1 < len(toks):
            return toks[i + 1][0]
        if tok.startswith("--config="):
            return tok.split("=", 1)[1]
    return None


def detect(argv):
    req = Request()
    toks = tokens(list(argv))

    # SGLang puts the config file's keys before the command line, so the command
    # line wins; apply the file first.
    path = _config_path(toks)
    if path and path.lower().endswith((".yaml", ".yml")):
        try:
            with open(path) as f:
                cfg = parse_simple_yaml(f.read())
        except OSError:
            req.notes.append(f"config {path} not readable here")
        else:
            for key, value in cfg.items():
                flag = "--" + key
                if flag in _KNOWN:
                    if flag == DP_ATTENTION and not _truthy(value):
                        continue
                    _apply(req, flag, value, "config " + path)

    i = 0
    while i < len(toks):
        tok, where = toks[i]
        i += 1
        if not tok.startswith("--") or tok == "--":
            continue
        name, eq, inline = tok.partition("=")
        flag = resolve_flag(name)
        if flag is None:
            continue
        if flag == DP_ATTENTION:
            _apply(req, flag, None, where)
            continue
        if eq:
            value = inline
        elif i < len(toks):
            value = toks[i][0]
            i += 1
        else:
            continue
        _apply(req, flag, value, where)
    return req
