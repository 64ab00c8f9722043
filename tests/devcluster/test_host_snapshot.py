"""What the host check of ``make down`` compares (devcluster/node.py host_snapshot):
iptables tables that filter nothing count as absent. The check itself, on the real node:
tests/devcluster/test_up_down.py."""

from __future__ import annotations

from devcluster.node import without_empty_tables

EMPTY_NAT = ["*nat", ":PREROUTING ACCEPT", ":INPUT ACCEPT", ":OUTPUT ACCEPT",
             ":POSTROUTING ACCEPT", "COMMIT"]  # fmt: skip


def test_a_table_with_only_accepting_built_in_chains_is_as_if_absent() -> None:
    # What a fresh kernel shows after the first node start: empty tables, never unloaded.
    assert without_empty_tables([*EMPTY_NAT, "*filter", ":INPUT ACCEPT", "COMMIT"]) == []


def test_a_rule_a_chain_of_its_own_or_a_policy_keeps_the_table() -> None:
    rule = ["*nat", ":PREROUTING ACCEPT", "-A PREROUTING -j KUBE-SERVICES", "COMMIT"]
    chain = ["*nat", ":PREROUTING ACCEPT", ":KUBE-SERVICES -", "COMMIT"]
    policy = ["*filter", ":INPUT ACCEPT", ":FORWARD DROP", "COMMIT"]
    for table in (rule, chain, policy):
        assert without_empty_tables(EMPTY_NAT + table) == table
    assert without_empty_tables(rule + EMPTY_NAT + policy) == rule + policy


def test_a_cut_listing_is_kept_as_it_is() -> None:
    assert without_empty_tables(["*nat", ":PREROUTING ACCEPT"]) == ["*nat", ":PREROUTING ACCEPT"]
