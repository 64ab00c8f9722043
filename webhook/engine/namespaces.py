"""Per-namespace settings read from Namespace labels, held in memory.

``epguard.io/mode: enforce|warn|audit`` overrides the global mode for one
namespace (a team can trial epguard in ``warn`` before it enforces), and
``epguard.io/inject: enabled`` says the probe is injected there, so a missing
probe init container in a workload template is not worth a warning, and
``epguard.io/preflight: gate|off`` overrides the chart's ``preflight.mode`` there
(engine/preflight.py).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

Mode = Literal["enforce", "warn", "audit"]
MODES: tuple[Mode, ...] = ("enforce", "warn", "audit")
MODE_LABEL = "epguard.io/mode"
# The injection opt-in: a label on a Namespace, or an annotation on a pod (template).
INJECT_KEY = "epguard.io/inject"
INJECT_ON = frozenset({"enabled", "true"})
# Whether /mutate gates a worker on an unjudged image until a preflight judged it.
PreflightMode = Literal["gate", "off"]
PREFLIGHT_MODES: tuple[PreflightMode, ...] = ("gate", "off")
PREFLIGHT_KEY = "epguard.io/preflight"


def opts_in(value: Any) -> bool:
    """Whether a label or annotation value under ``INJECT_KEY`` turns injection on: exactly
    as written in INJECT_ON, as the chart's namespaceSelector and CEL compare it (the API
    server sends /mutate nothing else). Read loosely here (`Enabled`), /validate said "the
    probe checks it when the pod starts" of a pod /mutate never saw, and kept back the
    warning that it has no probe."""
    return isinstance(value, str) and value in INJECT_ON


def parse_mode(value: Any) -> Mode | None:
    if isinstance(value, str) and value.strip().lower() in MODES:
        return cast(Mode, value.strip().lower())
    return None


def parse_preflight(value: Any) -> PreflightMode | None:
    if isinstance(value, str) and value.strip().lower() in PREFLIGHT_MODES:
        return cast(PreflightMode, value.strip().lower())
    return None


@dataclass(frozen=True, slots=True)
class NamespaceSettings:
    mode: Mode | None = None
    inject: bool = False
    preflight: PreflightMode | None = None
    # A label value we could not use, kept so the watch can log it once.
    bad_mode: str | None = None

    @property
    def says_anything(self) -> bool:
        return self.mode is not None or self.inject or self.preflight is not None


def settings_from_labels(labels: Any) -> NamespaceSettings:
    if not isinstance(labels, Mapping):
        return NamespaceSettings()
    raw_mode = labels.get(MODE_LABEL)
    mode = parse_mode(raw_mode)
    return NamespaceSettings(
        mode=mode,
        inject=opts_in(labels.get(INJECT_KEY)),
        preflight=parse_preflight(labels.get(PREFLIGHT_KEY)),
        bad_mode=raw_mode if isinstance(raw_mode, str) and mode is None else None,
    )


class NamespaceIndex:
    """Only namespaces that carry an epguard label are kept; the rest use defaults."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._settings: dict[str, NamespaceSettings] = {}

    def __len__(self) -> int:
        return len(self._settings)

    def get(self, namespace: str | None) -> NamespaceSettings:
        if not namespace:
            return NamespaceSettings()
        return self._settings.get(namespace) or NamespaceSettings()

    def upsert(self, name: str, labels: Any) -> NamespaceSettings:
        s = settings_from_labels(labels)
        with self._lock:
            if not s.says_anything:
                self._settings.pop(name, None)
            else:
                self._settings[name] = s
        return s

    def delete(self, name: str) -> None:
        with self._lock:
            self._settings.pop(name, None)

    def replace(self, labels_by_name: Mapping[str, Any]) -> None:
        fresh = {n: settings_from_labels(lbl) for n, lbl in labels_by_name.items()}
        with self._lock:
            self._settings = {n: s for n, s in fresh.items() if s.says_anything}
