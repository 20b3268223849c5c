"""The Dockerfiles, read without building them (tests/images runs the built images): they parse, are
multi-stage, pinned and non-root, copy everything `pip install .` reads and only what exists, call
CLI entry points that exist, carry OCI labels, build the tags the chart and the operator name, and
the operator image's requirements cover every third-party module the operator imports."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from kvasir.cli import build_parser
from kvasir.operator.api.spec import DEFAULT_IMAGE
from tests.external_tools import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli where the standard library has no tomllib
    import tomli as tomllib

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
    # The official Python image, fully qualified (podman resolves no short names by default).
    assert re.fullmatch(r"docker\.io/library/python:\d+\.\d+\.\d+-slim-\w+", image), (
        f"base image not pinned: {image}"
    )
    users = [i["value"] for i in instructions if i["instruction"] == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}, "the final stage must not run as root"
    for run in (i["value"] for i in instructions if i["instruction"] == "RUN"):
        for requirement in re.findall(r'pip install [^&|]*?"([^"]+)"', run):
            if requirement.startswith(("$", "/", ".")):  # an index URL, or the project itself
                continue
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
    """scripts/build-images.sh tags what the chart's defaults and the operator's default name."""
    values = yaml.safe_load((REPO / "charts" / "kvasir" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "kvasir" / "Chart.yaml").read_text())
    assert values["image"]["tag"] == "", "the chart's operator tag defaults to its appVersion"
    assert chart["appVersion"] == PROJECT["project"]["version"]
    listed = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-images.sh"), "--list"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    tags = dict(line.split() for line in listed.splitlines())
    assert tags["operator"] == f"{values['image']['repository']}:{chart['appVersion']}"
    assert tags["runtime-cuda"] == DEFAULT_IMAGE
    assert tags["runtime-cpu"] == f"{DEFAULT_IMAGE}-cpu"
    # The commands the Dockerfiles show for a build by hand agree.
    assert f"-t {tags['operator']} ." in DOCKERFILES["operator"].read_text()
    assert f"-t {tags['runtime-cuda']} ." in DOCKERFILES["runtime"].read_text()
    assert f"--target runtime-cpu -t {tags['runtime-cpu']} ." in DOCKERFILES["runtime"].read_text()


PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _pip_install_reads() -> set[str]:
    """What `pip install .` reads from the repository: pyproject.toml, the README it names, and
    the folder of every package (package data lives in them)."""
    setuptools = PROJECT["tool"]["setuptools"]
    folders = setuptools["package-dir"]
    assert set(folders) == set(setuptools["packages"]), "every package needs its package-dir entry"
    for package, patterns in setuptools["package-data"].items():
        if package == "*":
            continue
        for pattern in patterns:
            assert list((REPO / folders[package]).glob(pattern)), f"{package}: no {pattern}"
    return {"pyproject.toml", PROJECT["project"]["readme"], *folders.values()}


def _copies_by_stage(name: str) -> list[set[str]]:
    """For each stage, the repository paths its COPY instructions bring in at their own relative
    place (`COPY runtime ./runtime`, `COPY pyproject.toml ./`)."""
    stages: list[set[str]] = []
    for instruction in parsed(name).structure:
        if instruction["instruction"] == "FROM":
            stages.append(set())
        elif instruction["instruction"] == "COPY" and "--from" not in instruction["value"]:
            *sources, destination = instruction["value"].split()
            for source in sources:
                kept = destination in {".", "./"} or destination.rstrip("/") in {source, f"./{source}"}
                if kept:
                    stages[-1].add(source.rstrip("/"))
    return stages


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_every_path_pip_install_reads_is_copied(name: str) -> None:
    """`pip install .` in the image fails on a package folder it cannot find (the runtime image once
    missed crds/, the kvasir.crds package): one stage must copy them all, and no ignore rule drop them."""
    needed = _pip_install_reads()
    stage = max(_copies_by_stage(name), key=len)
    missing = {path for path in needed if not any(path == src or path.startswith(f"{src}/") for src in stage)}
    assert not missing, f"{DOCKERFILES[name].name} does not copy {sorted(missing)}"
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in needed:
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        assert not [p for p in ignored for prefix in prefixes if fnmatch.fnmatch(prefix, p)], (
            f".dockerignore drops {path}"
        )


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_images_carry_oci_labels(name: str) -> None:
    labels = " ".join(i["value"] for i in parsed(name).structure if i["instruction"] == "LABEL")
    for key, argument in (("version", "VERSION"), ("revision", "REVISION"), ("source", "SOURCE")):
        assert f'org.opencontainers.image.{key}="${{{argument}}}"' in labels


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
