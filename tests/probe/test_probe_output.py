"""The probe's output contract: termination message, JSON report, exit status.

Other components parse these (webhook/engine/outcome.py reads the message back from pod
status), so the shape is tested on real runs, not on hand-made strings.
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.probe.probe_harness import (
    MTE_CUDA12,
    PG_NAMES,
    REGISTER_BOTH,
    SGLANG_PG,
    WORKER,
    clean_env,
    copy_probe,
    overlay,
    run_probe,
    write_double,
)

VERSIONS_RE = re.compile(r"^versions: torch=\S+ sglang=\S+( [a-z0-9-]+=\S+)+$")


def _python38() -> str | None:
    found = shutil.which("python3.8")
    if found and subprocess.run([found, "-V"], capture_output=True).returncode == 0:
        return found
    pyenv = sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.8*/bin/python3.8")))
    return pyenv[-1] if pyenv else None


# --- message shape ------------------------------------------------------------------------


@pytest.mark.realpkg
def test_message_has_verdict_first_versions_evidence_and_fix_last(tmp_path):
    r = run_probe(tmp_path, pythonpath=[overlay(MTE_CUDA12), overlay(SGLANG_PG[0])])
    assert r.lines[0].startswith("epguard: mooncake elastic EP is unusable in this image: ")
    assert [line for line in r.lines if VERSIONS_RE.match(line)] == [
        "versions: torch=2.13.0+cu130 sglang=0.5.18 mooncake-transfer-engine=0.3.13.post1"
    ]
    assert r.lines[-1].startswith("fix: ")
    # The same text goes to stderr, for `kubectl logs` of the init container.
    assert r.message.strip() in r.stderr


@pytest.mark.realpkg
@pytest.mark.parametrize("limit", [200, 400, 1000])
def test_message_fits_max_message_bytes_and_keeps_verdict_and_fix(tmp_path, limit):
    r = run_probe(
        tmp_path,
        pythonpath=[overlay(MTE_CUDA12), overlay(SGLANG_PG[0])],
        opts=["--max-message-bytes", str(limit)],
    )
    assert len(r.message.encode()) <= limit
    assert r.lines[0].startswith("epguard: mooncake elastic EP is unusable in this image: ")
    assert r.lines[-1].startswith("fix: ")
    assert VERSIONS_RE.match(r.lines[1]), r.message
    full = run_probe(tmp_path, pythonpath=[overlay(MTE_CUDA12), overlay(SGLANG_PG[0])])
    assert len(full.message.encode()) > limit  # the limit really cut something


@pytest.mark.realpkg
def test_message_never_contains_an_environment_value(tmp_path):
    # Third-party error texts can quote the environment (a token in a URL, a path).
    secret = "hf_s3cr3t-t0ken-value"
    double = write_double(
        tmp_path / "img",
        pg=("import os\nraise ImportError('cannot reach hub with ' + os.environ['HF_TOKEN'])\n"),
    )
    env = clean_env(
        [double, overlay(SGLANG_PG[0])], HF_TOKEN=secret, IMAGE_DIR=str(tmp_path / "img")
    )
    r = run_probe(tmp_path, env=env)
    assert r.rc == 1
    everything = r.message + str(r.report)
    assert secret not in everything
    assert "$HF_TOKEN" in r.message


@pytest.mark.realpkg
def test_paths_from_the_environment_are_named_by_variable(tmp_path):
    image = tmp_path / "image-site-packages"
    double = write_double(image, pg="import torch\nimport ctypes\nctypes.string_at(0)\n")
    env = clean_env([double, overlay(SGLANG_PG[0])], IMAGE_DIR=str(image))
    r = run_probe(tmp_path, env=env)
    assert r.report["classification"] == "crash"
    assert str(image) not in r.message + str(r.report)
    assert 'crash site: File "$IMAGE_DIR/mooncake/pg.py"' in r.message


# --- JSON report --------------------------------------------------------------------------


@pytest.mark.realpkg
def test_json_report_has_the_documented_fields(tmp_path):
    double = write_double(tmp_path / "img", pg=REGISTER_BOTH + PG_NAMES)
    r = run_probe(tmp_path, pythonpath=[double, overlay(SGLANG_PG[0])])
    doc = r.report
    assert doc["verdict"] == "usable"
    assert doc["required_modules"] == ["mooncake.pg"]
    assert doc["versions"] == {
        "torch": "2.13.0+cu130",
        "sglang": "0.5.18",
        "mooncake-transfer-engine-cuda13": "0.0.0.double",
    }
    assert isinstance(doc["cause"], str) and isinstance(doc["fix"], str)
    for check in doc["checks"]:
        assert set(check) == {"name", "ok", "detail"}
        assert isinstance(check["ok"], bool)
    assert {"torch", "import mooncake.pg", "names mooncake.pg", "backends"} <= {
        c["name"] for c in doc["checks"]
    }
    assert doc["message"] == r.message


# --- not requested ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "worker",
    [
        ["python3", "-m", "sglang.launch_server", "--tp", "2"],
        ["python3", "-m", "sglang.launch_server", "--elastic-ep-backend", "none"],
        [],
    ],
)
def test_nothing_to_check_is_one_line_and_exit_zero(tmp_path, worker):
    # No torch is needed to decide this: run with the repo's venv, which has none.
    r = run_probe(tmp_path, python=sys.executable, worker=worker, env=clean_env())
    assert r.rc == 0
    assert len(r.lines) == 1
    assert r.lines[0].startswith("epguard: nothing to check: ")
    assert r.report["verdict"] == "not-requested"


def test_torch_missing_is_unusable_and_an_image_cause(tmp_path):
    r = run_probe(tmp_path, python=sys.executable, env=clean_env())
    assert r.rc == 1
    assert r.report["classification"] == "torch-not-installed"
    assert r.report["scope"] == "image"
    assert r.lines[0].startswith("epguard: mooncake elastic EP is unusable in this image: ")
    assert "No module named 'torch'" in r.lines[0]
    assert "torch=none" in r.message


# --- exit status --------------------------------------------------------------------------


def test_usage_error_exits_two(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(copy_probe(tmp_path)), "--no-such-option"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "usage: python3 probe" in proc.stderr


def _broken_probe(tmp_path: Path) -> Path:
    # A real bug in the probe: diagnosis raises. Patched in a copy, never in the repo.
    probe = copy_probe(tmp_path)
    src = probe / "diagnosis.py"
    text = src.read_text().replace(
        "def diagnose(o):\n", "def diagnose(o):\n    raise KeyError('bug')\n"
    )
    src.write_text(text)
    return probe


@pytest.mark.parametrize(("policy", "rc"), [(None, 0), ("allow", 0), ("deny", 1)])
def test_an_internal_error_does_not_block_the_worker_unless_told_to(tmp_path, policy, rc):
    opts = [] if policy is None else [f"--on-internal-error={policy}"]
    r = run_probe(
        tmp_path,
        python=sys.executable,
        env=clean_env(),
        probe_dir=_broken_probe(tmp_path),
        opts=opts,
    )
    assert r.rc == rc
    assert "Traceback" in r.stderr and "KeyError" in r.stderr
    assert r.lines[0].startswith("epguard: probe internal error: KeyError")
    assert r.lines[-1].startswith("fix: report this epguard bug")


# --- how it is run ------------------------------------------------------------------------


@pytest.mark.realpkg
def test_runs_from_a_copied_directory_and_as_a_module_with_the_same_result(tmp_path):
    paths = [overlay(MTE_CUDA12), overlay(SGLANG_PG[0])]
    copied = copy_probe(tmp_path / "opt" / "epguard")
    a = run_probe(tmp_path, pythonpath=paths, probe_dir=copied)
    b = run_probe(tmp_path, pythonpath=paths, as_module=True)
    assert a.rc == b.rc == 1
    assert a.lines[0] == b.lines[0]
    assert a.report["classification"] == b.report["classification"] == "cuda-mismatch"


@pytest.mark.skipif(_python38() is None, reason="no Python 3.8 interpreter on this machine")
def test_runs_on_python_3_8(tmp_path):
    # Worker images may carry an old Python; the probe promises 3.8+.
    py38 = _python38()
    r = run_probe(tmp_path, python=py38, env=clean_env(), probe_dir=copy_probe(tmp_path))
    assert r.rc == 1, r.stderr
    assert r.report["classification"] == "torch-not-installed"
    ok = run_probe(tmp_path, python=py38, env=clean_env(), worker=["x"])
    assert ok.rc == 0 and ok.lines[0].startswith("epguard: nothing to check: ")


def test_does_not_write_the_default_termination_log_when_it_is_not_writable(tmp_path):
    # Outside Kubernetes /dev/termination-log does not exist; the probe must not fail.
    env = clean_env()
    proc = subprocess.run(
        [sys.executable, str(copy_probe(tmp_path)), "--", *WORKER],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert "cannot write" not in proc.stderr
    assert proc.stderr.startswith("epguard: mooncake elastic EP is unusable")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "3601", "x"])
def test_a_bad_timeout_is_a_usage_error_not_a_probe_that_never_ends(tmp_path, value):
    r = run_probe(tmp_path, python=sys.executable, env=clean_env(), opts=["--timeout", value])
    assert r.rc == 2
    assert "--timeout" in r.stderr


def test_scrub_masks_a_token_that_starts_with_a_digit_and_keeps_versions_and_own_words() -> None:
    """Review helper: any value starting with a digit was taken for a version and never
    masked (a UUID-like token included); and a pod's EP_BACKEND=mooncake masked the
    probe's own word everywhere. A pod's value is masked without its name."""
    from epguard.probe import message

    token = "3f2a9c1e-77b4-4e1b-9c2d-0a1b2c3d4e5f"
    env = {"HF_TOKEN": token, "TORCH_V": "2.13.0+cu130", "EPGUARD_POD_EP_BACKEND": "mooncake",
           "EPGUARD_POD_the image is fine": "/models/secret-path"}  # fmt: skip
    text = f"hub said {token}; torch 2.13.0+cu130; mooncake.pg from /models/secret-path"
    assert message.scrub(text, env) == (
        "hub said $HF_TOKEN; torch 2.13.0+cu130; mooncake.pg from $POD_VARIABLE"
    )
