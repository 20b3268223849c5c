"""The operator image, run the way the chart runs it (uid 65532, read-only root, no capabilities):
`kvasir operator --help` works, the CRD is where the code reads it, and no runtime dependency
(torch, Triton) came along."""

from __future__ import annotations

import json

import pytest

from tests.images.containers import LEFTOVERS_PROGRAM, VERSION, Podman

pytestmark = pytest.mark.images


def test_kvasir_operator_help_runs(podman: Podman, operator_image: str) -> None:
    out = podman.run(operator_image, "operator", "--help")
    assert out.startswith("usage: kvasir operator")
    assert "--all-namespaces" in out


def test_the_operator_image_holds_the_crd_and_no_torch(podman: Podman, operator_image: str) -> None:
    program = (
        "import importlib.util, json, os\n"
        "from kvasir.operator.api.strict_fields import load_crd\n"
        "print(json.dumps({'crd': load_crd()['metadata']['name'], 'uid': os.getuid(),\n"
        "  'absent': [m for m in ('torch', 'triton', 'numpy') if importlib.util.find_spec(m) is None]}))\n"
    )
    found = json.loads(podman.run(operator_image, "-c", program, entrypoint="python3"))
    assert found == {
        "crd": "llmdeployments.inference.kvasir.dev",
        "uid": 65532,
        "absent": ["torch", "triton", "numpy"],
    }


def test_the_operator_image_carries_its_labels(podman: Podman, operator_image: str) -> None:
    image = podman.inspect(operator_image)
    labels = image["Labels"]
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["org.opencontainers.image.source"] == "https://github.com/kvasir-project/kvasir"
    assert len(labels["org.opencontainers.image.revision"].removesuffix("-dirty")) == 40
    assert image["Config"]["User"] == "65532:65532"
    assert image["Config"]["Cmd"] == ["operator", "--all-namespaces"]


def test_nothing_of_the_build_stays_in_the_image(podman: Podman, operator_image: str) -> None:
    found = json.loads(podman.run(operator_image, "-c", LEFTOVERS_PROGRAM, entrypoint="python3"))
    assert found == {"present": [], "mnt": []}
