"""Public SGLang manifests and command lines, read at test time from the shared folder
(never copied into the repository): ``../shared/real-manifests`` beside the checkout, or
``$EPGUARD_REAL_MANIFESTS``. ``INDEX.tsv`` labels each YAML file; ``argv-real.labels.tsv``
labels each line of ``argv-real.txt``. Tests that need them skip where they are absent.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(
    os.environ.get(
        "EPGUARD_REAL_MANIFESTS",
        Path(__file__).resolve().parents[1].parent / "shared" / "real-manifests",
    )
)
# Placeholders (envsubst ${VAR}, doc <image>) stand for an image; give them a real one.
CONCRETE_IMAGE = "registry.example.com/ml/sglang:0.5.23-mte0.3.13"
_PLACEHOLDER_IMAGE = re.compile(r"^(\$\{[^}]*\}|<[^>]*>)$")


@dataclass(frozen=True)
class Manifest:
    file: str
    kinds: str
    requests_mooncake: bool
    documents: tuple[Any, ...]


@dataclass(frozen=True)
class CommandLine:
    line: int
    text: str
    requests_mooncake: bool
    form: str


def available() -> bool:
    return (ROOT / "INDEX.tsv").is_file()


def require() -> None:
    if not available():
        pytest.skip(f"real manifests not found at {ROOT} (set EPGUARD_REAL_MANIFESTS)")


def _concrete(value: Any) -> Any:
    """Replace placeholder image references with a concrete image, everywhere."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "image" and isinstance(v, str) and (_PLACEHOLDER_IMAGE.match(v) or "${" in v):
                out[k] = CONCRETE_IMAGE
            else:
                out[k] = _concrete(v)
        return out
    if isinstance(value, list):
        return [_concrete(v) for v in value]
    return value


def manifests() -> list[Manifest]:
    if not available():
        return []
    out = []
    with open(ROOT / "INDEX.tsv", newline="") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            text = (ROOT / row["file"]).read_text()
            docs = tuple(_concrete(d) for d in yaml.safe_load_all(text) if d)
            out.append(
                Manifest(
                    file=row["file"],
                    kinds=row["kinds"],
                    requests_mooncake=row["requests_elastic_ep_mooncake"].startswith("yes"),
                    documents=docs,
                )
            )
    return out


def command_lines() -> list[CommandLine]:
    if not available():
        return []
    texts = (ROOT / "argv-real.txt").read_text().splitlines()
    out = []
    with open(ROOT / "argv-real.labels.tsv", newline="") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            n = int(row["line"])
            out.append(
                CommandLine(
                    line=n,
                    text=texts[n - 1].split("\t", 1)[0],
                    requests_mooncake=row["elastic_ep_mooncake"].startswith("yes"),
                    form=row["form"],
                )
            )
    return out
