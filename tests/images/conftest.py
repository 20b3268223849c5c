"""The built images, run with podman: the fixtures that find (or build) them.

The suite tests images that scripts/build-images.sh has built (their tags in podman's store). It
builds them itself only when asked: KVASIR_BUILD_IMAGES names the targets to (re)build first
(`runtime-cpu,operator`, or `all`), KVASIR_BUILD_IMAGES_ARGS the script's options
(`--debian-base`, ...). A build takes minutes and downloads hundreds of MB (the CUDA image: GBs).
Without podman, or without an image, its tests are skipped with the reason and the command that
would run them (docs/images.md)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest

from tests.images.containers import BUILD_SCRIPT, Podman, image_tag


@pytest.fixture(scope="session")
def podman() -> Podman:
    path = shutil.which("podman")
    if path is None:
        pytest.skip(
            "podman is not installed: the image suite runs where it is (Debian: apt-get install podman)"
        )
    return Podman(path)


def _image(podman: Podman, target: str) -> str:
    tag = image_tag(target)
    wanted = {name.strip() for name in os.environ.get("KVASIR_BUILD_IMAGES", "").split(",")}
    if target in wanted or "all" in wanted:
        command = [
            str(BUILD_SCRIPT),
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
