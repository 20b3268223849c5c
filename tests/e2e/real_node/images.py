"""The images of the real node, put into containerd's `k8s.io` namespace without a registry: the
sandbox ("pause") image written here as an OCI archive holding the host's static `catatonit`, and
Kvasir's images copied from podman's store (`podman save | ctr images import`)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

CATATONIT = Path("/usr/bin/catatonit")
# The runtime and operator images the tests run (scripts/build-images.sh builds them).
KVASIR_IMAGES = ("ghcr.io/kvasir-project/kvasir-operator:0.1.0", "ghcr.io/kvasir-project/kvasir:0.1.0-cpu")
IMPORT_TIMEOUT = 900.0  # seconds for one image; the CPU image is 1.2 GB


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def pause_archive(name: str, pause_binary: Path = CATATONIT) -> bytes:
    """An OCI image archive named `name`: one layer with `pause_binary` as /pause, run as
    `/pause -P` (catatonit's pause mode: sleep, reap nothing, exit on SIGTERM)."""
    layer_buffer = io.BytesIO()
    with tarfile.open(fileobj=layer_buffer, mode="w") as layer_tar:
        layer_tar.add(pause_binary, arcname="pause")
    layer = layer_buffer.getvalue()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/pause", "-P"]},
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _digest(config),
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": _digest(layer),
                    "size": len(layer),
                }
            ],
        }
    ).encode()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": _digest(manifest),
                    "size": len(manifest),
                    "annotations": {"io.containerd.image.name": name},
                }
            ],
        }
    ).encode()
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as out:
        entries = [("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'), ("index.json", index)]
        entries += [(f"blobs/sha256/{_digest(blob)[7:]}", blob) for blob in (layer, config, manifest)]
        for path, data in entries:
            info = tarfile.TarInfo(path)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return archive.getvalue()


def ctr_command(socket: Path) -> list[str]:
    ctr = shutil.which("ctr")
    if ctr is None:
        raise FileNotFoundError("ctr (containerd's client) is not on PATH")
    return [ctr, "--address", str(socket), "--namespace", "k8s.io"]


def import_pause(socket: Path, name: str) -> None:
    subprocess.run(
        [*ctr_command(socket), "images", "import", "-"],
        input=pause_archive(name),
        capture_output=True,
        timeout=120,
        check=True,
    )


def import_from_podman(socket: Path, images: Sequence[str]) -> dict[str, float]:
    """Copy each image from podman's store into containerd; the seconds each took. RuntimeError
    naming the image and podman's or ctr's message if one is missing or refused."""
    podman = shutil.which("podman")
    if podman is None:
        raise FileNotFoundError("podman is not on PATH (the images are copied from its store)")
    seconds = {}
    for image in images:
        started = time.monotonic()
        # podman's messages go to a file: a pipe nobody reads while the archive streams could fill.
        with tempfile.TemporaryFile() as save_log:
            save = subprocess.Popen(
                [podman, "save", "--format", "oci-archive", image], stdout=subprocess.PIPE, stderr=save_log
            )
            imported = subprocess.run(
                [*ctr_command(socket), "images", "import", "-"],
                stdin=save.stdout,
                capture_output=True,
                timeout=IMPORT_TIMEOUT,
                check=False,
            )
            if save.stdout is not None:
                save.stdout.close()
            saved = save.wait(timeout=IMPORT_TIMEOUT)
            save_log.seek(0)
            save_error = save_log.read().decode(errors="replace").strip()
        if saved != 0 or imported.returncode != 0:
            ctr_error = imported.stderr.decode(errors="replace").strip()
            raise RuntimeError(
                f"could not copy {image} into containerd (build it with scripts/build-images.sh): "
                f"podman save: {save_error[-2000:]}; ctr import: {ctr_error[-2000:]}"
            )
        seconds[image] = time.monotonic() - started
    return seconds
