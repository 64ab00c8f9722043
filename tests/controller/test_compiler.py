"""The outage backstop's compiler (webhook/controller/compiler.py), without a cluster.

The policy's own CEL is evaluated by cel-python against the parameters the compiler
writes, for sample pods: a denied digest, a denied tag in each of its spellings, an
admitted pod, the last entry of the last shard at 100,000 verdicts, a name read from the
reason table. The Kubernetes CEL library functions the policy uses and cel-python lacks
(``split``, ``substring``, ``lastIndexOf``, ``lowerAscii``, ``replace``, ``join``,
``flatten``) are given here with the Kubernetes semantics (k8s.io/apiserver/pkg/cel/
library and cel-go's strings extension: code-point indexes, every occurrence replaced).
The same pods go through the webhook's engine, which must refuse them for the same id.
tests/e2e/test_backstop*.py run the same policy in a real kube-apiserver.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections.abc import Callable
from typing import Any

import celpy
import pytest
from celpy import celtypes

from epguard.webhook.controller.compiler import (
    DIGEST_KEY,
    MAX_SHARDS,
    NAME_SLOT,
    SHARD_BYTES,
    BackstopConfig,
    EntryIndex,
    Params,
    _kind_containers,
    compile_params,
    inline,
    policies,
    prefilter,
    rule_checks,
    shard_objects,
    verdict_entries,
)
from epguard.webhook.engine.imageref import parse
from epguard.webhook.engine.policy import PolicyConfig, PolicyState, decide
from epguard.webhook.engine.review import AdmissionRequest
from epguard.webhook.engine.rules import Rule, RuleSet, RulesHolder
from epguard.webhook.engine.verdicts import VerdictStore, verdict_from_object, verdict_name
from epguard.webhook.engine.workloads import BUILTIN, PATH_KINDS

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
SEEN = NOW.strftime("%Y-%m-%dT%H:%M:%SZ")
LAUNCH = ["python3", "-m", "sglang.launch_server", "--model-path", "m"]
MOONCAKE = ["--elastic-ep-backend", "mooncake"]
RULE = Rule(
    id="bad-0516",
    image="docker.io/lmsysorg/sglang:v0.5.16-cu129",
    reason="no ep_2_11_0 extension",
    remedy="use v0.5.18-cu130",
)
GLOB = Rule(id="bad-glob", image="registry.example.com/bad/*", reason="bad", remedy="other")
NO_RULES = RuleSet()
CONFIG = BackstopConfig(params_namespace="epguard-system", kinds=PATH_KINDS)


# --- Kubernetes' CEL library, as cel-python functions --------------------------------


def _s(v: Any) -> str:
    return str(v)


def _split(s: Any, sep: Any) -> celtypes.ListType:
    return celtypes.ListType([celtypes.StringType(p) for p in _s(s).split(_s(sep))])


def _substring(s: Any, start: Any, end: Any = None) -> celtypes.StringType:
    text, a = _s(s), int(start)
    b = len(text) if end is None else int(end)
    if not 0 <= a <= b <= len(text):
        raise ValueError(f"substring({a}, {b}) out of range of {len(text)}")
    return celtypes.StringType(text[a:b])


def _last_index_of(s: Any, sub: Any) -> celtypes.IntType:
    return celtypes.IntType(_s(s).rfind(_s(sub)))


def _index_of(s: Any, sub: Any) -> celtypes.IntType:
    return celtypes.IntType(_s(s).find(_s(sub)))


def _lower_ascii(s: Any) -> celtypes.StringType:
    return celtypes.StringType("".join(c.lower() if c.isascii() else c for c in _s(s)))


def _replace(s: Any, old: Any, new: Any) -> celtypes.StringType:
    return celtypes.StringType(_s(s).replace(_s(old), _s(new)))


def _join(items: Any, sep: Any = "") -> celtypes.StringType:
    return celtypes.StringType(_s(sep).join(_s(i) for i in items))


def _flatten(items: Any) -> celtypes.ListType:
    out: list[Any] = []
    for i in items:
        out.extend(i if isinstance(i, list) else [i])
    return celtypes.ListType(out)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "split": _split,
    "substring": _substring,
    "lastIndexOf": _last_index_of,
    "indexOf": _index_of,
    "lowerAscii": _lower_ascii,
    "replace": _replace,
    "join": _join,
    "flatten": _flatten,
}
ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def evaluate(expression: str, activation: dict[str, Any]) -> Any:
    program = _PROGRAMS.get(expression)
    if program is None:
        program = _PROGRAMS[expression] = ENV.program(ENV.compile(expression), functions=FUNCTIONS)
    result = program.evaluate(activation)
    assert not isinstance(result, celpy.CELEvalError), result
    return result


# --- the policy, evaluated as the API server does for one shard ----------------------


def the_policy(rules: RuleSet = NO_RULES) -> dict[str, Any]:
    (policy,) = [o for o in policies(CONFIG, rules) if o["kind"] == "ValidatingAdmissionPolicy"]
    return policy


def judge(obj: dict[str, Any], shard: dict[str, Any], rules: RuleSet = NO_RULES) -> str | None:
    """What one shard's evaluation says: the refusal message, or None (admitted)."""
    spec = the_policy(rules)["spec"]
    base = {"object": celpy.json_to_cel(obj), "params": celpy.json_to_cel(shard)}  # type: ignore[attr-defined]
    (condition,) = spec["matchConditions"]
    if not evaluate(condition["expression"], base):
        return None
    (validation,) = spec["validations"]
    if evaluate(validation["expression"], base):
        return None
    variables = stages(spec["variables"], base)
    return str(evaluate(validation["messageExpression"], {**base, "variables": variables}))


