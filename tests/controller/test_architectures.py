"""When a probe may teach a verdict for every node, and what the sweep forgets
(webhook/controller/architectures.py), against in-memory nodes and verdicts. The label
selectors themselves are checked through a real API server in
tests/e2e/test_controller_resilience.py."""

from __future__ import annotations

import pytest

from epguard.webhook.controller.architectures import placement, sweep_once


class Nodes:
    """Nodes by name → their kubernetes.io/arch label (None: unlabelled; "": the label
    with an empty value), as the selectors ``arch`` and ``arch,arch!=X`` list them
    (unlabelled nodes never), first by name."""

    def __init__(self, **nodes: str | None) -> None:
        self.nodes = dict(nodes)
        self.broken = False

    def architecture_of(self, node: str) -> str | None:
        if self.broken:
            raise ConnectionResetError("dropped")
        return self.nodes.get(node)

    def other_than(self, architecture: str | None) -> tuple[str, str] | None:
        if self.broken:
            raise ConnectionResetError("dropped")
        labelled = sorted((n, a) for n, a in self.nodes.items() if a is not None)
        return next(((n, a) for n, a in labelled if a != architecture), None)


class Verdicts:
    """Probe-taught verdicts by name → their architecture label (None: none), as the
    selector ``managed-by`` (all) or ``managed-by,arch,arch!=X`` lists them."""

    def __init__(self, **taught: str | None) -> None:
        self.taught_on = dict(taught)
        self.listed: list[str | None] = []

    def taught(self, off: str | None) -> list[tuple[str, str]]:
        self.listed.append(off)
        return [(n, "7") for n, a in sorted(self.taught_on.items())
                if off is None or (a is not None and a != off)]  # fmt: skip

    def delete(self, name: str, version: str) -> None:
        assert version == "7"
        self.taught_on.pop(name, None)


def test_one_architecture_teaches_and_records_it() -> None:
    where = placement(Nodes(gpu1="amd64", gpu2="amd64", virtual=None), "gpu1")
    assert (where.architecture, where.refusal) == ("amd64", None)


@pytest.mark.parametrize(
    ("node", "said"),
    [
        (None, "names no node"),
        ("gone", "has no readable kubernetes.io/arch label"),
        ("virtual", "has no readable kubernetes.io/arch label"),
        ("gh200", "more than one architecture (gh200 is arm64, gpu1 is amd64)"),
        ("gpu1", "more than one architecture (gpu1 is amd64, gh200 is arm64)"),
    ],
)
def test_without_one_architecture_nothing_is_taught(node: str | None, said: str) -> None:
    where = placement(Nodes(gpu1="amd64", gh200="arm64", virtual=None), node)
    assert where.refusal is not None and said in where.refusal


def test_a_declared_architecture_teaches_whatever_nodes_come_and_go() -> None:
    """A tenant who brings up a node of another architecture changes nothing; its probes
    there teach nothing."""
    nodes = Nodes(gpu1="amd64", gh200="arm64")
    assert placement(nodes, "gpu1", ("amd64",)).refusal is None
    refused = placement(nodes, "gh200", ("amd64",)).refusal
    assert refused is not None and "gh200 is arm64, not amd64" in refused
    two = placement(nodes, "gpu1", ("amd64", "arm64")).refusal
    assert two is not None and "declares amd64, arm64" in two


def test_nodes_that_cannot_be_read_teach_nothing() -> None:
    nodes = Nodes(gpu1="amd64")
    nodes.broken = True
    where = placement(nodes, "gpu1")
    assert where.refusal == "the nodes could not be read (ConnectionResetError)"


def test_a_second_architecture_forgets_every_verdict_probes_taught() -> None:
    verdicts = Verdicts(a="amd64", legacy=None)
    assert sweep_once(Nodes(gpu1="amd64", virtual=None), verdicts) == 0
    assert sweep_once(Nodes(gpu1="amd64", gh200="arm64"), verdicts) == 2
    assert verdicts.taught_on == {}


def test_one_architecture_forgets_only_what_was_taught_on_another() -> None:
    """A cluster that moved from one architecture to another between two checks. Each
    check lists by the architecture label only what another architecture taught."""
    verdicts = Verdicts(old="arm64", new="amd64", legacy=None)
    assert sweep_once(Nodes(gpu1="amd64"), verdicts) == 1
    assert sorted(verdicts.taught_on) == ["legacy", "new"]
    assert verdicts.listed == ["amd64"]
    assert sweep_once(Nodes(), verdicts) == 0  # no labelled node: nothing said
    assert verdicts.listed == ["amd64"]  # and nothing listed


def test_a_node_whose_label_is_empty_is_another_architecture() -> None:
    """Listed first by name, an empty kubernetes.io/arch must not read as "nothing else":
    probes do not teach, and the sweep forgets nothing on its word."""
    nodes = Nodes(**{"0-empty": "", "gpu1": "amd64"})
    refused = placement(nodes, "gpu1").refusal
    assert refused is not None and "0-empty is " in refused
    assert sweep_once(Nodes(**{"0-empty": ""}), Verdicts(a="amd64")) == 0


def test_a_declared_architecture_ignores_the_nodes() -> None:
    verdicts = Verdicts(a="amd64", b="arm64")
    assert sweep_once(Nodes(gpu1="amd64", gh200="arm64"), verdicts, ("amd64",)) == 1
    assert list(verdicts.taught_on) == ["a"]
    assert sweep_once(Nodes(gpu1="amd64"), verdicts, ("amd64", "arm64")) == 1
    assert verdicts.taught_on == {}
