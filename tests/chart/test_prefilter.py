"""The webhooks' matchConditions are a prefilter an admin can read (each expression at
most 2 KiB, printed verbatim by `kubectl get validatingwebhookconfiguration -o yaml`).
They may send the webhook more objects than the exact needle they replace (which was up
to 32 KB of CEL per webhook), never fewer. Evaluated with cel-python, they are held to
three floors:

1. the engine: every object of the corpus (the cases of test_match_conditions and
   test_injection_match, the extra kinds' objects, the real manifests, the hostile pods)
   in which the webhook's engine reads a container that requests mooncake elastic EP, or
   a container string the previous needle matched, is sent;
2. the previous needle, string by string: every string it matched (a spelling of the
   flag SGLang accepts, as a whole word, as written or with a shell's quotes removed;
   modelled below from SGLang's option table as the chart built it) is sent from every
   place a container string can be;
3. the engine's places: for every kind, built in or from webhook.extraKinds, a container
   with the flag at each place the engine reads containers from is sent.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Iterator
from typing import Any

import pytest

from epguard.probe import cmdline
from epguard.webhook.engine import argv
from epguard.webhook.engine.workloads import PATH_KINDS, KindRegistry, group_of, parse_kinds
from tests import hostile_pods, realmanifests
from tests.chart import test_injection_match as injection_cases
from tests.chart import test_match_conditions as cases
from tests.chart.chartlib import CHART, VARIANT_IDS, VARIANTS, render, run_helm, variant_args
from tests.chart.test_extra_kinds import pool
from tests.chart.test_match_conditions import evaluate

Obj = dict[str, Any]
MAX_BYTES = 2048
EXTRA = ("-f", str(CHART / "ci" / "extra-kinds-values.yaml"))


# --- the rendered configuration (with the ci file's extra kinds) -------------------------


@functools.cache
def _hooks() -> dict[str, Obj]:
    vwc = render(*EXTRA).one("ValidatingWebhookConfiguration")
    return {w["name"]: w for w in vwc["webhooks"] if w["name"] != "rules.epguard.io"}


def expression(hook: str) -> str:
    (cond,) = _hooks()[hook]["matchConditions"]
    assert cond["name"].startswith("mentions-elastic-ep")
    return str(cond["expression"])


def hook_for(group: str, kind: str, version: str) -> str | None:
    """The webhook whose rules send objects of this kind and version (as the API server
    routes them: a RoleBasedGroup's two versions have a webhook each)."""
    resource = kind.lower() + "s"
    found = [
        name
        for name, w in _hooks().items()
        if any(
            group in r["apiGroups"]
            and resource in r["resources"]
            and (version in r["apiVersions"] or "*" in r["apiVersions"])
            for r in w["rules"]
        )
    ]
    assert len(found) <= 1, found
    return found[0] if found else None


def version_of(api_version: Any) -> str:
    return str(api_version).rpartition("/")[2]


@functools.cache
def registry() -> KindRegistry:
    """The engine's kinds, with the extra kinds the chart passes it (EPGUARD_EXTRA_KINDS)."""
    deploy = next(
        o for o in render(*EXTRA).all("Deployment") if o["metadata"]["name"].endswith("-webhook")
    )
    env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    text = next(e["value"] for e in env if e["name"] == "EPGUARD_EXTRA_KINDS")
    return KindRegistry(parse_kinds(text, "EPGUARD_EXTRA_KINDS"))


def sent(obj: Obj) -> bool:
    group, kind = group_of(obj.get("apiVersion")), obj["kind"]
    hook = hook_for(group, kind, version_of(obj.get("apiVersion")))
    assert hook is not None, f"no webhook for {group}/{kind}"
    return evaluate(expression(hook), obj)


# --- the floors --------------------------------------------------------------------------

SHORTEST = cmdline.min_prefix()
_TAIL = cmdline.BACKEND[len(SHORTEST) :]
# The needle the chart matched before this prefilter: each spelling from the shortest
# SGLang accepts up to the full flag, as a whole word, tested on the string as written
# and with the shell's quote characters removed.
PREVIOUS = re.compile(
    r"(^|[^A-Za-z0-9_-])"
    + re.escape(SHORTEST)
    + "".join(f"({re.escape(ch)}" for ch in _TAIL)
    + ")?" * len(_TAIL)
    + r"([^A-Za-z0-9_-]|$)"
)
_QUOTES = str.maketrans("", "", "'\"\\")


def previously_sent(text: str) -> bool:
    return any(PREVIOUS.search(t) for t in (text, text.translate(_QUOTES)))


def strings_of(container: Obj) -> Iterator[str]:
    for field in ("command", "args"):
        for word in container.get(field) or []:
            yield str(word)
    for e in container.get("env") or []:
        if isinstance(e, dict) and e.get("value") is not None:
            yield str(e["value"])


def relevant(obj: Obj) -> bool:
    """The engine reads a container of ``obj`` that requests mooncake, or one with a
    string the previous needle sent."""
    views = registry().pod_templates(group_of(obj.get("apiVersion")), obj["kind"], obj)
    for view in views or []:
        for c in view.containers:
            if argv.analyse_container(c.raw).requests_mooncake:
                return True
            if any(previously_sent(s) for s in strings_of(dict(c.raw))):
                return True
    return False


# --- floor 1: the corpus -----------------------------------------------------------------


def corpus() -> list[tuple[str, Obj]]:
    out: list[tuple[str, Obj]] = []
    out += [(f"case {hook}: {what}", obj) for hook, what, obj, _ in cases.CASES]
    out += [(f"route: {what}", obj) for what, obj, _, _ in injection_cases.ROUTES]
    out += [
        ("pool", pool(cases.FLAG_ARGS)),
        ("pool router", pool(["--tp", "8"], router_args=cases.FLAG_ARGS)),
        ("pool plain", pool(["--tp", "8"])),
    ]
    for m in realmanifests.manifests():
        for i, doc in enumerate(m.documents):
            if isinstance(doc, dict) and "kind" in doc:
                group = group_of(doc.get("apiVersion"))
                if hook_for(group, doc["kind"], version_of(doc.get("apiVersion"))) is not None:
                    out.append((f"{m.file}[{i}]", doc))
    out += [
        ("hostile nested scripts", hostile_pods.nested_script_pod()),
        ("hostile doubling env", hostile_pods.doubling_env_pod()),
        # 100 words a container, not the 1,000 that test the webhook's parse budget
        # (tests/engine/test_bounded_reading.py) and the API server's CEL cost
        # (tests/e2e/test_backstop.py): cel-python took 30 s over 48,000 words, and the
        # shape (48 containers of plain words) is what this test is about.
        ("hostile many words", hostile_pods.many_words_pod(100)),
    ]
    return out


CORPUS = corpus()


@pytest.mark.parametrize(("what", "obj"), CORPUS, ids=[w for w, _ in CORPUS])
def test_every_object_the_engine_would_judge_is_sent(what: str, obj: Obj) -> None:
    # evaluate() also asserts a bool: no object of the corpus makes an expression fail.
    if relevant(obj):
        assert sent(obj), what
    else:
        sent(obj)


def test_the_corpus_is_not_vacuous() -> None:
    judged = [w for w, obj in CORPUS if relevant(obj)]
    assert len(judged) >= 30
    if realmanifests.available():
        labelled = {m.file for m in realmanifests.manifests() if m.requests_mooncake}
        assert labelled <= {w.rsplit("[", 1)[0] for w in judged}


# --- floor 2: every string the previous needle sent --------------------------------------


def _fuzzed(seed: int = 20240611, per_spelling: int = 12) -> list[str]:
    """Spellings of the flag with a shell's quote characters (and other characters)
    inserted, in front of and behind other text."""
    rnd = random.Random(seed)
    inserts = ["'", '"', "\\", "''", '""', "\\\\", "'\"", " ", "-", "=", "x", "$", "\n"]
    before = ["", " ", "x", "a-", "run ", "'", '"', "=", "_", "exec python3 -m sglang "]
    after = ["", " mooncake", "=mooncake", "x", "_", "-", "'", '"', "\\", " --tp 8"]
    out = []
    for n in range(len(SHORTEST), len(cmdline.BACKEND) + 1):
        word = cmdline.BACKEND[:n]
        for _ in range(per_spelling):
            chars = list(word)
            for _ in range(rnd.randint(1, 3)):
                chars.insert(rnd.randint(0, len(chars)), rnd.choice(inserts))
            out.append(rnd.choice(before) + "".join(chars) + rnd.choice(after))
    return out


def _strings() -> list[str]:
    spellings = [cmdline.BACKEND[:n] for n in range(len(SHORTEST), len(cmdline.BACKEND) + 1)]
    out = [*spellings, *(f"{s}=mooncake" for s in spellings)]
    out += [f"exec python3 -m sglang.launch_server {s} mooncake" for s in spellings]
    out += cases.QUOTED
    out += [line.text for line in realmanifests.command_lines()]
    out += _fuzzed()
    return list(dict.fromkeys(out))


STRINGS = _strings()
PREVIOUSLY_SENT = [s for s in STRINGS if previously_sent(s)]


def _placed(text: str) -> Iterator[tuple[str, Obj]]:
    worker = {"name": "w", "image": "lmsysorg/sglang:v0.5.21"}
    yield "args", cases.pod(cases.pod_spec({**worker, "args": [text]}))
    yield "sh -c", cases.pod(cases.pod_spec({**worker, "command": ["sh", "-c", text]}))
    env = [{"name": "A", "value": "x"}, {"name": "RUN", "value": text}]
    yield "env value", cases.pod(cases.pod_spec({**worker, "args": ["$(RUN)"], "env": env}))
    yield (
        "init container",
        cases.pod(cases.pod_spec(dict(worker), init=[{**worker, "args": ["--tp", text]}])),
    )


def test_the_strings_cover_the_previous_needle() -> None:
    # The generated and hostile strings alone give 146; the real command lines add more
    # where the shared folder is there (a clone elsewhere has none: realmanifests).
    assert len(PREVIOUSLY_SENT) >= (150 if realmanifests.available() else 120)
    assert any(previously_sent(s) and not PREVIOUS.search(s) for s in PREVIOUSLY_SENT)


@pytest.mark.parametrize("text", PREVIOUSLY_SENT, ids=[repr(s)[:60] for s in PREVIOUSLY_SENT])
def test_every_string_the_previous_needle_sent_is_sent_from_every_place(text: str) -> None:
    for where, obj in _placed(text):
        assert evaluate(expression("pods.epguard.io"), obj), where


# --- floor 3: every place the engine reads containers from -------------------------------

# The kinds the engine reads with code of its own (webhook/engine/workloads.py), as paths;
# each is checked against the engine below, so this table cannot drift from it.
READERS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("v1", "Pod", [("spec", "podSpec")]),
    *[
        (api, kind, [("spec.template", "template")])
        for api, kind in (
            ("apps/v1", "Deployment"),
            ("apps/v1", "StatefulSet"),
            ("apps/v1", "DaemonSet"),
            ("apps/v1", "ReplicaSet"),
            ("batch/v1", "Job"),
        )
    ],
    ("batch/v1", "CronJob", [("spec.jobTemplate.spec.template", "template")]),
    (
        "leaderworkerset.x-k8s.io/v1",
        "LeaderWorkerSet",
        [
            ("spec.leaderWorkerTemplate.leaderTemplate", "template"),
            ("spec.leaderWorkerTemplate.workerTemplate", "template"),
        ],
    ),
    (
        "nvidia.com/v1alpha1",
        "DynamoGraphDeployment",
        [
            ("spec.services.*.extraPodSpec", "podSpec"),
            ("spec.services.*.extraPodSpec.mainContainer", "container"),
        ],
    ),
    (
        "nvidia.com/v1beta1",
        "DynamoGraphDeployment",
        [("spec.components[].podTemplate", "template")],
    ),
    (
        "workloads.x-k8s.io/v1alpha1",
        "RoleBasedGroup",
        [
            *(
                (f"spec.roles[].{p}", "template")
                for p in (
                    "template",
                    "templatePatch",
                    "leaderWorkerSet.patchLeaderTemplate",
                    "leaderWorkerSet.patchWorkerTemplate",
                    "components[].template",
                )
            ),
            ("spec.roles[].engineRuntimes[]", "podSpec"),
        ],
    ),
    (
        "workloads.x-k8s.io/v1alpha2",
        "RoleBasedGroup",
        [
            *(
                (f"spec.roles[].{p}", "template")
                for p in (
                    "customComponentsPattern.components[].template",
                    "standalonePattern.template",
                    "standalonePattern.templateRef.patch",
                    "leaderWorkerPattern.template",
                    "leaderWorkerPattern.templateRef.patch",
                    "leaderWorkerPattern.leaderTemplatePatch",
                    "leaderWorkerPattern.workerTemplatePatch",
                )
            ),
            ("spec.roles[].engineRuntimes[]", "podSpec"),
        ],
    ),
]


