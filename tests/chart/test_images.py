"""The Dockerfiles (no Docker engine here to build them): they parse, are multi-stage, pinned and
non-root, copy only what exists, call CLI entry points that exist, and the operator image's
requirements cover every third-party module the operator imports."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from kvasir.cli import build_parser
from kvasir.operator.api.spec import DEFAULT_IMAGE
from tests.external_tools import REPO

DOCKERFILES = {
    "runtime": REPO / "docker" / "runtime.Dockerfile",
    "operator": REPO / "docker" / "operator.Dockerfile",
}


def parsed(name: str) -> DockerfileParser:
    parser = DockerfileParser(fileobj=DOCKERFILES[name].open("rb"))
    return parser


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_dockerfile_is_multistage_pinned_and_non_root(name: str) -> None:
    dockerfile = parsed(name)
    instructions = dockerfile.structure
    froms = [i["value"] for i in instructions if i["instruction"] == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a slim final one"
    args = {
        i["value"].split("=", 1)[0]: i["value"].split("=", 1)[1]
        for i in instructions
        if i["instruction"] == "ARG" and "=" in i["value"]
    }
    image = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", image), f"base image not pinned: {image}"
    users = [i["value"] for i in instructions if i["instruction"] == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}, "the final stage must not run as root"
    for run in (i["value"] for i in instructions if i["instruction"] == "RUN"):
        for requirement in re.findall(r'pip install [^&|]*?"([^"]+)"', run):
            assert "==" in requirement, f"unpinned: {requirement}"
    for copy in (
        i["value"] for i in instructions if i["instruction"] == "COPY" and "--from" not in i["value"]
    ):
        for source in copy.split()[:-1]:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_entry_points_exist(name: str) -> None:
    instructions = parsed(name).structure
    entry = json.loads(next(i["value"] for i in instructions if i["instruction"] == "ENTRYPOINT"))
    command = json.loads(next(i["value"] for i in instructions if i["instruction"] == "CMD"))
    assert entry == ["kvasir"]
    scripts = {ep.name: ep.value for ep in importlib.metadata.distribution("kvasir").entry_points}
    assert scripts["kvasir"] == "kvasir.cli:main"
    build_parser().parse_args(command)  # exits on an unknown subcommand or flag


def _third_party_imports(folder: Path) -> set[str]:
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found |= {n.split(".")[0] for n in names}
    return {n for n in found if n not in sys.stdlib_module_names and n not in {"kvasir", "__future__"}}


def test_operator_requirements_cover_its_imports() -> None:
    requirements = {
        line.split("==")[0].lower().replace("_", "-")
        for line in (REPO / "docker" / "operator-requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert all(
        "==" in line
        for line in (REPO / "docker" / "operator-requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    distributions = importlib.metadata.packages_distributions()
    for module in _third_party_imports(REPO / "operator"):
        dists = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        assert dists & requirements, (
            f"the operator imports {module} ({dists}); add it to docker/operator-requirements.txt"
        )


def test_images_are_the_ones_the_chart_and_operator_use() -> None:
    values = yaml.safe_load((REPO / "charts" / "kvasir" / "values.yaml").read_text())
    operator_tag = f"{values['image']['repository']}:0.1.0"
    assert f"-t {operator_tag} ." in DOCKERFILES["operator"].read_text()
    assert f"-t {DEFAULT_IMAGE} ." in DOCKERFILES["runtime"].read_text()


def test_the_operator_runs_without_the_runtime_dependencies() -> None:
    """The operator image has no torch: `kvasir operator` must start without any runtime-only package."""
    import subprocess

    blocked = [
        "torch",
        "numpy",
        "triton",
        "tokenizers",
        "transformers",
        "safetensors",
        "gguf",
        "fastapi",
        "uvicorn",
    ]
    program = (
        "import builtins, sys\n"
        f"blocked = {blocked!r}\n"
        "real = builtins.__import__\n"
        "def guard(name, *args, **kwargs):\n"
        "    if name.split('.')[0] in blocked:\n"
        "        raise ImportError(f'the operator image has no {name}')\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = guard\n"
        "import kvasir.operator.runner, kvasir.operator.autoscaler.loop, kvasir.operator.autoscaler.sources\n"
        "from kvasir.cli import main\n"
        "sys.exit(main(['operator', '--help']))\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--all-namespaces" in result.stdout
