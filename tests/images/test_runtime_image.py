"""The runtime images, run: the CPU image serves the README's request the way a pod runs it (uid
1000, read-only root, no capabilities), its probes answer as the kubelet expects, it carries no
CUDA and no Triton and stays within its size; both variants hold the embedded model and the CRD."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.images.containers import LEFTOVERS_PROGRAM, LIMITS, LOCKED_DOWN, VERSION, Podman
from tests.runtime.server.test_readme_example import readme_request_and_answer

pytestmark = pytest.mark.images

# The CPU image's bound, as `podman image inspect` measures it (docs/images.md).
CPU_IMAGE_MAX_BYTES = 1_200_000_000
# The embedded model is ready in about 40 s on 2 shared cores; a generous bound, never a hang.
READY_WITHIN_S = 300

# Where the code looks: the model through kvasir.runtime.loader.embedded, the CRD through
# kvasir.operator.api.strict_fields (importlib.resources), as `kvasir serve` and `kvasir render` do.
WHERE_THINGS_ARE = """
import json
from kvasir.operator.api.strict_fields import load_crd
from kvasir.runtime.loader.embedded import embedded_model_path
model = embedded_model_path()
print(json.dumps({"model": str(model), "model_bytes": model.stat().st_size,
                  "crd": load_crd()["metadata"]["name"]}))
