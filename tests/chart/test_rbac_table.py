"""The chart's RBAC, verb by verb, against the written least-privilege table
(docs/rbac.md): every rendered grant has a row with a reason, and every row is granted."""

from __future__ import annotations

from tests.chart.chartlib import CHART, REPO, Rendered, render

Grant = tuple[str, str, str, str, str, str]  # account, scope, group, resource, names, verb


def table(which: str = "") -> tuple[set[Grant], list[str]]:
    """The grants of one table in docs/rbac.md: the default one, or ``which``."""
    text = (REPO / "docs" / "rbac.md").read_text()
    start = f"<!-- rbac-table {which} -->" if which else "<!-- rbac-table -->"
    body = text.split(start, 1)[1].split("<!-- /rbac-table -->", 1)[0]
    grants: set[Grant] = set()
    unexplained: list[str] = []
    for line in body.strip().splitlines()[2:]:  # after the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        account, scope, group, resource, names, verbs, why = cells
        if not why:
            unexplained.append(line)
        for verb in verbs.split(", "):
            grants.add((account, scope, group, resource, names, verb))
    return grants, unexplained


def rendered(r: Rendered) -> set[Grant]:
    out: set[Grant] = set()
    for scope in ("Role", "ClusterRole"):
        for role in r.all(scope):
            for rule in role["rules"]:
                names = ", ".join(rule.get("resourceNames", [])) or "any"
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            out.add(
                                (
                                    role["metadata"]["name"],
                                    scope,
                                    group or "core",
                                    resource,
                                    names,
                                    verb,
                                )
                            )
    return out


def test_every_grant_is_in_the_written_table(defaults: Rendered) -> None:
    written, _ = table()
    extra = sorted(rendered(defaults) - written)
    assert not extra, f"granted but not in docs/rbac.md: {extra}"


def test_every_row_of_the_table_is_granted(defaults: Rendered) -> None:
    written, _ = table()
    missing = sorted(written - rendered(defaults))
    assert not missing, f"in docs/rbac.md but not granted: {missing}"


def test_every_row_says_why() -> None:
    for which in ("", "scan-recorder"):
        _, unexplained = table(which)
        assert not unexplained, which


def test_the_scan_recorder_grants_exactly_its_written_table(defaults: Rendered) -> None:
    with_recorder = render("-f", str(CHART / "ci" / "scan-recorder-values.yaml"))
    added = rendered(with_recorder) - rendered(defaults)
    assert rendered(defaults) <= rendered(with_recorder)
    written, _ = table("scan-recorder")
    assert added == written, (sorted(added - written), sorted(written - added))


def test_only_the_preflight_writes_pods_and_no_one_reads_other_secrets(
    defaults: Rendered,
) -> None:
    grants = rendered(defaults)
    pod_writes = {
        (g[0], g[3], g[5])
        for g in grants
        if g[3] in ("pods", "pods/status") and g[5] not in ("get", "list", "watch")
    }
    assert pod_writes == {
        ("epguard-controller", "pods", "create"),
        ("epguard-controller", "pods", "delete"),
        ("epguard-controller", "pods", "patch"),
        ("epguard-controller", "pods/status", "patch"),
    }
    # ... and only together with the policy that holds the controller to the gate.
    policy = next(
        o
        for o in defaults.objects
        if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] == "epguard-preflight"
    )
    (condition,) = policy["spec"]["matchConditions"]
    assert "system:serviceaccount:epguard-system:epguard-controller" in condition["expression"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    binding = next(
        o
        for o in defaults.objects
        if o["kind"] == "ValidatingAdmissionPolicyBinding"
        and o["spec"]["policyName"] == "epguard-preflight"
    )
    assert binding["spec"]["validationActions"] == ["Deny"]
    secret_reads = {g[4] for g in grants if g[3] == "secrets" and g[5] != "create"}
    assert secret_reads == {"epguard-probe-key", "epguard-tls"}


def test_without_injection_nothing_writes_pods() -> None:
    off = render("--set", "injection.enabled=false", name="no-injection")
    assert not {
        g for g in rendered(off) if g[3].startswith("pods") and g[5] not in ("get", "list", "watch")
    }
    assert not [
        o for o in off.objects if o["metadata"]["name"] == "epguard-preflight"
    ]


def test_the_owner_kinds_the_controller_follows_are_the_ones_it_may_get(
    defaults: Rendered,
) -> None:
    """owners.FOLLOWED (what the owner walk reads) and the chart's grants of ``get`` to the
    controller name the same kinds: one more followed would read what RBAC refuses; one
    more granted would be a right nothing uses."""
    from epguard.webhook.controller.owners import FOLLOWED

    granted = {
        (group, resource)
        for account, _, group, resource, names, verb in rendered(defaults)
        if account == "epguard-controller" and verb == "get" and names == "any"
        and group in {g for g, _ in FOLLOWED}
    }  # fmt: skip
    assert granted == {(group, kind.lower() + "s") for group, kind in FOLLOWED}