def _places() -> list[tuple[str, str, str, str]]:
    out = [(api, kind, path, shape) for api, kind, paths in READERS for path, shape in paths]
    for spec in (*PATH_KINDS, *registry().extra):
        api = f"{spec.group}/{spec.versions[0]}" if spec.group else spec.versions[0]
        out += [(api, spec.kind, p.path, p.shape) for p in spec.paths]
    return out


PLACES = _places()


def place(api: str, kind: str, path: str, shape: str, container: Obj, first: bool) -> Obj:
    """An object with ``container`` at ``path`` and nothing else; where the path has a
    list or a map, the container is in its last item (after an empty one) unless
    ``first``."""
    if shape == "template":
        node: Any = {"metadata": {"labels": {"app": "x"}}, "spec": {"containers": [container]}}
    elif shape == "podSpec":
        node = {"containers": [container]}
    else:
        node = container
    for seg in reversed(path.split(".")):
        if seg == "*":
            node = {"decode": node} if first else {"frontend": {}, "decode": node}
        elif seg.endswith("[]"):
            node = {seg[:-2]: [node] if first else [{}, node]}
        else:
            node = {seg: node}
    return {"apiVersion": api, "kind": kind, "metadata": {"name": "o"}, **node}


def test_every_kind_the_chart_sends_has_places() -> None:
    kinds = {hook_for(group_of(api), kind, version_of(api)) for api, kind, _, _ in PLACES}
    assert kinds == set(_hooks())