def stages(declared: list[dict[str, str]], base: dict[str, Any]) -> celtypes.MapType:
    """The policy's variables, each evaluated once in order (as the API server's lazy
    map does)."""
    variables = celtypes.MapType({})
    for v in declared:
        value = evaluate(v["expression"], {**base, "variables": variables})
        variables = celtypes.MapType({**variables, celtypes.StringType(v["name"]): value})
    return variables


def judge_all(obj: dict[str, Any], params: Params, rules: RuleSet = NO_RULES) -> list[str]:
    """Every shard's refusal (the API server evaluates the policy once per shard)."""
    out = []
    for shard in shard_objects(CONFIG, params):
        said = judge(obj, shard, rules)
        if said is not None:
            out.append(said)
    return out


def webhook_says(obj: dict[str, Any], rules: RuleSet, store: VerdictStore) -> str | None:
    state = PolicyState(rules=RulesHolder(rules), config=PolicyConfig(kinds=BUILTIN))
    state.verdicts = store
    request = AdmissionRequest.model_validate(
        {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": "ml",
            "object": obj,
            "userInfo": {"username": "alice"},
        }
    )
    decision = decide(request, state, now=NOW)
    return None if decision.allowed else (decision.message or "")


def pod(image: str, command: list[str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "w", "namespace": "ml"},
        "spec": {
            "containers": [
                {"name": "worker", "image": image, "command": command or LAUNCH + MOONCAKE}
            ]
        },
    }


def verdict(
    name: str, image: str, digest: str | None, reason: str = "libcudart.so.12 is missing"
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "image": image,
        "verdict": "Unusable",
        "reason": reason,
        "lastSeen": SEEN,
        "pod": "ml/sglang-0",
    }
    if digest is not None:
        spec["digest"] = digest
    return {"metadata": {"name": name}, "spec": spec}


def store_of(*objects: dict[str, Any]) -> VerdictStore:
    store = VerdictStore(tag_ttl=dt.timedelta(hours=24), cap=200_000)
    store.replace(v for v in map(verdict_from_object, objects) if v is not None)
    return store


def digest_of(i: int) -> str:
    return "sha256:" + f"{i:016x}" * 4


def many(n: int) -> VerdictStore:
    """``n`` Unusable verdicts, each its own image and digest (100 repositories), named
    as the probe's recorder names them; every tenth one under another name."""
    objects = []
    for i in range(n):
        d = digest_of(i)
        name = d.replace(":", "-") if i % 10 else f"imported-{i}"
        reason = f"libcudart.so.12 is missing (build {i % 7})"
        objects.append(verdict(name, f"registry.example.com/team-{i % 100}/sglang:b{i}", d, reason))
    return store_of(*objects)


# --- the tests ----------------------------------------------------------------------


