"""The admin's rules: which images cannot serve mooncake elastic EP, and what to say.

A rules file is YAML of exactly this shape::

    rules:
      - id: sglang-0523-no-prebuilt-pg        # unique
        image: "docker.io/lmsysorg/sglang:v0.5.23*"  # glob on the normalized name:tag
        digest: "sha256:..."                  # optional: match the pinned digest instead
        reason: "..."                         # what goes wrong, one sentence
        remedy: "..."                         # what to do instead
        action: deny                          # deny (default) | warn
        evidence: "..."                       # optional: where the claim comes from

Loading is all-or-nothing: one bad entry rejects the whole file with a message
naming the entry, so a live edit with a typo never half-applies.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from epguard.webhook.engine.imageref import ImageRef, normalize_pattern

Action = Literal["deny", "warn"]
_DIGEST = re.compile(r"^[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}$")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,126}$")


class RulesError(ValueError):
    """A rules document that must not be applied; the message says where and why."""


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)

    id: str
    image: str | None = None
    digest: str | None = None
    reason: str = Field(min_length=1)
    remedy: str = Field(min_length=1)
    action: Action = "deny"
    evidence: str | None = None

    @field_validator("id")
    @classmethod
    def _id_shape(cls, v: str) -> str:
        if not _ID.match(v):
            raise ValueError("must be 1-127 characters of letters, digits, '.', '_' or '-'")
        return v

    @field_validator("image")
    @classmethod
    def _image_glob(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if not v:
            raise ValueError("must not be empty (leave it out to match by digest only)")
        return normalize_pattern(v)

    @field_validator("digest")
    @classmethod
    def _digest_shape(cls, v: str | None) -> str | None:
        if v is not None and not _DIGEST.match(v):
            raise ValueError("must look like 'sha256:<hex>'")
        return v.lower() if v else v

    @model_validator(mode="after")
    def _needs_a_selector(self) -> Rule:
        if self.image is None and self.digest is None:
            raise ValueError("a rule needs 'image' (a glob) or 'digest'")
        return self

    def matches(self, ref: ImageRef) -> bool:
        if self.digest is not None:
            # The digest decides ("matches the pinned digest instead"); an image glob
            # given beside it only has to name the repository, since the commonest
            # pinned form, name@sha256:…, carries no tag.
            if (ref.digest or "").lower() != self.digest:
                return False
            return (
                self.image is None
                or fnmatch.fnmatchcase(ref.name_tag, self.image)
                or fnmatch.fnmatchcase(ref.name, _repository_glob(self.image))
            )
        return self.image is None or fnmatch.fnmatchcase(ref.name_tag, self.image)


def _repository_glob(pattern: str) -> str:
    """``r.io:5000/x:v1*`` → ``r.io:5000/x``: the glob without its tag part, if it has one
    (a colon after the last slash; an earlier one is a registry port)."""
    head, sep, tail = pattern.rpartition(":")
    return head if sep and "/" not in tail else pattern


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...] = ()
    source: str = "<none>"
    # Memo of ref → matching rules; a RuleSet is immutable, so it never goes stale.
    _memo: dict[ImageRef, tuple[Rule, ...]] = field(default_factory=dict, repr=False, compare=False)

    def match(self, ref: ImageRef) -> tuple[Rule, ...]:
        hit = self._memo.get(ref)
        if hit is None:
            hit = tuple(r for r in self.rules if r.matches(ref))
            if len(self._memo) > 4096:
                self._memo.clear()
            self._memo[ref] = hit
        return hit

    def __len__(self) -> int:
        return len(self.rules)


def _describe(index: int, raw: Any) -> str:
    rid = raw.get("id") if isinstance(raw, dict) else None
    return f"rules[{index}]" + (f" (id {rid!r})" if isinstance(rid, str) else "")


def parse_rules(data: Any, source: str) -> RuleSet:
    if data is None:
        return RuleSet((), source)
    if not isinstance(data, dict):
        raise RulesError(f"{source}: the top level must be a mapping with a 'rules' list")
    unknown = sorted(str(k) for k in data if k != "rules")
    if unknown:
        raise RulesError(f"{source}: unknown top-level key(s) {unknown}; only 'rules' is allowed")
    raw_rules = data.get("rules")
    if raw_rules is None:
        return RuleSet((), source)
    if not isinstance(raw_rules, list):
        raise RulesError(f"{source}: 'rules' must be a list")
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(raw_rules):
        if not isinstance(raw, dict):
            raise RulesError(f"{source}: rules[{index}] must be a mapping")
        try:
            rule = Rule.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'rule'}: {e['msg']}" for e in exc.errors()
            )
            raise RulesError(f"{source}: {_describe(index, raw)}: {problems}") from None
        if rule.id in seen:
            raise RulesError(
                f"{source}: duplicate rule id {rule.id!r} "
                f"at rules[{seen[rule.id]}] and rules[{index}]"
            )
        seen[rule.id] = index
        rules.append(rule)
    return RuleSet(tuple(rules), source)


# libyaml's parser with the safe constructor: the subset yaml.safe_load reads, ~14x
# faster (a 0.8 MB file of 3,000 rules: 0.31 s against 4.3 s).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# A rules file of 3,000 rules is ~36,000 YAML events (scalars, mappings, sequences); the
# limit leaves room for ~8,000. Dense YAML is ~1 node per 2 bytes, and each node costs
# ~340 bytes once built: 600 KB of "[a,a,a,...]" took 23 s and 188 MB to load, so a rules
# review anyone can post would have taken a webhook past its 256 Mi. Counted first, on
# the parser's events alone (nothing is built: 0.2 s for 300,000), each alias as what it
# repeats (one event, but a copy each use once the rules are built: 40 rules naming one
# 200 KB anchor twice held 16 MB), so scalars are bounded too: 4 MiB, four times what a
# ConfigMap holds.
MAX_YAML_EVENTS = 100_000
MAX_YAML_CHARS = 4 * 1024 * 1024


def _count(text: str, source: str) -> None:
    """Refuse ``text`` before it is built when its events, or the characters of its
    scalars, aliases expanded, pass the limits."""
    events = chars = 0
    sizes: dict[str, tuple[int, int]] = {}  # anchor -> (events, chars) it stands for
    opened: list[tuple[str | None, int, int]] = []
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.AliasEvent):
            more, longer = sizes.get(str(event.anchor), (1, 0))
            events, chars = events + more, chars + longer
        else:
            events += 1
            if isinstance(event, yaml.ScalarEvent):
                chars += len(event.value)
                if event.anchor:
                    sizes[event.anchor] = (1, len(event.value))
            elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                opened.append((event.anchor, events - 1, chars))
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)) and opened:
                anchor, at_events, at_chars = opened.pop()
                if anchor:
                    sizes[anchor] = (events - at_events, chars - at_chars)
        if events > MAX_YAML_EVENTS or chars > MAX_YAML_CHARS:
            raise RulesError(
                f"{source}: more than {MAX_YAML_EVENTS:,} YAML events or {MAX_YAML_CHARS:,} "
                "characters of values, each alias counted as what it repeats (a file of "
                "8,000 rules has about 100,000 events); epguard reads no larger rules file"
            )


def load_rules_text(text: str, source: str) -> RuleSet:
    try:
        _count(text, source)
        data = yaml.load(text, Loader=_LOADER)  # the safe constructor (_LOADER)
    except yaml.YAMLError as exc:
        raise RulesError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:  # the pure-Python loader, where libyaml is missing
        raise RulesError(f"{source}: YAML nested too deep") from None
    return parse_rules(data, source)


def load_rules_file(path: str) -> RuleSet:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise RulesError(f"{path}: cannot read rules file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise RulesError(f"{path}: rules file is not UTF-8 text") from None
    return load_rules_text(text, path)


def default_rules_path() -> str:
    from importlib.resources import files

    return str(files("epguard.webhook") / "data" / "default-rules.yaml")


_TAG_GLOB = re.compile(r"^[A-Za-z0-9_.\-*?\[\]!]*$")


def unmatchable(pattern: str) -> str | None:
    """Why an image glob can never match a normalized ``name:tag``, or None.

    Such a rule loads (the file is valid YAML of the right shape) but refuses nothing,
    which an admin would only notice on the day the image it meant got through."""
    if any(ch.isspace() for ch in pattern):
        return "it contains whitespace, which no image reference does"
    if "@" in pattern:
        return "it names a digest; the glob is matched against name:tag (use 'digest:')"
    head, sep, tail = pattern.rpartition(":")
    repository, tag = (head, tail) if sep and "/" not in tail else (pattern, "")
    if any(":" in part for part in repository.split("/")[1:]):
        return "a ':' belongs after the registry host or before the tag, nowhere else"
    if repository != repository.lower():
        return "repository names are lowercase, so an upper-case letter never matches"
    if tag and not _TAG_GLOB.match(tag):
        return "a tag holds only letters, digits, '_', '.' and '-'"
    if len(tag.replace("*", "")) > 128:
        return "a tag is at most 128 characters"
    return None


def rule_warnings(rules: RuleSet) -> list[str]:
    """What an admin should hear about rules that load: none at all, or globs that can
    never match. One line each."""
    if not len(rules):
        return [f"{rules.source} holds no rules: no image is refused by rule"]
    out = []
    for r in rules.rules:
        why = unmatchable(r.image) if r.image is not None else None
        if why:
            out.append(
                f"{rules.source}: rule {r.id!r}: image glob {r.image!r} can never match: {why}"
            )
        elif r.image is not None and r.digest is None and _tagless(r.image):
            out.append(
                f"{rules.source}: rule {r.id!r}: image glob {r.image!r} names no tag, so it "
                "matches only images pinned by digest without a tag (a pod's image without "
                f"a tag is {r.image}:latest); write {r.image + ':*'!r} for every tag"
            )
    return out


def _tagless(glob: str) -> bool:
    """No tag and no wildcard in the glob's last segment (``lmsysorg/sglang``)."""
    last = glob.rpartition("/")[2]
    return not any(ch in last for ch in ":*?[")


class RulesHolder:
    """The rules in force: the live ConfigMap's when there is one, else the file's.

    Each layer only ever changes to a set that loaded completely, so a bad edit
    leaves the last good rules in force (the caller logs and counts the error).
    Replacing a reference is atomic, so admissions never see a half-built set.
    """

    def __init__(self, file_rules: RuleSet) -> None:
        self._file = file_rules
        self._live: RuleSet | None = None
        self.current: RuleSet = file_rules

    @property
    def file_rules(self) -> RuleSet:
        return self._file

    @property
    def live_rules(self) -> RuleSet | None:
        return self._live

    def _refresh(self) -> None:
        self.current = self._live if self._live is not None else self._file

    def set_file(self, rules: RuleSet) -> None:
        self._file = rules
        self._refresh()

    def set_live(self, rules: RuleSet | None) -> None:
        """None means the ConfigMap (or its key) is gone: fall back to the file."""
        self._live = rules
        self._refresh()