@pytest.mark.parametrize(
    ("api", "kind", "path", "shape"), PLACES, ids=[f"{k} {p}" for _, k, p, _ in PLACES]
)
def test_a_container_with_the_flag_anywhere_the_engine_reads_is_sent(
    api: str, kind: str, path: str, shape: str
) -> None:
    worker = {"name": "sglang", "image": "lmsysorg/sglang:v0.5.21"}
    quoted = "exec python3 -m sglang.launch_server -''-elastic-ep-backend mooncake"
    containers = [
        {**worker, "args": cases.FLAG_ARGS},
        {**worker, "command": ["sh", "-c", quoted]},
        {**worker, "args": ["$(EP)"], "env": [{"name": "EP", "value": "--elastic-ep-b=mooncake"}]},
    ]
    for container in containers:
        for first in (True, False):
            obj = place(api, kind, path, shape, container, first)
            # The engine reads a container there (so the place is real) ...
            views = registry().pod_templates(group_of(api), kind, obj) or []
            assert any(
                dict(c.raw).get("args") == container.get("args")
                and dict(c.raw).get("command") == container.get("command")
                for v in views
                for c in v.containers
            ), (path, views)
            # ... and the API server sends the object.
            assert sent(obj), (path, container, first)
            plain = {**worker, "args": cases.PLAIN_ARGS}
            assert not sent(place(api, kind, path, shape, plain, first)), path


