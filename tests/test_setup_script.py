"""scripts/setup.sh (issue 34, item 20): serving installs only the serving dependencies (Triton only
where a GPU is), the tests get everything, and a second run with nothing changed installs nothing.

Run against a stand-in .venv whose `pip` records its arguments, so no package is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _project(tmp_path: Path, gpu: bool) -> tuple[Path, Path, dict[str, str]]:
    """A copy of what setup.sh reads, a stand-in venv, and the environment to run it in."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "runtime").mkdir()
    (root / "runtime" / "engine.py").write_text("")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    log = tmp_path / "pip.log"
    # The stand-in pip logs each call; installing Kvasir "creates" its command.
    (bin_dir / "pip").write_text(
        f'#!/bin/sh\necho "$*" >>"{log}"\ncase "$*" in *editable_mode*) touch "{bin_dir}/kvasir"; chmod +x "{bin_dir}/kvasir";; esac\n'
    )
    (bin_dir / "pip").chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir()
    # nvidia-smi answers as on a machine with a GPU, or as on one without (the machine's own,
    # later on the PATH, is never reached).
    answer = "echo 'GPU 0: NVIDIA H100'" if gpu else "echo 'NVIDIA-SMI has failed' >&2; exit 9"
    (tools / "nvidia-smi").write_text(f"#!/bin/sh\n{answer}\n")
    (tools / "nvidia-smi").chmod(0o755)
    path = f"{tools}:{os.path.dirname(shutil.which('sh') or '/bin/sh')}:/usr/bin:/bin"
    return root, log, {"PATH": path, "HOME": str(tmp_path)}


def _setup(root: Path, env: dict[str, str], *args: str) -> None:
    subprocess.run(["bash", str(root / "scripts" / "setup.sh"), *args], env=env, check=True, timeout=120)


def _installs(log: Path) -> list[str]:
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def test_serving_on_a_cpu_installs_no_test_extra_and_no_triton(tmp_path: Path) -> None:
    root, log, env = _project(tmp_path, gpu=False)
    _setup(root, env)
    installs = _installs(log)
    editable = [line for line in installs if "editable_mode=strict" in line]
    assert editable == ["install -q -e . --config-settings editable_mode=strict"], installs
    assert not any("triton" in line or "[test]" in line for line in installs), installs


def test_serving_on_a_gpu_installs_triton(tmp_path: Path) -> None:
    root, log, env = _project(tmp_path, gpu=True)
    _setup(root, env)
    assert "install -q -e .[triton] --config-settings editable_mode=strict" in _installs(log)


def test_a_second_run_installs_nothing_until_something_changes(tmp_path: Path) -> None:
    root, log, env = _project(tmp_path, gpu=False)
    _setup(root, env)
    assert _installs(log)
    _setup(root, env)
    assert _installs(log) == []  # the stamp matches: a second launch starts at once
    (root / "runtime" / "new_module.py").write_text("")  # a new file needs the link tree rebuilt
    _setup(root, env)
    assert _installs(log)
    _setup(root, env)
    assert _installs(log) == []
    with (root / "pyproject.toml").open("a") as pyproject:
        pyproject.write("\n# a changed dependency list\n")
    _setup(root, env)
    assert _installs(log)


def test_the_test_setup_installs_everything_and_covers_serving(tmp_path: Path) -> None:
    root, log, env = _project(tmp_path, gpu=False)
    _setup(root, env, "test")
    assert "install -q -e .[test] --config-settings editable_mode=strict" in _installs(log)
    _setup(root, env)  # serving needs nothing more than the tests' set-up installed
    assert _installs(log) == []
    with pytest.raises(subprocess.CalledProcessError):
        _setup(root, env, "everything")


def test_triton_is_an_extra_the_tests_include() -> None:
    text = (REPO / "pyproject.toml").read_text()

    def block(opening: str) -> str:
        start = text.index(opening)
        return text[start : text.index("\n]", start)]

    assert '"triton' not in block("\ndependencies = [")
    assert '"triton' in block("\ntest = [")
    assert '\ntriton = ["triton' in text
    assert "scripts/setup.sh test" in (REPO / "scripts" / "test.sh").read_text()
