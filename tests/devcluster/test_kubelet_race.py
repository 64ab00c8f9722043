"""The node restarts a kubelet that died of kubelet v1.35.4's own start-up data race
(once), and no other death: a pure check of the dead process's log."""

from __future__ import annotations

from pathlib import Path

from devcluster.node import _kubelet_race
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


def test_the_kubelets_start_up_race_is_recognised_under_its_stack_dump(tmp_path: Path) -> None:
    assert _kubelet_race(_dead(tmp_path, "kubelet", RACE))


def test_any_other_death_is_not_retried(tmp_path: Path) -> None:
    assert not _kubelet_race(_dead(tmp_path, "containerd", RACE))
    assert not _kubelet_race(_dead(tmp_path, "kubelet", ["E1203 failed to run Kubelet: x"]))
