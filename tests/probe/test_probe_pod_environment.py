"""A probe's verdict about the image depends only on the image (issue 21.2).

/mutate hands the worker's variables to the probe renamed under ``EPGUARD_POD_``
(webhook/engine/injection.py), so ``python3`` is found through the image's own PATH and the
image is judged in its own environment. The probe then checks again with the pod's
variables restored: a failure only they cause is this pod's (environment scope, never
learned), a pass only they bring is "usable in this pod" (no verdict about the image).

Here the "image" is this machine's files: the real torch 2.13.0 venv is the image's
interpreter (first on its PATH) and the system ``python3`` (no torch) is the other
interpreter a pod's PATH can pick, as in a venv image built on a Debian base.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from epguard.webhook.engine.outcome import classify
from tests.probe.probe_harness import (
    PG_NAMES,
    REGISTER_BOTH,
    SGLANG_PG,
    clean_env,
    overlay,
    run_probe,
    torch_python,
    write_double,
)

pytestmark = pytest.mark.realpkg

UNUSABLE_HERE = "epguard: mooncake elastic EP is unusable in this pod: "


def system_python3() -> str:
    """A python3 without torch, which the pod's PATH can pick."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        path = Path(candidate)
        if path.exists():
            probe = __import__("subprocess").run(
                [candidate, "-c", "import torch"], capture_output=True, timeout=60
            )
            if probe.returncode != 0:
                return candidate
    pytest.skip("this machine has no python3 without torch to play the other interpreter")


def image(tmp_path: Path) -> list[Path]:
    """PYTHONPATH of an image whose mooncake registers both backends (a test double: a
    healthy mooncake needs a GPU driver) beside a real SGLang."""
    double = write_double(tmp_path / "img", pg=REGISTER_BOTH + PG_NAMES)
    return [double, overlay(SGLANG_PG[0])]


def test_a_path_the_pod_sets_cannot_make_the_image_unusable(tmp_path: Path) -> None:
    other = Path(system_python3()).parent
    env = clean_env(image(tmp_path), EPGUARD_POD_PATH=f"{other}:/bin")
    env["PATH"] = f"{torch_python().parent}:{env.get('PATH', '/usr/bin:/bin')}"
    r = run_probe(tmp_path, python=torch_python(), env=env)
    assert r.rc == 1, r.stderr
    # The pod's PATH picks an interpreter without torch: the pod fails, the image does not.
    assert r.lines[0].startswith(UNUSABLE_HERE), r.message
    assert "PATH" in r.message and "image's own environment: usable" in r.message
    assert r.report is not None and r.report["scope"] == "environment"
    assert classify(r.message, r.rc) == ("Unusable", "environment")


def test_variables_that_change_nothing_leave_the_image_verdict_as_it_is(tmp_path: Path) -> None:
    env = clean_env(image(tmp_path), EPGUARD_POD_NCCL_DEBUG="INFO", EPGUARD_POD_MC_FORCE_TCP="1")
    r = run_probe(tmp_path, python=torch_python(), env=env)
    assert r.rc == 0, r.stderr
    assert r.lines[0].startswith("epguard: mooncake elastic EP is usable: "), r.message
    # A verdict every tenant reads counts the pod's variables; their names (the tenant's
    # text) are only in the report (review helper).
    assert "with the pod's 2 variables" in r.message
    assert "MC_FORCE_TCP" not in r.message and "NCCL_DEBUG" not in r.message
    assert r.report is not None and r.report["pod_variables"] == ["MC_FORCE_TCP", "NCCL_DEBUG"]
    assert classify(r.message, r.rc) == ("Usable", None)


def test_a_pass_only_the_pods_path_brings_is_not_a_verdict_about_the_image(
    tmp_path: Path,
) -> None:
    """The image's own interpreter has no torch; the pod's PATH picks one that has."""
    other = system_python3()
    bin_dir = tmp_path / "image-bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(other)
    env = clean_env(image(tmp_path), EPGUARD_POD_PATH=f"{torch_python().parent}:/bin")
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    assert shutil.which("python3", path=env["PATH"]) == str(bin_dir / "python3")
    r = run_probe(tmp_path, python=bin_dir / "python3", env=env)
    assert r.rc == 0, r.stderr
    assert r.lines[0].startswith("epguard: mooncake elastic EP is usable in this pod: "), r.message
    assert "the image's own environment fails: torch is not installed" in r.message
    assert classify(r.message, r.rc) is None  # nothing learned either way


def test_run_as_injected_with_python_dash_i_the_images_pythonpath_counts(tmp_path: Path) -> None:
    """The injected command is ``python3 -I …/probe``: -I keeps PYTHONPATH off the
    probe's own sys.path, but the child that imports torch has it, and so must the
    inventory (an image may install its packages on a PYTHONPATH of its own). Before,
    such an image was "unusable in this image: no mooncake distribution is installed"."""
    log = tmp_path / "termination-log"
    env = clean_env(image(tmp_path))
    proc = __import__("subprocess").run(
        [str(torch_python()), "-I", str(Path(__file__).resolve().parents[2] / "probe"),
         "--termination-log", str(log), "--", "python3", "-m", "sglang.launch_server",
         "--elastic-ep-backend", "mooncake"],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path),
    )  # fmt: skip
    message = log.read_text()
    assert proc.returncode == 0, message + proc.stderr
    assert message.startswith("epguard: mooncake elastic EP is usable: "), message
    assert "sglang=0.5.18" in message and "mooncake-transfer-engine-cuda13=0.0.0.double" in message
