"""Which pods the API server sends to /mutate: the injection configuration's
namespaceSelectors, evaluated as the API server does, and its matchConditions, evaluated
with a CEL interpreter (cel-python) as tests/chart/test_match_conditions.py does for the
validating webhooks. A pod is injected only when it mentions the flag AND opted in, by
its namespace's label or by its own annotation, and it is sent exactly once."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart.chartlib import NAMESPACE, render
from tests.chart.test_match_conditions import CASES, FLAG_ARGS, PLAIN_ARGS, c, evaluate, pod_spec

Obj = dict[str, Any]
BY_NAMESPACE = "namespace.inject.epguard.io"
BY_ANNOTATION = "annotation.inject.epguard.io"


def mwc(*extra: str) -> Obj:
    found = [o for o in render(*extra).objects if o["kind"] == "MutatingWebhookConfiguration"]
    assert len(found) == 1
    return found[0]


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """metav1.LabelSelector semantics (NotIn and DoesNotExist match an absent key)."""
    if not selector:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for e in selector.get("matchExpressions") or []:
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": present and value in e.get("values", []),
            "NotIn": not present or value not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def namespace(name: str, **labels: str) -> dict[str, str]:
    # The API server sets this label on every namespace.
    return {"kubernetes.io/metadata.name": name, **labels}


def sent_to(pod_obj: Obj, ns_labels: dict[str, str], config: Obj | None = None) -> list[str]:
    """The webhooks of the configuration the API server calls for this pod's CREATE."""
    config = config or mwc()
    called = []
    for w in config["webhooks"]:
        if not selects(w["namespaceSelector"], ns_labels):
            continue
        if not selects(w.get("objectSelector"), pod_obj["metadata"].get("labels") or {}):
            continue
        if all(evaluate(cond["expression"], pod_obj) for cond in w["matchConditions"]):
            called.append(w["name"])
    return called


def worker_pod(
    args: list[str] = FLAG_ARGS, annotations: dict[str, str] | None = None, **meta: Any
) -> Obj:
    metadata: Obj = {"name": "w", **meta}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec(c(args))}


OPTED_IN = namespace("team-a", **{"epguard.io/inject": "enabled"})
PLAIN = namespace("team-b")
ON = {"epguard.io/inject": "enabled"}

# (description, pod, namespace labels, webhooks called)
ROUTES: list[tuple[str, Obj, dict[str, str], list[str]]] = [
    ("opted-in namespace, worker", worker_pod(), OPTED_IN, [BY_NAMESPACE]),
    (
        "opted-in namespace, annotated worker: sent once",
        worker_pod(annotations=ON),
        OPTED_IN,
        [BY_NAMESPACE],
    ),
    ("annotated worker", worker_pod(annotations=ON), PLAIN, [BY_ANNOTATION]),
    (
        "annotated worker among other annotations",
        worker_pod(annotations={"a": "b", **ON, "prometheus.io/scrape": "true"}),
        PLAIN,
        [BY_ANNOTATION],
    ),
    (
        "pod of a Deployment (generateName, template annotation copied)",
        {**worker_pod(annotations=ON), "metadata": {"generateName": "w-7d9f-", "annotations": ON}},
        PLAIN,
        [BY_ANNOTATION],
    ),
    (
        "flag only in an init container, annotated",
        {
            **worker_pod(annotations=ON),
            "spec": pod_spec(c(PLAIN_ARGS), init=[c(FLAG_ARGS)]),
        },
        PLAIN,
        [BY_ANNOTATION],
    ),
    (
        "namespace says disabled, pod annotated",
        worker_pod(annotations=ON),
        namespace("team-c", **{"epguard.io/inject": "disabled"}),
        [BY_ANNOTATION],
    ),
    ("worker that did not opt in", worker_pod(), PLAIN, []),
    ("worker with unrelated annotations", worker_pod(annotations={"a": "b"}), PLAIN, []),
    ("annotation disabled", worker_pod(annotations={"epguard.io/inject": "disabled"}), PLAIN, []),
    # "true" opts in as "enabled" does (webhook/engine/namespaces.py INJECT_ON, the chart agrees).
    (
        "annotation true",
        worker_pod(annotations={"epguard.io/inject": "true"}),
        PLAIN,
        [BY_ANNOTATION],
    ),
    ("annotation Enabled", worker_pod(annotations={"epguard.io/inject": "Enabled"}), PLAIN, []),
    ("label on the pod, not an annotation", worker_pod(labels=ON), PLAIN, []),
    ("opted-in namespace, no flag", worker_pod(PLAIN_ARGS), OPTED_IN, []),
    ("annotated, no flag", worker_pod(PLAIN_ARGS, annotations=ON), PLAIN, []),
    (
        "annotated, flag only in a label",
        worker_pod(PLAIN_ARGS, annotations=ON, labels={"x": "--elastic"}),
        PLAIN,
        [],
    ),
    (
        "annotated pod without spec",
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "annotations": ON}},
        PLAIN,
        [],
    ),
    (
        "kube-system, opted in twice",
        worker_pod(annotations=ON),
        namespace("kube-system", **ON),
        [],
    ),
    (
        "the release namespace, opted in twice",
        worker_pod(annotations=ON),
        namespace(NAMESPACE, **ON),
        [],
    ),
    (
        "namespace labelled epguard.io/ignore=true, opted in twice",
        worker_pod(annotations=ON),
        namespace("team-d", **ON, **{"epguard.io/ignore": "true"}),
        [],
    ),
]


@pytest.mark.parametrize(
    ("what", "pod_obj", "ns_labels", "expected"), ROUTES, ids=[r[0] for r in ROUTES]
)
def test_only_opted_in_pods_that_mention_the_flag_are_sent_once(
    what: str, pod_obj: Obj, ns_labels: dict[str, str], expected: list[str]
) -> None:
    assert sent_to(pod_obj, ns_labels) == expected


def test_extra_excluded_namespaces_and_the_object_selector_apply_to_injection(
    tmp_path: Any,
) -> None:
    values = tmp_path / "v.yaml"
    values.write_text(
        "webhook:\n  excludeNamespaces: [gpu-operator]\n"
        "  objectSelector:\n    matchExpressions:\n"
        "      - {key: epguard.io/opt-out, operator: DoesNotExist}\n"
    )
    config = mwc("-f", str(values))
    annotated = worker_pod(annotations=ON)
    assert sent_to(annotated, PLAIN, config) == [BY_ANNOTATION]
    assert sent_to(annotated, namespace("gpu-operator", **ON), config) == []
    opted_out = worker_pod(annotations=ON, labels={"epguard.io/opt-out": "yes"})
    assert sent_to(opted_out, OPTED_IN, config) == []


@pytest.mark.parametrize("hook", [BY_NAMESPACE, BY_ANNOTATION])
def test_no_condition_errors_on_any_object(hook: str) -> None:
    # An error would be decided by failurePolicy (Ignore) instead of by the condition:
    # harmless here, but it would hide a broken expression. Objects of other shapes only
    # meet these conditions if rules and CEL disagree; they must still evaluate.
    (w,) = [w for w in mwc()["webhooks"] if w["name"] == hook]
    objects = [obj for _, _, obj, _ in CASES] + [r[1] for r in ROUTES]
    objects.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"annotations": {}}})
    for obj in objects:
        for cond in w["matchConditions"]:
            evaluate(cond["expression"], obj)
