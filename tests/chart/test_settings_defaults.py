"""The chart's defaults are the settings' defaults: each is defined once in
``webhook.settings`` and values.yaml says the same, and both components take one
spelling of the log level."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
import yaml

from epguard.webhook.settings import (
    CONTROLLER_OPTIONS,
    LOG_LEVEL,
    LOG_LEVELS,
    WEBHOOK_OPTIONS,
    Option,
)
from tests.chart.chartlib import CHART

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def _value(path: str) -> Any:
    node: Any = VALUES
    for part in path.split("."):
        node = node[part]
    return node


def _plain(value: Any) -> Any:
    if isinstance(value, dt.timedelta):
        return value.total_seconds() / 3600
    if isinstance(value, tuple):
        return list(value)
    return value


CHARTED = [
    o
    for o in dict.fromkeys((*WEBHOOK_OPTIONS, *CONTROLLER_OPTIONS))
    if o.chart and o is not LOG_LEVEL
]


@pytest.mark.parametrize("option", CHARTED, ids=lambda o: o.env)
def test_the_charts_default_is_the_settings_default(option: Option) -> None:
    assert option.chart is not None
    assert _plain(option.default) == _value(option.chart)


@pytest.mark.parametrize("component", ["webhook", "controller"])
def test_both_components_spell_the_log_level_alike(component: str) -> None:
    assert VALUES[component]["logLevel"] == LOG_LEVEL.default
    enum = SCHEMA["properties"][component]["properties"]["logLevel"]["enum"]
    assert enum == list(LOG_LEVELS)