# --- short, and printed as written -------------------------------------------------------


def _conditions(objects: list[Obj]) -> Iterator[tuple[str, str]]:
    for o in objects:
        if o["kind"] in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
            for w in o["webhooks"]:
                for cond in w["matchConditions"]:
                    yield f"{o['kind']} {w['name']} {cond['name']}", cond["expression"]


@pytest.mark.parametrize("path", VARIANTS, ids=VARIANT_IDS)
def test_every_match_condition_is_at_most_2_kib(path: Any) -> None:
    conditions = dict(_conditions(render(*variant_args(path)).objects))
    assert conditions
    for where, text in conditions.items():
        assert len(text.encode()) <= MAX_BYTES, (where, len(text.encode()))


def test_the_extra_kinds_and_injection_are_among_the_measured() -> None:
    values = (*EXTRA, "-f", str(CHART / "ci" / "injection-values.yaml"))
    conditions = dict(_conditions(render(*values).objects))
    names = " ".join(conditions)
    assert "inferencepools.serving.example.com.extra.epguard.io" in names
    assert "clustertrainers.batch.example.com.extra.epguard.io" in names
    assert "namespace.inject.epguard.io" in names
    for where, text in conditions.items():
        assert len(text.encode()) <= MAX_BYTES, (where, len(text.encode()))


def test_each_expression_is_rendered_single_quoted_exactly_as_written() -> None:
    # Nothing escaped in the YAML (an admin reads the CEL as the API server does): only
    # double-quoted CEL strings, so the YAML scalar can be single-quoted.
    out = run_helm("template", "epguard", str(CHART), "--namespace", "epguard-system", *EXTRA)
    for where, text in _conditions(render(*EXTRA).objects):
        if "mentions-elastic-ep" in where:
            assert "'" not in text, where
            assert f"expression: '{text}'" in out.stdout, where


def test_the_string_test_reads_what_the_webhooks_own_cheap_test_reads() -> None:
    # cmdline.mentions_flag: --el as written or with a shell's quotes removed. The CEL:
    # --el as written or, in a string with a quote or a backslash, --el with non-word
    # characters between its letters. Only $'...' escapes are the webhook's alone.
    pattern = re.compile("\\W*".join(map(re.escape, SHORTEST)))

    def cel_reads(s: str) -> bool:
        return SHORTEST in s or (any(q in s for q in "'\"\\") and bool(pattern.search(s)))

    checked = 0
    for s in STRINGS:
        if cmdline.mentions_flag(s) and "$'" not in s:
            assert cel_reads(s), s
            obj = cases.pod(cases.pod_spec({"name": "w", "image": "i", "args": [s]}))
            assert evaluate(expression("pods.epguard.io"), obj), s
            checked += 1
    assert checked >= 150