@pytest.mark.parametrize("learned_by", ["digest", "tag"])
def test_a_digest_with_an_unusable_verdict_is_refused_naming_the_verdict(learned_by: str) -> None:
    """The probe's own names are rebuilt from the pod's digest: ``sha256-<hex>``, and for a
    verdict learned by tag ``sha256-<hex>-<hash of the tag>``, of which the parameters
    hold only the hash."""
    d = digest_of(7)
    learned = "registry.example.com/x/y:a"
    name = d.replace(":", "-") if learned_by == "digest" else verdict_name(learned, d)
    store = store_of(verdict(name, learned, d))
    params = compile_params(store, NOW)
    (shard,) = shard_objects(CONFIG, params)
    (by_digest,) = shard["data"]["d"].values()  # the tag's entry names it whole
    assert by_digest == ("0" if learned_by == "digest" else "0 " + name[-17:])
    image = f"registry.example.com/x/y@{d}"
    (said,) = judge_all(pod(image), params)
    assert f'container "worker" (image {image})' in said
    assert f"[epguard verdict {name}]" in said
    assert f"delete ImageVerdict {name}" in said and NAME_SLOT not in said
    webhook = webhook_says(pod(image), RuleSet(), store)
    assert webhook is not None and f"[epguard verdict {name}]" in webhook


@pytest.mark.parametrize(
    "written",
    [
        "lmsysorg/sglang:v1",
        "docker.io/lmsysorg/sglang:v1",
        "index.docker.io/lmsysorg/sglang:v1",
    ],
)
def test_a_tag_with_an_unusable_verdict_is_refused_in_every_spelling(written: str) -> None:
    store = store_of(verdict("ref-0123", "docker.io/lmsysorg/sglang:v1", None))
    params = compile_params(store, NOW)
    (said,) = judge_all(pod(written), params)
    assert "[epguard verdict ref-0123]" in said and "libcudart.so.12 is missing" in said
    webhook = webhook_says(pod(written), RuleSet(), store)
    assert webhook is not None and "[epguard verdict ref-0123]" in webhook


def test_an_official_image_is_read_under_library_and_latest() -> None:
    store = store_of(verdict("ref-ubuntu", "docker.io/library/ubuntu:latest", None))
    params = compile_params(store, NOW)
    for written in ("ubuntu", "library/ubuntu", "docker.io/ubuntu:latest", "ubuntu:latest"):
        assert judge_all(pod(written), params), written
    for written in ("ubuntu:22.04", "localhost/ubuntu", "registry.example.com/ubuntu"):
        assert judge_all(pod(written), params) == [], written


def test_a_tag_verdict_leaves_a_pinned_image_to_its_digest() -> None:
    store = store_of(verdict("ref-a", "registry.example.com/x/y:a", None))
    params = compile_params(store, NOW)
    assert judge_all(pod("registry.example.com/x/y:a"), params)
    assert judge_all(pod(f"registry.example.com/x/y:a@{digest_of(1)}"), params) == []


def test_ordinary_pods_good_images_and_other_flags_are_admitted() -> None:
    d = digest_of(3)
    params = compile_params(store_of(verdict("v", f"registry.example.com/x/y@{d}", d)), NOW)
    bad = f"registry.example.com/x/y@{d}"
    assert judge_all(pod(bad, ["sleep", "1"]), params) == []
    assert judge_all(pod(bad, LAUNCH), params) == []
    assert judge_all(pod(bad, [*LAUNCH, *MOONCAKE, "--elastic-ep-backend", "nixl"]), params) == []
    assert judge_all(pod(f"registry.example.com/x/y@{digest_of(4)}"), params) == []
    assert judge_all(pod("registry.example.com/x/y:good"), params) == []


