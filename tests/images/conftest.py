"""The built images, run with podman: which images, where they come from, and how a container is run.

The suite tests images that scripts/build-images.sh has built (their tags in podman's store). It
builds them itself only when asked: KVASIR_BUILD_IMAGES names the targets to (re)build first
(`runtime-cpu,operator`, or `all`), KVASIR_BUILD_IMAGES_ARGS the script's options
(`--debian-base`, ...). A build takes minutes and downloads hundreds of MB (the CUDA image: GBs).
Without podman, or without an image, its tests are skipped with the reason and the command that
would run them (docs/images.md)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass

import pytest

from tests.external_tools import REPO

REGISTRY = "ghcr.io/kvasir-project"


def project_version() -> str:
    match = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert match, "pyproject.toml has no version"
    return match.group(1)


VERSION = project_version()
IMAGES = {
    "runtime-cpu": f"{REGISTRY}/kvasir:{VERSION}-cpu",
    "runtime-cuda": f"{REGISTRY}/kvasir:{VERSION}",
    "operator": f"{REGISTRY}/kvasir-operator:{VERSION}",
}

# podman raises a container's open-file and process limits to its own defaults (about a million
# each), which needs CAP_SYS_RESOURCE wherever the runtime's own limits are lower; containerd and
# the kubelet leave them alone. Modest limits, the same everywhere, keep `podman run` working.
LIMITS = ["--ulimit", "nofile=8192:8192", "--ulimit", "nproc=8192:8192"]
# What the operator's pods and the chart ask of a container: no capabilities, no privilege
# escalation, a read-only root filesystem with a writable /tmp (an emptyDir there).
LOCKED_DOWN = [
    "--read-only",
    "--read-only-tmpfs=false",
    "--tmpfs",
    "/tmp:rw,mode=1777",
    "--cap-drop",
    "all",
    "--security-opt",
    "no-new-privileges",
]


@dataclass(frozen=True)
class Podman:
    path: str

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([self.path, *args], capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"podman {shlex.join(args)} exited {result.returncode}:\n{result.stderr}")
        return result

    def run(self, image: str, *args: str, entrypoint: str | None = None, timeout: float = 120) -> str:
        """Run a locked-down, throwaway container of `image`; its stdout (stderr too on failure)."""
        extra = ["--entrypoint", entrypoint] if entrypoint else []
        result = self(
            "run", "--rm", *LIMITS, *LOCKED_DOWN, *extra, image, *args, timeout=timeout, check=False
        )
        assert result.returncode == 0, (
            f"{image} {shlex.join(args)} exited {result.returncode}:\n{result.stderr}"
        )
        return result.stdout

    def inspect(self, image: str) -> dict:
        return json.loads(self("image", "inspect", image).stdout)[0]


@pytest.fixture(scope="session")
def podman() -> Podman:
    path = shutil.which("podman")
    if path is None:
        pytest.skip(
            "podman is not installed: the image suite runs where it is (Debian: apt-get install podman)"
        )
    return Podman(path)


def _image(podman: Podman, target: str) -> str:
    tag = IMAGES[target]
    wanted = {name.strip() for name in os.environ.get("KVASIR_BUILD_IMAGES", "").split(",")}
    if target in wanted or "all" in wanted:
        command = [
            str(REPO / "scripts" / "build-images.sh"),
            *shlex.split(os.environ.get("KVASIR_BUILD_IMAGES_ARGS", "")),
            target,
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        assert result.returncode == 0, f"{shlex.join(command)} failed:\n{result.stderr[-4000:]}"
    elif podman("image", "exists", tag, check=False).returncode != 0:
        pytest.skip(
            f"{tag} is not built: scripts/build-images.sh {target} (or KVASIR_BUILD_IMAGES={target}; docs/images.md)"
        )
    return tag


@pytest.fixture(scope="session")
def runtime_cpu_image(podman: Podman) -> str:
    return _image(podman, "runtime-cpu")


@pytest.fixture(scope="session")
def runtime_cuda_image(podman: Podman) -> str:
    return _image(podman, "runtime-cuda")


@pytest.fixture(scope="session")
def operator_image(podman: Podman) -> str:
    return _image(podman, "operator")