"""


class Server:
    """A runtime container serving on a loopback port, and what its probes answered while it started."""

    def __init__(self, podman: Podman, image: str) -> None:
        self.podman = podman
        self.name = f"kvasir-image-test-{secrets.token_hex(4)}"
        podman(
            "run", "--detach", "--name", self.name, *LIMITS, *LOCKED_DOWN,
            "--publish", "127.0.0.1::8000", image,
        )  # fmt: skip
        port = json.loads(podman("inspect", self.name).stdout)[0]["NetworkSettings"]["Ports"]["8000/tcp"]
        self.url = f"http://127.0.0.1:{port[0]['HostPort']}"
        self.probes: list[tuple[int, int]] = []  # (/health, /ready) status codes, in order

    def wait_ready(self) -> float:
        """Seconds from start to /ready = 200, polling both probes as a kubelet would."""
        start = time.monotonic()
        while time.monotonic() - start < READY_WITHIN_S:
            state = json.loads(self.podman("inspect", self.name).stdout)[0]["State"]
            assert state["Running"], f"the server exited ({state['ExitCode']}):\n{self.logs()}"
            try:
                health = httpx.get(self.url + "/health", timeout=5).status_code
                ready = httpx.get(self.url + "/ready", timeout=5).status_code
            except httpx.TransportError:
                time.sleep(1)
                continue
            self.probes.append((health, ready))
            if ready == 200:
                return time.monotonic() - start
            time.sleep(1)
        raise AssertionError(f"not ready within {READY_WITHIN_S} s:\n{self.logs()}")

    def exec(self, *command: str) -> str:
        return self.podman("exec", self.name, *command).stdout

    def logs(self) -> str:
        result = self.podman("logs", self.name, check=False)
        return (result.stdout + result.stderr)[-4000:]

    def remove(self) -> None:
        self.podman("rm", "--force", "--time", "5", self.name, check=False)


@pytest.fixture(scope="module")
def server(podman: Podman, runtime_cpu_image: str) -> Iterator[Server]:
    running = Server(podman, runtime_cpu_image)
    try:
        running.wait_ready()
        yield running
    finally:
        running.remove()


def test_the_cpu_image_answers_the_readme_request(server: Server) -> None:
    path, body, shown = readme_request_and_answer()
    response = httpx.post(server.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model"] == body["model"]
    # Greedy decoding: the answer the README shows, token for token.
    assert answer["choices"] == shown["choices"]
    assert answer["usage"] == shown["usage"]


def test_the_probes_answer_as_the_kubelet_expects(server: Server) -> None:
    # While loading: alive (/health 200) but not ready (/ready 503); then ready, for good.
    assert server.probes, "no probe was answered"
    assert all(health == 200 for health, _ in server.probes)
    assert all(ready == 503 for _, ready in server.probes[:-1])
    assert server.probes[-1] == (200, 200)
    assert httpx.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready", timeout=5).json() == {"status": "ready"}
    assert httpx.get(server.url + "/version", timeout=5).json()["version"] == VERSION


def test_the_server_runs_unprivileged_on_a_read_only_root(server: Server) -> None:
    status = dict(
        line.split(":", 1) for line in server.exec("cat", "/proc/1/status").splitlines() if ":" in line
    )
    assert status["Uid"].split() == ["1000"] * 4
    assert status["Gid"].split() == ["1000"] * 4
    # No capability at all, nor any to gain.
    for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[field], 16) == 0, f"{field}: {status[field]}"
    assert status["NoNewPrivs"].strip() == "1"
    # The root filesystem refuses writes, even where the image's own user owns the folder.
    refused = server.podman("exec", server.name, "touch", "/models/x", check=False)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr
    mounts = [line.split() for line in server.exec("cat", "/proc/self/mounts").splitlines()]
    root = next(m for m in mounts if m[1] == "/")
    assert "ro" in root[3].split(",")
    # The C kernels were compiled into the cache under HOME=/tmp (the pod's emptyDir).
    assert server.exec("sh", "-c", "ls /tmp/.cache/kvasir* | head -n 1").strip()


def test_the_cpu_image_has_no_cuda_no_triton_and_fits(podman: Podman, runtime_cpu_image: str) -> None:
    program = (
        "import importlib.util, importlib.metadata as m, json, torch\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "  'triton': importlib.util.find_spec('triton') is not None,\n"
        "  'nvidia': sorted(d.metadata['Name'] for d in m.distributions()\n"
        "                   if d.metadata['Name'].lower().startswith('nvidia'))}))\n"
    )
    found = json.loads(podman.run(runtime_cpu_image, "-c", program, entrypoint="python3"))
    assert found == {"torch": "2.13.0+cpu", "cuda": None, "triton": False, "nvidia": []}
    size = podman.inspect(runtime_cpu_image)["Size"]
    assert size <= CPU_IMAGE_MAX_BYTES, f"{size / 1e9:.2f} GB"


def test_the_cpu_image_holds_the_model_and_the_crd(podman: Podman, runtime_cpu_image: str) -> None:
    found = json.loads(podman.run(runtime_cpu_image, "-c", WHERE_THINGS_ARE, entrypoint="python3"))
    assert found["model"].endswith(".gguf") and found["model_bytes"] > 50_000_000
    assert found["crd"] == "llmdeployments.inference.kvasir.dev"


def test_the_cuda_image_holds_cuda_torch_triton_the_model_and_the_crd(
    podman: Podman, runtime_cuda_image: str
) -> None:
    """No GPU here: the CUDA image is checked for what it carries, not run on a device."""
    found = json.loads(podman.run(runtime_cuda_image, "-c", WHERE_THINGS_ARE, entrypoint="python3"))
    assert found["crd"] == "llmdeployments.inference.kvasir.dev"
    assert found["model"].endswith(".gguf")
    program = "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"
    torch_version, cuda, _ = podman.run(runtime_cuda_image, "-c", program, entrypoint="python3").split()
    assert torch_version.startswith("2.13.0")
    assert cuda.startswith("13.")  # docs/images.md: the driver this needs
    assert "usage: kvasir serve" in podman.run(runtime_cuda_image, "serve", "--help")


@pytest.mark.parametrize("target", ["runtime-cpu", "runtime-cuda"])
def test_the_runtime_images_carry_their_labels(
    podman: Podman, target: str, request: pytest.FixtureRequest
) -> None:
    image = request.getfixturevalue(target.replace("-", "_") + "_image")
    labels = podman.inspect(image)["Labels"]
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["org.opencontainers.image.source"] == "https://github.com/kvasir-project/kvasir"
    assert len(labels["org.opencontainers.image.revision"].removesuffix("-dirty")) == 40
    config = podman.inspect(image)["Config"]
    assert config["User"] == "1000:1000"
    assert config["Entrypoint"] == ["kvasir"]


def test_nothing_of_the_build_stays_in_the_image(podman: Podman, runtime_cpu_image: str) -> None:
    found = json.loads(podman.run(runtime_cpu_image, "-c", LEFTOVERS_PROGRAM, entrypoint="python3"))
    assert found == {"present": [], "mnt": []}