def test_deny_rules_are_constants_in_the_policy_tested_under_the_first_shard_only() -> None:
    rules = RuleSet((RULE, GLOB))
    params = compile_params(store_of(), NOW)
    (shard,) = shard_objects(CONFIG, params)
    assert shard["data"]["rules"] is True
    said = judge(pod("lmsysorg/sglang:v0.5.16-cu129"), shard, rules)
    assert said is not None and "[epguard rule bad-0516]" in said
    assert "no ep_2_11_0 extension" in said and "use v0.5.18-cu130" in said
    said = judge(pod("registry.example.com/bad/a/b:c"), shard, rules)
    assert said is not None and "[epguard rule bad-glob]" in said
    # The policy text holds the rule; the parameters do not.
    assert "bad-0516" in json.dumps(the_policy(rules)) and "bad-0516" not in json.dumps(shard)
    other = {**shard, "data": {**shard["data"], "rules": False}}
    assert judge(pod("lmsysorg/sglang:v0.5.16-cu129"), other, rules) is None
    webhook = webhook_says(pod("lmsysorg/sglang:v0.5.16-cu129"), rules, store_of())
    assert webhook is not None and "[epguard rule bad-0516]" in webhook


def test_a_reason_is_written_once_and_the_names_come_from_the_digest() -> None:
    objects = [
        verdict(
            digest_of(i).replace(":", "-"), f"registry.example.com/x/y@{digest_of(i)}", digest_of(i)
        )
        for i in range(50)
    ]
    params = compile_params(store_of(*objects), NOW)
    (shard,) = params.shards
    assert len(shard["r"]) == 1 and len(shard["d"]) == 50
    # The probe's own names (sha256-<digest>) are not stored: the value is the index.
    assert set(shard["d"].values()) == {"0"}
    assert all(len(k) == DIGEST_KEY for k in shard["d"])
    image = f"registry.example.com/x/y@{digest_of(49)}"
    (said,) = judge_all(pod(image), params)
    assert f"[epguard verdict {digest_of(49).replace(':', '-')}]" in said


def test_a_verdict_text_cannot_forge_the_name_slot() -> None:
    d = digest_of(5)
    forged = f"bad {NAME_SLOT} text"
    params = compile_params(store_of(verdict("named-by-hand", f"r.io/x/y@{d}", d, forged)), NOW)
    (said,) = judge_all(pod(f"r.io/x/y@{d}"), params)
    assert "bad ? text" in said and "[epguard verdict named-by-hand]" in said


@pytest.mark.parametrize(
    "written",
    [
        "ubuntu",
        "Registry.Example.com/x/y:1",
        "NVCR.IO:443/nvidia/sglang:1.6.1",
        "registry-1.docker.io/lmsysorg/sglang:v1",
        "Index.Docker.IO:443/ubuntu",
        "localhost:5443/x",
        "localhost/x",
        "localhost:5000/x/y:t",
        "index.docker.io/x",
        "docker.io/library/x:1",
        "a.b/c/d/e:f",
        f"r.io/x/y:t@{digest_of(9)}",
        f"r.io/x@{digest_of(9)}",
    ],
)
def test_the_policy_normalizes_an_image_as_imageref_does(written: str) -> None:
    spec = the_policy()["spec"]
    base = {"object": celpy.json_to_cel(pod(written)), "params": celpy.json_to_cel({"data": {}})}  # type: ignore[attr-defined]
    variables = stages(spec["variables"][:-1], base)
    ((_, _, hexd, repo, tag, name_tag),) = variables[celtypes.StringType("k")]
    ref = parse(written)
    assert (str(repo), str(tag) or None, str(name_tag)) == (ref.name, ref.tag, ref.name_tag)
    assert str(hexd) == (ref.digest or "").removeprefix("sha256:")


def test_the_match_condition_is_the_message_stages_inlined() -> None:
    spec = the_policy(RuleSet((RULE,)))["spec"]
    (condition,) = spec["matchConditions"]
    assert "variables." not in condition["expression"]
    assert inline(spec["variables"]) in condition["expression"]


@pytest.fixture(scope="module")
def hundred_thousand() -> tuple[VerdictStore, Params]:
    store = many(100_000)
    return store, compile_params(store, NOW)


def test_every_verdict_is_kept_at_100k_each_shard_under_the_cap(
    hundred_thousand: tuple[VerdictStore, Params],
) -> None:
    _, params = hundred_thousand
    # 100,000 digest entries and 100,000 tag entries (each verdict names a tag too).
    assert params.dropped == 0 and params.kept == 200_000
    assert 1 < len(params.shards) <= MAX_SHARDS
    for shard in shard_objects(CONFIG, params):
        size = len(json.dumps(shard["data"], separators=(",", ":"), ensure_ascii=False).encode())
        assert size <= SHARD_BYTES, size
    held = sum(len(s["d"]) + sum(len(t) for t in s["t"].values()) for s in params.shards)
    assert held == 200_000


