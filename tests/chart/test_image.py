"""The image, without a Docker engine: read the Dockerfile, then do what it does -- build
the wheel from the files it copies, install it into a fresh venv, lay the probe where it
puts it -- and start every entrypoint the Dockerfile and the chart use."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.chart.chartlib import REPO, render
from tests.package.wheel import PACKAGE_FILES, build_wheel

DOCKERFILE = REPO / "Dockerfile"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARGs and stages; continuation lines joined, comments dropped."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        elif op == "ARG" and not stages:
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip()
        elif stages:
            stages[-1].instructions.append((op, rest.strip()))
    return args, stages


ARGS, STAGES = parse_dockerfile(DOCKERFILE.read_text())
FINAL = STAGES[-1]


def json_list(instruction: str) -> list[str]:
    value = json.loads(instruction)
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), instruction
    return value


def final_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for arg in FINAL.all("ENV"):
        for token in shlex.split(arg):
            key, _, value = token.partition("=")
            env[key] = value
    return env


class TestDockerfile:
    def test_it_is_multi_stage_with_one_pinned_base_argument(self) -> None:
        assert len(STAGES) >= 2
        assert ARGS.get("BASE_IMAGE", "").startswith("python:3.11-slim-bookworm")
        for stage in STAGES:
            assert stage.base == "${BASE_IMAGE}", "every stage must build on the same base"

    def test_the_final_stage_installs_nothing_and_so_has_no_compiler(self) -> None:
        # No RUN at all: whatever the builder needed stays in the builder.
        assert FINAL.all("RUN") == []
        copies = FINAL.all("COPY")
        assert any(c.startswith("--from=builder /opt/epguard/venv") for c in copies)

    def test_the_builder_builds_the_wheel_then_accepts_binary_wheels_only(self) -> None:
        (run,) = [r for r in STAGES[0].all("RUN") if "/wheels" in r]
        build, _, install = run.partition("/opt/uv/bin/uv pip install")
        assert "uv build --quiet --wheel --out-dir /wheels ." in build
        assert "--only-binary :all: /wheels/epguard-" in install

    def test_the_builder_pins_the_installer_the_dev_venv_uses(self) -> None:
        pin = re.search(r"^UV_VERSION=(\S+)$", (REPO / "scripts" / "venv.sh").read_text(), re.M)
        assert pin is not None
        assert f"UV_VERSION={pin.group(1)}" in STAGES[0].all("ARG")
        assert any('"uv==${UV_VERSION}"' in r for r in STAGES[0].all("RUN"))

    def test_the_final_stage_runs_as_a_fixed_non_root_uid(self) -> None:
        (user,) = FINAL.all("USER")
        uid, _, gid = user.partition(":")
        assert uid == gid == "65532"

    def test_the_oci_labels_are_set(self) -> None:
        labels = " ".join(FINAL.all("LABEL"))
        for key in ("title", "description", "version", "revision", "created", "licenses", "source"):
            assert f"org.opencontainers.image.{key}=" in labels

    def test_the_probe_lands_at_the_fixed_path(self) -> None:
        assert "probe /opt/epguard/probe" in FINAL.all("COPY")

    def test_the_build_context_admits_only_what_the_dockerfile_copies(self) -> None:
        ignore = (REPO / ".dockerignore").read_text().splitlines()
        assert ignore[ignore.index("*") :][:1] == ["*"]
        for needed in PACKAGE_FILES:
            assert f"!{needed}{'/' if (REPO / needed).is_dir() else ''}" in ignore

    def test_the_builder_copies_what_the_package_is_made_of(self) -> None:
        copied = {src.rstrip("/") for arg in STAGES[0].all("COPY") for src in arg.split()[:-1]}
        assert copied == set(PACKAGE_FILES)


@pytest.fixture(scope="module")
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory laid out like the final image: /opt/epguard/venv and /opt/epguard/probe."""
    tmp = tmp_path_factory.mktemp("image")
    # The builder's COPY lines: what the image's wheel is built from.
    copied = tuple(src for arg in STAGES[0].all("COPY") for src in arg.split()[:-1])
    wheel = build_wheel(tmp, copied)

    root = tmp / "root"
    venv_dir = root / "opt" / "epguard" / "venv"
    venv.EnvBuilder(with_pip=False).create(venv_dir)
    vpy = venv_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # Dependencies come from the project's venv (no network in the test); only the path
    # is added, not its .pth files, so the editable install of epguard stays invisible.
    deps = Path(
        subprocess.run(
            [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(vpy),
            "install",
            "--no-deps",
            "--no-index",
            "--quiet",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (site / "zz-test-deps.pth").write_text(f"{deps}\n")
    # COPY probe /opt/epguard/probe
    shutil.copytree(
        REPO / "probe",
        root / "opt" / "epguard" / "probe",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return root


def image_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    for key, value in final_env().items():
        value = value.replace("${PATH}", env.get("PATH", ""))
        value = value.replace("/opt/epguard", str(root / "opt" / "epguard"))
        env[key] = value if key != "HOME" else str(root)
    return env


def start(root: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    exe = shutil.which(argv[0], path=image_env(root)["PATH"])
    assert exe, f"{argv[0]} is not on the image's PATH"
    return subprocess.run(
        [exe, *argv[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        env=image_env(root),
        cwd=root,
    )


class TestEntrypoints:
    def test_the_installed_package_is_the_wheel_not_the_checkout(self, image_root: Path) -> None:
        out = start(
            image_root, ["python", "-c", "import epguard.webhook as w; print(w.__file__)"]
        )
        assert out.returncode == 0, out.stderr
        assert str(image_root) in out.stdout

    def test_the_image_installs_one_import_root(self, image_root: Path) -> None:
        """Only ``epguard`` (not the generic ``webhook`` or ``probe``) is importable."""
        code = (
            "import importlib.util as u; "
            "print([n for n in ('epguard', 'webhook', 'probe') if u.find_spec(n)])"
        )
        out = start(image_root, ["python", "-c", code])
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "['epguard']"

    def test_the_shipped_rules_load_from_the_installed_package(self, image_root: Path) -> None:
        """What the webhook reads when no --rules is given (it once named the old top-level
        package, which only the checkout's own directory provided)."""
        code = (
            "from epguard.webhook.engine.rules import default_rules_path, load_rules_file; "
            "p = default_rules_path(); print(p, len(load_rules_file(p).rules))"
        )
        out = start(image_root, ["python", "-c", code])
        assert out.returncode == 0, out.stderr
        path, count = out.stdout.split()
        assert path.startswith(str(image_root)) and int(count) > 0

    def test_the_default_entrypoint_starts(self, image_root: Path) -> None:
        argv = json_list(FINAL.all("ENTRYPOINT")[-1]) + json_list(FINAL.all("CMD")[-1])
        out = start(image_root, [*argv, "--help"])
        assert out.returncode == 0, out.stderr
        assert "--tls-cert" in out.stdout and "--rules" in out.stdout

    @pytest.mark.parametrize("deployment", ["epguard-webhook", "epguard-controller"])
    def test_each_command_the_chart_runs_exists_in_the_image(
        self, image_root: Path, deployment: str
    ) -> None:
        d = next(
            o
            for o in render().objects
            if o["kind"] == "Deployment" and o["metadata"]["name"] == deployment
        )
        command = d["spec"]["template"]["spec"]["containers"][0]["command"]
        out = start(image_root, [*command, "--help"])
        assert out.returncode == 0, out.stderr
        assert "usage:" in out.stdout

    def test_the_controller_entrypoint_loads_its_handler_modules(self, image_root: Path) -> None:
        code = (
            "import importlib; from epguard.webhook.controller import HANDLER_MODULES as m; "
            "[importlib.import_module(x) for x in m]; print(len(m))"
        )
        out = start(image_root, ["python", "-c", code])
        assert out.returncode == 0, out.stderr

    def test_the_offline_cli_starts(self, image_root: Path) -> None:
        out = start(image_root, ["epguard", "--help"])
        assert out.returncode == 0, out.stderr

    def test_the_probe_runs_from_its_fixed_path_with_the_standard_library_only(
        self, image_root: Path
    ) -> None:
        probe = image_root / "opt" / "epguard" / "probe"
        # -I: isolated mode, no site-packages and no user paths -- as in a foreign image.
        out = subprocess.run(
            ["python3", "-I", str(probe), "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
        assert out.returncode == 0, out.stderr
        assert re.search(r"usage", out.stdout, re.IGNORECASE)

    def test_the_helm_test_script_runs_on_the_images_python(self, image_root: Path) -> None:
        pod = next(o for o in render().objects if o["kind"] == "Pod")
        script = pod["spec"]["containers"][0]["args"][0]
        compile(script, "helm-test", "exec")
        assert pod["spec"]["containers"][0]["command"] == ["python3", "-c"]
        assert start(image_root, ["python3", "--version"]).returncode == 0
