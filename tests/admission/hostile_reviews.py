"""Hostile AdmissionReviews for the HTTP side (issue 21, points 4-6), shared by
test_unjudged_by_mode.py and bench/hostile_bench.py."""

from __future__ import annotations

import json
from typing import Any

from tests.factory import BAD_IMAGE, GOOD_IMAGE, container, pod, review


def escaped(obj: Any) -> bytes:
    """JSON as the API server writes it: Go escapes <, > and & as \\u003c…"""
    text = json.dumps(obj)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


def rules_configmap(size: int = 1024 * 1024) -> dict[str, Any]:
    """The release's rules ConfigMap with up to ``size`` bytes of valid rules (a
    ConfigMap holds at most 1 MiB; parsing 1 MiB of rules takes ~1.3 s and ~50 MiB)."""
    rules = []
    total = len("rules:\n")
    n = 0
    while True:
        rule = (
            f'  - id: r{n}\n    image: "docker.io/x/y{n}:*"\n    reason: "{"z" * 40}"\n'
            f'    remedy: "none"\n'
        )
        if total + len(rule) > size:
            break
        rules.append(rule)
        total += len(rule)
        n += 1
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "epguard-rules", "namespace": "epguard-system"},
        "data": {"rules.yaml": "rules:\n" + "".join(rules)},
    }


def rules_edit_review(size: int = 1024 * 1024) -> bytes:
    cm = rules_configmap(size)
    edit = review(cm, operation="UPDATE", namespace="epguard-system", old=cm)
    edit["request"]["name"] = cm["metadata"]["name"]  # as the API server sends it
    return json.dumps(edit).encode()


def large_bad_pod_review(pad: int = 80 * 1024) -> bytes:
    """A pod on an image the test rules refuse, over 64 KiB (judged off the loop)."""
    return json.dumps(review(pod(annotations={"pad": "x" * pad}))).encode()


def image_swap_update(angles: int = 1_200_000) -> bytes:
    """An UPDATE that swaps the worker from a good image to a refused one, with
    ``angles`` of '<' in each of the old and the new object: 13.7 MiB as the API server
    escapes it (6 bytes a '<'), over the 7 MiB the webhook once took."""
    pad = {"pad": "<" * angles}
    old = pod([container(image=GOOD_IMAGE)], annotations=pad)
    new = pod([container(image=BAD_IMAGE)], annotations=pad)
    return escaped(review(new, operation="UPDATE", old=old))
