"""Image references: normalization per the distribution reference grammar, and fuzzing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epguard.webhook.engine.imageref import ImageRef, ImageRefError, normalize_pattern, parse

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("written", "normalized"),
    [
        ("ubuntu", "docker.io/library/ubuntu:latest"),
        ("ubuntu:22.04", "docker.io/library/ubuntu:22.04"),
        ("lmsysorg/sglang:v1", "docker.io/lmsysorg/sglang:v1"),
        ("lmsysorg/sglang", "docker.io/lmsysorg/sglang:latest"),
        ("docker.io/lmsysorg/sglang:v1", "docker.io/lmsysorg/sglang:v1"),
        ("index.docker.io/lmsysorg/sglang:v1", "docker.io/lmsysorg/sglang:v1"),
        ("docker.io/ubuntu", "docker.io/library/ubuntu:latest"),
        (
            "nvcr.io/nvidia/ai-dynamo/sglang-runtime:1.6.1",
            "nvcr.io/nvidia/ai-dynamo/sglang-runtime:1.6.1",
        ),
        ("localhost/x", "localhost/x:latest"),
        ("localhost:5000/ml/sglang:v0.5.16", "localhost:5000/ml/sglang:v0.5.16"),
        ("registry:5000/sglang", "registry:5000/sglang:latest"),
        ("[::1]:5000/a/b:c", "[::1]:5000/a/b:c"),
        (f"lmsysorg/sglang@{DIGEST}", f"docker.io/lmsysorg/sglang@{DIGEST}"),
        (f"lmsysorg/sglang:v1@{DIGEST}", f"docker.io/lmsysorg/sglang:v1@{DIGEST}"),
        ("a/b__c/d-e--f.g:T_a.g-1", "docker.io/a/b__c/d-e--f.g:T_a.g-1"),
        ("  lmsysorg/sglang:v1  ", "docker.io/lmsysorg/sglang:v1"),
        # One registry however its host is written (the runtime keeps the spelling but
        # pulls the same bytes): no case, no HTTPS port, Docker Hub's other names.
        ("NVCR.IO/nvidia/sglang:1.6.1", "nvcr.io/nvidia/sglang:1.6.1"),
        ("nvcr.io:443/nvidia/sglang:1.6.1", "nvcr.io/nvidia/sglang:1.6.1"),
        ("Registry-1.Docker.IO/lmsysorg/sglang:v1", "docker.io/lmsysorg/sglang:v1"),
        ("registry-1.docker.io:443/library/ubuntu", "docker.io/library/ubuntu:latest"),
        ("localhost:5443/x", "localhost:5443/x:latest"),
    ],
)
def test_normalizes_like_the_container_runtime(written: str, normalized: str) -> None:
    assert str(parse(written)) == normalized


def test_keeps_no_tag_for_a_digest_only_reference() -> None:
    ref = parse(f"lmsysorg/sglang@{DIGEST}")
    assert ref.tag is None and ref.digest == DIGEST
    assert ref.name_tag == "docker.io/lmsysorg/sglang"


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "   ",
        "lmsysorg/SGLang",
        "lmsysorg/sglang:",
        "lmsysorg/sglang@",
        "lmsysorg/sglang@sha256:abc",
        "lmsysorg/sglang@sha256:" + "g" * 64,
        "lmsysorg//sglang",
        "lmsysorg/sglang:-bad",
        "lmsysorg/sglang:" + "a" * 129,
        "\u212aube.io/x:1",  # a Kelvin sign lower-cases to "k": still not a host name
        "a/" * 200 + "b",
        "-x/y",
        "x/y:tag:more",
        "http://x/y",
        "x y",
    ],
)
def test_rejects_malformed_references_with_an_error_not_a_crash(bad: str) -> None:
    with pytest.raises(ImageRefError):
        parse(bad)


@pytest.mark.parametrize(
    ("pattern", "normalized"),
    [
        ("lmsysorg/sglang:v0.5.23*", "docker.io/lmsysorg/sglang:v0.5.23*"),
        ("ubuntu:*", "docker.io/library/ubuntu:*"),
        ("docker.io/lmsysorg/sglang:*", "docker.io/lmsysorg/sglang:*"),
        ("index.docker.io/a/b:*", "docker.io/a/b:*"),
        ("NVCR.IO:443/nvidia/*", "nvcr.io/nvidia/*"),
        ("registry-1.docker.io/a/b:*", "docker.io/a/b:*"),
        ("nvcr.io/nvidia/*", "nvcr.io/nvidia/*"),
        ("*/sglang:*", "*/sglang:*"),
    ],
)
def test_normalizes_rule_globs_with_the_same_domain_rule(pattern: str, normalized: str) -> None:
    assert normalize_pattern(pattern) == normalized


# No dots: a dotted first component would (rightly) be read as a registry host.
component = st.from_regex(r"[a-z0-9]+(?:(?:_|__|-+)[a-z0-9]+){0,2}", fullmatch=True)
tags = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
hosts = st.sampled_from(
    ["", "docker.io/", "index.docker.io/", "nvcr.io/", "localhost:5000/", "r.example.com/"]
)


@settings(max_examples=300, deadline=None)
@given(
    host=hosts,
    path=st.lists(component, min_size=1, max_size=3),
    tag=st.none() | tags,
    digest=st.none() | st.binary(min_size=32, max_size=32).map(lambda b: "sha256:" + b.hex()),
)
def test_parses_every_valid_reference_and_is_idempotent(
    host: str, path: list[str], tag: str | None, digest: str | None
) -> None:
    written = host + "/".join(path) + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
    ref = parse(written)
    assert isinstance(ref, ImageRef)
    assert ref.digest == digest
    assert ref.tag == (tag if tag else (None if digest else "latest"))
    assert parse(str(ref)) == ref  # normalizing twice changes nothing


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_never_raises_anything_but_imagereferror(text: str) -> None:
    try:
        ref = parse(text)
    except ImageRefError:
        return
    assert str(ref).startswith(ref.domain + "/")
