"""A flag the shell assembles from quoted pieces, through the real API server and webhook.

Inside ``sh -c``, ``-''-elastic-ep-backend`` is ``--elastic-ep-backend``: the shell
removes the quotes and joins the pieces. The chart's matchConditions (CEL, evaluated by
the real kube-apiserver) must send such a pod to epguard, and the webhook must read the
flag there, so a pod on a denied image is refused like one that spells the flag plainly.
"""

from __future__ import annotations

import pytest

from devcluster import ControlPlane
from tests.e2e.e2e_kube import (
    BAD_IMAGE,
    DENY_RULE_ID,
    apply,
    denied_by_epguard,
    output,
    pod,
    worker,
)

pytestmark = [pytest.mark.e2e]

LAUNCH = "exec python3 -m sglang.launch_server --model-path /models/m"


@pytest.mark.parametrize(
    "flag", ["-''-elastic-ep-backend mooncake", "-\\-elastic-ep-backend=mooncake"],
    ids=["empty-quotes", "backslash"],
)  # fmt: skip
def test_a_flag_the_shell_joins_from_quoted_pieces_is_refused_on_a_denied_image(
    control_plane: ControlPlane, deny_rule: str, namespace: str, flag: str
) -> None:
    script = f"{LAUNCH} {flag}"
    for name, container in (
        ("in-argv", worker(BAD_IMAGE, command=["sh", "-c", script], args=[])),
        # The script in an env value the kubelet puts in place ($(VAR)).
        ("in-env", worker(BAD_IMAGE, command=["sh", "-c", "$(RUN)"], args=[],
                          env=[{"name": "RUN", "value": script}])),
    ):  # fmt: skip
        r = apply(control_plane, pod(name, namespace, container), dry_run=True)
        assert denied_by_epguard(r) and DENY_RULE_ID in r.stderr, (name, output(r))