def test_the_last_entry_of_the_last_shard_is_refused_at_100k(
    hundred_thousand: tuple[VerdictStore, Params],
) -> None:
    store, params = hundred_thousand
    last = params.shards[-1]
    key = list(last["d"])[-1]
    i = next(i for i in range(100_000) if digest_of(i)[7 : 7 + DIGEST_KEY] == key)
    image = f"registry.example.com/team-{i % 100}/sglang@{digest_of(i)}"
    shard = shard_objects(CONFIG, params)[-1]
    said = judge(pod(image), shard)
    assert said is not None and "libcudart.so.12 is missing" in said
    webhook = webhook_says(pod(image), RuleSet(), store)
    assert webhook is not None
    name = digest_of(i).replace(":", "-") if i % 10 else f"imported-{i}"
    assert f"[epguard verdict {name}]" in said and f"[epguard verdict {name}]" in webhook
    repo = list(last["t"])[-1]
    tag = list(last["t"][repo])[-1]
    said = judge(pod(f"{repo}:{tag}"), shard)
    assert said is not None and "[epguard verdict " in said
    # Every other shard admits it: each entry is in exactly one shard.
    others = [s for s in shard_objects(CONFIG, params)[:-1] if judge(pod(image), s) is not None]
    assert others == []


def test_at_1000_every_verdict_is_refused_by_exactly_one_shard() -> None:
    store = many(1000)
    params = compile_params(store, NOW)
    assert params.dropped == 0 and params.kept == 2000
    for i in range(0, 1000, 37):
        image = f"registry.example.com/team-{i % 100}/sglang@{digest_of(i)}"
        assert len(judge_all(pod(image), params)) == 1, image
        tagged = f"registry.example.com/team-{i % 100}/sglang:b{i}"
        assert len(judge_all(pod(tagged), params)) == 1, tagged


def test_a_shard_without_the_images_key_stops_before_the_command_line_tests(
    hundred_thousand: tuple[VerdictStore, Params],
) -> None:
    # The cost of a create grows with the shards only by a key lookup each: the command
    # lines' regular expressions run in the shard holding the key (and the rules' one).
    _, params = hundred_thousand
    _, containers = _kind_containers(CONFIG)
    test = prefilter(containers)
    assert "sglang" not in test  # no command-line pattern in the prefilter
    shards = shard_objects(CONFIG, params)
    last = shards[-1]["data"]
    key = list(last["d"])[-1]
    i = next(i for i in range(100_000) if digest_of(i)[7 : 7 + DIGEST_KEY] == key)
    image = f"registry.example.com/team-{i % 100}/sglang@{digest_of(i)}"
    obj = celpy.json_to_cel(pod(image))  # type: ignore[attr-defined]
    passed = [
        n
        for n, shard in enumerate(shards)
        if evaluate(test, {"object": obj, "params": celpy.json_to_cel(shard)})  # type: ignore[attr-defined]
    ]
    assert passed == [len(shards) - 1]  # the key's shard only


def test_with_rules_a_good_image_runs_no_command_line_test_in_any_shard() -> None:
    rules = RuleSet((RULE, GLOB))
    checks, _ = rule_checks(rules)
    _, containers = _kind_containers(CONFIG)
    test = prefilter(containers, checks)
    (shard,) = shard_objects(CONFIG, compile_params(store_of(), NOW))
    params = celpy.json_to_cel(shard)  # type: ignore[attr-defined]

    def passes(image: str) -> bool:
        obj = celpy.json_to_cel(pod(image))  # type: ignore[attr-defined]
        return bool(evaluate(test, {"object": obj, "params": params}))

    assert not passes("lmsysorg/sglang:v0.5.18-cu130")
    assert passes("lmsysorg/sglang:v0.5.16-cu129") and passes("registry.example.com/bad/x:1")


# --- the streamed index the controller reads verdicts into -----------------------------


