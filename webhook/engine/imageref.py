"""Container image references, normalized the way the container runtime reads them.

This follows the distribution/reference grammar (the one ``docker pull`` and
containerd use) and docker's normalization: ``lmsysorg/sglang:v1`` is
``docker.io/lmsysorg/sglang:v1``, ``ubuntu`` is ``docker.io/library/ubuntu:latest``.
Rules are globs over the normalized ``name:tag``, so two spellings of one image
must come out identical. A malformed reference raises ``ImageRefError``; it
never crashes the caller.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

DEFAULT_DOMAIN = "docker.io"
LEGACY_DEFAULT_DOMAIN = "index.docker.io"
HUB_REGISTRY_DOMAIN = "registry-1.docker.io"  # where Docker Hub's API answers
# Docker Hub's names, each read as DEFAULT_DOMAIN (controller/compiler.py's CEL too).
HUB_NAMES = (DEFAULT_DOMAIN, LEGACY_DEFAULT_DOMAIN, HUB_REGISTRY_DOMAIN)
OFFICIAL_REPO_PREFIX = "library/"
MAX_NAME_LENGTH = 255

_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_IPV6 = r"\[(?:[a-fA-F0-9:]+)\]"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|{_IPV6})"
_DOMAIN = rf"{_HOST}(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"

_REFERENCE = re.compile(
    rf"^(?P<name>(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?"
    rf"(?:@(?P<digest>{_DIGEST}))?$"
)
_DOMAIN_ONLY = re.compile(rf"^{_DOMAIN}$")
_SHA256 = re.compile(r"^sha256:[0-9a-f]{64}$")


class ImageRefError(ValueError):
    """The string is not a valid image reference."""


@dataclass(frozen=True, slots=True)
class ImageRef:
    domain: str
    path: str
    tag: str | None
    digest: str | None

    @property
    def name(self) -> str:
        return f"{self.domain}/{self.path}"

    @property
    def name_tag(self) -> str:
        """What rule globs match: ``name:tag``, or just ``name`` when pinned by digest only."""
        return f"{self.name}:{self.tag}" if self.tag is not None else self.name

    def __str__(self) -> str:
        return self.name_tag + (f"@{self.digest}" if self.digest else "")


def _host(domain: str) -> str:
    """One registry, however its host is written: DNS names carry no case, 443 is the
    port HTTPS takes anyway, and Docker Hub answers under three names. The runtime keeps
    each spelling as its own name, but pulls the same bytes from the same registry, so a
    rule or a tag's verdict for one spelling holds for every other
    (``NVCR.IO/nvidia/...:1.6.1`` escaped a rule for ``nvcr.io/nvidia/...:1.6.*``). A
    non-ASCII host is left for the grammar to refuse, as the backstop's CEL does."""
    if domain.isascii():
        domain = domain.lower().removesuffix(":443")
    return DEFAULT_DOMAIN if domain in HUB_NAMES else domain


def spelt_as_the_runtime_names(reference: str) -> bool:
    """Whether the runtime pulls ``reference`` under the registry name :func:`parse` gives
    it. containerd and CRI-O fold only ``index.docker.io`` into ``docker.io``: every other
    spelling (``NVCR.IO``, ``nvcr.io:443``, ``registry-1.docker.io``) is a host of its own
    to them, with mirrors and rewrites of its own (``certs.d/<host>``), so its pull may get
    other bytes under the same tag. A tag's verdict is learnt only from a pull spelt as
    the runtime names it; any other answers for its digest alone (review helper)."""
    first, sep, _ = reference.strip().partition("/")
    if not (
        sep and ("." in first or ":" in first or first == "localhost" or first.lower() != first)
    ):
        return True  # no registry named: the runtime's own default
    return first in (DEFAULT_DOMAIN, LEGACY_DEFAULT_DOMAIN) or (
        first not in HUB_NAMES and _host(first) == first
    )


def _split_domain(name: str) -> tuple[str, str]:
    # docker's rule: the first component is a registry host only if it looks like
    # one (has a dot or a port, is "localhost", or has upper case letters, which a
    # repository path may not).
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost" or first.lower() != first):
        domain, remainder = first, rest
    else:
        domain, remainder = DEFAULT_DOMAIN, name
    domain = _host(domain)
    if domain == DEFAULT_DOMAIN and "/" not in remainder:
        remainder = OFFICIAL_REPO_PREFIX + remainder
    return domain, remainder


@lru_cache(maxsize=4096)
def parse(reference: str) -> ImageRef:
    """Parse and normalize; no tag and no digest means ``latest``, a digest is kept."""
    if not isinstance(reference, str):
        raise ImageRefError(f"image reference must be a string, not {type(reference).__name__}")
    ref = reference.strip()
    if not ref:
        raise ImageRefError("image reference is empty")
    if len(ref) > 4096:
        raise ImageRefError("image reference is too long")
    # Split off tag and digest before deciding the domain, so "host:5000/x" keeps its port.
    name_part, at, digest = ref.partition("@")
    if at and not digest:
        raise ImageRefError(f"invalid reference {ref!r}: empty digest")
    last_slash = name_part.rfind("/")
    colon = name_part.rfind(":")
    if colon > last_slash:
        name, tag = name_part[:colon], name_part[colon + 1 :]
        if not tag:
            raise ImageRefError(f"invalid reference {ref!r}: empty tag")
    else:
        name, tag = name_part, ""
    domain, path = _split_domain(name)
    if not _DOMAIN_ONLY.match(domain):
        raise ImageRefError(f"invalid reference {ref!r}: bad registry host {domain!r}")
    if path != path.lower():
        raise ImageRefError(f"invalid reference {ref!r}: repository name must be lowercase")
    candidate = f"{domain}/{path}" + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
    m = _REFERENCE.match(candidate)
    if m is None:
        raise ImageRefError(f"invalid reference format: {ref!r}")
    if len(m.group("name")) > MAX_NAME_LENGTH:
        raise ImageRefError(f"invalid reference {ref!r}: repository name longer than 255")
    if digest and digest.startswith("sha256:") and not _SHA256.match(digest):
        raise ImageRefError(f"invalid reference {ref!r}: a sha256 digest is 64 lower-case hex")
    return ImageRef(
        domain=domain,
        path=path,
        tag=tag or (None if digest else "latest"),
        digest=digest or None,
    )


def normalize_pattern(pattern: str) -> str:
    """Apply the same domain rule to a rule's glob, so admins may write ``lmsysorg/sglang:v1*``.

    Globs cannot go through ``parse`` (``*`` is not in the grammar), so only the
    domain defaulting (with ``library/`` for Docker Hub's one-word names, written with
    or without its host) is applied; a pattern starting with a wildcard is left alone.
    """
    p = pattern.strip()
    if not p or p[0] in "*?[":
        return p
    first, sep, rest = p.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        host = _host(first)
        repository = rest.partition(":")[0]
        if host == DEFAULT_DOMAIN and "/" not in rest and not any(c in repository for c in "*?["):
            rest = OFFICIAL_REPO_PREFIX + rest  # docker.io/sglang:0.5* is library/sglang
        return f"{host}/{rest}"
    if not sep:
        return f"{DEFAULT_DOMAIN}/{OFFICIAL_REPO_PREFIX}{p}"
    return f"{DEFAULT_DOMAIN}/{p}"
