"""Build epguard's wheel from a copy of the files given, so that no build/ or *.egg-info
lands in the checkout: `pip wheel --no-deps`, the same PEP 517 build by the same backend
(pyproject's build-system) as the Dockerfile's `uv build --wheel`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What the package is made of; the Dockerfile's builder stage copies the same files.
PACKAGE_FILES = ("pyproject.toml", "README.md", "webhook", "probe")


def build_wheel(tmp: Path, files: tuple[str, ...] = PACKAGE_FILES) -> Path:
    """The wheel built from ``files`` (paths relative to the repository) under ``tmp``."""
    context = tmp / "src"
    context.mkdir()
    for src in files:
        path = REPO / src
        if path.is_dir():
            shutil.copytree(path, context / src, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, context / src)
    wheels = tmp / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--wheel-dir",
            str(wheels),
            str(context),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
    )
    (wheel,) = wheels.glob("epguard-*.whl")
    return wheel
