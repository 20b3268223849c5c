"""Running the built images with podman: the tags, the limits and the locked-down settings a
container gets, and a small podman wrapper."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import shlex
import subprocess
from dataclasses import dataclass
from typing import Any

from tests.external_tools import REPO

BUILD_SCRIPT = REPO / "scripts" / "build-images.sh"
VERSION = importlib.metadata.version("kvasir")


@functools.cache
def image_tag(target: str) -> str:
    """The tag scripts/build-images.sh gives `target` (runtime-cpu, runtime-cuda, operator)."""
    listed = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--list"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    return dict(line.split() for line in listed.splitlines())[target]


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

    def inspect(self, image: str) -> dict[str, Any]:
        return json.loads(self("image", "inspect", image).stdout)[0]


# What a build mounts or copies and no image may keep: the sources, pip settings, the wheel
# folder (scripts/build-images.sh mounts it on /mnt), the host's CA bundle's old mount points.
LEFTOVERS_PROGRAM = (
    "import json, os\n"
    "paths = ['/src', '/etc/pip.conf', '/etc/kvasir-build-ca.crt', '/wheels']\n"
    "print(json.dumps({'present': [p for p in paths if os.path.lexists(p)], 'mnt': os.listdir('/mnt')}))\n"
)
