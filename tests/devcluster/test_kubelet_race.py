"""The node restarts a kubelet that died of kubelet v1.35.4's own start-up data race
(once) or of containerd's CRI not yet initialized, and no other death: a pure check of
the dead process's log."""

from __future__ import annotations

from pathlib import Path

from devcluster.node import CRI_NOT_READY, KUBELET_RACE, _kubelet_transient
from devcluster.process import ManagedProcess

RACE = [
    'I1203 23:47:59.705765   29758 policy_none.go:44] "Start"',
    "fatal error: concurrent map iteration and map write",
    "",
    "goroutine 411 [running]:",
    *(f"\tframe {i}" for i in range(150)),  # the dump after it is long
]


def _dead(tmp_path: Path, name: str, lines: list[str]) -> ManagedProcess:
    log = tmp_path / f"{name}.log"
    log.write_text("\n".join(lines) + "\n")
    return ManagedProcess(name=name, pid=1, argv=[name], log=str(log), start_time=None)


# The last lines of the kubelet that died in CI run 98 (containerd 2.4.2, kubelet v1.35.4).
CRI = [
    'I1206 13:33:55.853721     840 dynamic_cafile_content.go:161] "Starting controller"',
    'E1206 13:33:55.856026     840 run.go:72] "command failed" err="failed to run Kubelet: '
    "validate service connection: validate CRI v1 runtime API for endpoint "
    '\\"unix:///run/epguard-containerd/containerd.sock\\": rpc error: code = Unavailable '
    'desc = server is not initialized yet: unavailable"',
]


def test_the_kubelets_start_up_race_is_recognised_under_its_stack_dump(tmp_path: Path) -> None:
    assert _kubelet_transient(_dead(tmp_path, "kubelet", RACE)) == KUBELET_RACE


def test_a_cri_not_yet_initialized_is_recognised(tmp_path: Path) -> None:
    assert _kubelet_transient(_dead(tmp_path, "kubelet", CRI)) == CRI_NOT_READY


def test_only_what_the_last_start_wrote_counts(tmp_path: Path) -> None:
    # The log is appended to by each start: an earlier start's race dump or CRI error is
    # not the reason a later start died.
    proc = _dead(tmp_path, "kubelet", [*RACE, *CRI])
    since = Path(proc.log).stat().st_size
    assert _kubelet_transient(proc, since) is None  # nothing written since
    with open(proc.log, "a") as log:
        log.write("\n".join(CRI) + "\n")
    assert _kubelet_transient(proc, since) == CRI_NOT_READY  # not the race above it
    since = Path(proc.log).stat().st_size
    with open(proc.log, "a") as log:
        log.write('I1206 13:33:57.1 server.go:525] "Kubelet version"\nE1206 x\n')
    assert _kubelet_transient(proc, since) is None


def test_any_other_death_is_not_retried(tmp_path: Path) -> None:
    assert _kubelet_transient(_dead(tmp_path, "containerd", RACE)) is None
    assert _kubelet_transient(_dead(tmp_path, "containerd", CRI)) is None
    other = ["E1203 failed to run Kubelet: x"]
    assert _kubelet_transient(_dead(tmp_path, "kubelet", other)) is None