def _mixed_verdicts(seed: int, n: int) -> list[dict[str, Any]]:
    """Verdicts that contend for keys: shared digests and tags, Usable ones newer and
    older than Unusable ones, equal times, tags past the TTL, a lastSeen in the future, a
    digest the policy cannot read, names that are and are not derived from the digest."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    names: set[str] = set()  # an object name is unique, as in any list the API returns
    for i in range(n):
        d = rng.choice([digest_of(rng.randrange(n // 3 + 1)), None, "sha512:" + "ab" * 64])
        image = f"registry.example.com/t{rng.randrange(5)}/sglang:b{rng.randrange(n // 4 + 1)}"
        derived = d is not None and d.startswith("sha256") and rng.random() < 0.5
        name = d.replace(":", "-") if d and derived else f"v-{i}"
        if d and derived and rng.random() < 0.5:  # a probe's name for a verdict by tag
            name = verdict_name(image, d)
        name = name if name not in names else f"v-{i}"
        names.add(name)
        hours = rng.choice([-2, 0, 1, 5, 23.9, 24.5, 48])
        seen = (NOW - dt.timedelta(hours=hours)).strftime("%Y-%m-%dT%H:%M:%SZ")
        obj = verdict(name, image, d, reason=f"cause {rng.randrange(3)}")
        obj["spec"]["lastSeen"] = seen
        if rng.random() < 0.3:
            obj["spec"]["verdict"] = "Usable"
        out.append(obj)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_streamed_index_answers_every_key_as_the_webhooks_store_does(seed: int) -> None:
    objects = _mixed_verdicts(seed, 300)
    verdicts = [v for v in map(verdict_from_object, objects) if v is not None]
    store = VerdictStore(tag_ttl=dt.timedelta(hours=24), cap=10_000)
    store.replace(verdicts, now=NOW)
    index = EntryIndex(dt.timedelta(hours=24), NOW)
    for v in random.Random(seed).sample(verdicts, len(verdicts)):  # any order of pages
        index.add(v)
    want, want_next = verdict_entries(store, NOW)
    got, got_next = index.entries()
    key = lambda e: (e.kind, e.key, e.tag)  # noqa: E731
    assert sorted(got, key=key) == sorted(want, key=key) and got_next == want_next
    assert want, "the sample refuses nothing: the comparison would prove nothing"
    assert compile_params(index, NOW) == compile_params(store, NOW)


def test_a_shard_fits_as_the_client_sends_it_and_as_the_api_server_stores_it() -> None:
    """Sized as UTF-8, a shard of verdicts whose reasons were `é` was 1.15 MB counted and
    3.4 MB as the client sends it (every non-ASCII character escaped), past the API
    server's request limit, and the backstop stopped following the verdicts (review
    helper). The API server stores `<`, `>` and `&` escaped (6 bytes) too."""
    objects = [
        verdict(f"v-{i}", f"registry.example.com/t/s:b{i}", digest_of(i), f"{i} " + "é<" * 600)
        for i in range(600)
    ]
    params = compile_params(store_of(*objects), NOW)
    assert params.dropped == 0 and len(params.shards) > 1
    for shard in shard_objects(CONFIG, params):
        sent = json.dumps(shard["data"], separators=(",", ":"))  # ensure_ascii, as sent
        stored = len(json.dumps(shard["data"], separators=(",", ":"), ensure_ascii=False)
                     .encode()) + 5 * sent.count("<")  # fmt: skip
        assert len(sent) <= SHARD_BYTES and stored <= SHARD_BYTES, (len(sent), stored)


def test_a_control_character_in_a_rules_image_pattern_is_escaped_in_the_policy() -> None:
    """A raw carriage return in a CEL string literal made the whole policy fail to compile
    (review helper): every control character is written as an escape."""
    odd = Rule(id="odd", image="registry.example.com/x/y\r\x85z:*", reason="r", remedy="f")
    spec = the_policy(RuleSet((odd,)))["spec"]
    expressions = [v["expression"] for v in spec.get("variables", [])]
    expressions += [v["expression"] for v in spec["validations"]]
    assert not any("\r" in e or "\x85" in e for e in expressions)
    assert any("\\x0d" in e and "\\x85" in e for e in expressions)
    for e in expressions:
        celpy.Environment().compile(e)  # raises on a literal CEL cannot read
