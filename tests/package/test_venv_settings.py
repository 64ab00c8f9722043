"""scripts/venv.sh tells uv where pip installs from: its ``uv_settings`` function, run by
bash with real pip configurations (pip's own ``pip config list`` reads them).

The user's and XDG's pip files are kept out (HOME and the XDG folders under tmp_path);
the machine's /etc/pip.conf and the venv's own cannot be, so the file here sets its keys
under [install] (pip reads it last: it wins), and the case "nothing configured" runs only
where those files set none of the keys."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KEYS = ("index-url", "extra-index-url", "find-links", "no-index")


def _machine_sets() -> list[str]:
    """The keys this machine's pip files that no environment can hide already set."""
    found = []
    for path in (Path("/etc/pip.conf"), Path(sys.prefix) / "pip.conf"):
        conf = configparser.ConfigParser(strict=False, interpolation=None)
        try:
            conf.read(path)
        except configparser.Error:
            continue
        found += [f"{path} {s}.{k}" for s in ("global", "install") if conf.has_section(s)
                  for k in KEYS if conf.has_option(s, k)]  # fmt: skip
    return found


def _settings(tmp_path: Path, conf: str, **env: str) -> tuple[dict[str, str], str]:
    """The UV_* variables and uv's extra arguments after uv_settings, with ``conf`` as
    pip's configuration file and ``env`` added to an environment with no PIP_/UV_ names."""
    (tmp_path / "pip.conf").write_text(conf)
    script = REPO / "scripts" / "venv.sh"
    body = subprocess.run(
        ["awk", r"/^uv_args=\(\)/,/^}$/", str(script)], capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    assert "uv_settings()" in body
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    run = subprocess.run(
        ["bash", "-c", body + '\nuv_settings || exit 9\nenv | grep "^UV_" | sort\n'
         'echo "args=${uv_args[*]}"'],
        env={**clean, "PIP_CONFIG_FILE": str(tmp_path / "pip.conf"), "py": sys.executable,
             "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
             "XDG_CONFIG_DIRS": str(tmp_path / "xdg-dirs"), **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    found = dict(line.split("=", 1) for line in lines if line.startswith("UV_"))
    return found, lines[-1].removeprefix("args=")


def test_several_values_on_lines_of_their_own_are_all_passed(tmp_path: Path) -> None:
    conf = (
        "[install]\nextra-index-url =\n    https://a.example/simple\n    https://b.example/simple\n"
        "find-links =\n    /wheels/one\n    /wheels/two\n"
    )
    found, args = _settings(tmp_path, conf)
    assert found["UV_EXTRA_INDEX_URL"] == "https://a.example/simple https://b.example/simple"
    assert found["UV_FIND_LINKS"] == "/wheels/one,/wheels/two"
    assert args == ""


def test_pips_own_precedence_environment_then_install_then_global(tmp_path: Path) -> None:
    conf = (
        "[global]\nindex-url = https://global.example/simple\n"
        "[install]\nindex-url = https://install.example/simple\n"
        "[wheel]\nindex-url = https://wheel.example/simple\n"
    )
    found, _ = _settings(tmp_path, conf)
    assert found["UV_INDEX_URL"] == "https://install.example/simple"
    found, _ = _settings(tmp_path, conf, PIP_INDEX_URL="https://env.example/simple")
    assert found["UV_INDEX_URL"] == "https://env.example/simple"


def test_what_the_user_set_for_uv_wins(tmp_path: Path) -> None:
    found, _ = _settings(tmp_path, "[global]\nindex-url = https://pip.example/simple\n",
                         UV_INDEX_URL="https://uv.example/simple")  # fmt: skip
    assert found["UV_INDEX_URL"] == "https://uv.example/simple"


@pytest.mark.parametrize("how", ["file", "env"])
def test_no_index_is_passed_as_uvs_flag(tmp_path: Path, how: str) -> None:
    if how == "file":
        _, args = _settings(tmp_path, "[install]\nno-index = true\n")
    else:
        _, args = _settings(tmp_path, "", PIP_NO_INDEX="1")
    assert args == "--no-index"


def test_nothing_configured_sets_nothing(tmp_path: Path) -> None:
    if machine := _machine_sets():
        pytest.skip(f"this machine's pip files set {machine}")
    found, args = _settings(tmp_path, "")
    assert found == {} and args == ""
