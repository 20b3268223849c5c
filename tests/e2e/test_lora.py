"""spec.lora on a real control plane, under the chart's RBAC: the real API server stores adapters
and weighted aliases (its CEL rules compile and hold), the operator writes the adapters'
ConfigMap owned by the LLMDeployment and points the pods at it, a change of the adapter list
rewrites the ConfigMap and leaves the pod template alone (no rollout), and an empty list deletes
it. (Loading on running pods is tested against stand-in runtimes in tests/operator: the node
agent's pods here do not mount ConfigMaps.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.e2e.control_plane import ControlPlane
from tests.e2e.kvasir_release import Release
from tests.e2e.polling import wait_for
from tests.e2e.test_operator_lifecycle import MINIMAL, _reconciled

pytestmark = pytest.mark.slow

ADAPTERS = [
    {"name": "sql", "source": "/adapters/sql", "rank": 8},
    {"name": "support-v1", "source": "/adapters/support-v1", "rank": 16},
    {"name": "support-v2", "source": "/adapters/support-v2", "rank": 16},
]
ALIASES = [
    {
        "name": "support",
        "targets": [{"adapter": "support-v2", "weight": 90}, {"adapter": "support-v1", "weight": 10}],
    }
]


def _manifest(namespace: str, lora: list[dict[str, Any]] | None) -> str:
    manifest = yaml.safe_load(MINIMAL.read_text())
    manifest["metadata"].update(name="tuned", namespace=namespace)
    manifest["spec"]["replicas"] = 0  # no pods: the ConfigMap and the template are what is checked
    if lora is not None:
        manifest["spec"]["lora"] = lora
        manifest["spec"]["loraAliases"] = ALIASES if lora else []
    return json.dumps(manifest)


def _config_map(control_plane: ControlPlane, namespace: str) -> dict[str, Any] | None:
    found = control_plane.kubectl(
        "get", "configmap", "tuned-lora", "-n", namespace, "-o", "json", check=False
    )
    return json.loads(found.stdout) if found.returncode == 0 else None


def _adapter_names(config_map: dict[str, Any] | None) -> set[str]:
    if config_map is None:
        return set()
    return {entry["name"] for entry in json.loads(config_map["data"]["adapters.json"])}


def test_spec_lora_writes_the_adapters_config_map_without_a_rollout(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    control_plane.kubectl("apply", "-f", "-", stdin=_manifest(namespace, ADAPTERS))
    _reconciled(control_plane, release, namespace, "tuned", 90)
    stored = control_plane.kubectl_json("get", "llmd", "tuned", "-n", namespace)
    assert [a["name"] for a in stored["spec"]["lora"]] == ["sql", "support-v1", "support-v2"]
    config_map = wait_for(lambda: _config_map(control_plane, namespace), "the adapters' ConfigMap")
    assert _adapter_names(config_map) == {"sql", "support-v1", "support-v2"}
    (owner,) = config_map["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "LLMDeployment",
        "tuned",
        stored["metadata"]["uid"],
    )

    deployment = control_plane.kubectl_json("get", "deployment", "tuned", "-n", namespace)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-lora" in args and "--lora-modules-file" in args
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert any((v.get("configMap") or {}).get("name") == "tuned-lora" for v in volumes.values())
    generation = deployment["metadata"]["generation"]

    # One adapter removed, one added (same ranks): the ConfigMap changes, the Deployment does not.
    changed = [ADAPTERS[1], ADAPTERS[2], {"name": "legal", "source": "/adapters/legal", "rank": 4}]
    control_plane.kubectl("apply", "-f", "-", stdin=_manifest(namespace, changed))
    wait_for(
        lambda: (
            _adapter_names(_config_map(control_plane, namespace)) == {"support-v1", "support-v2", "legal"}
        ),
        "the ConfigMap rewritten",
    )
    _reconciled(control_plane, release, namespace, "tuned", 90)
    after = control_plane.kubectl_json("get", "deployment", "tuned", "-n", namespace)
    assert after["metadata"]["generation"] == generation, "a change of adapters rolled the pods"

    # No adapters: the ConfigMap goes.
    control_plane.kubectl("apply", "-f", "-", stdin=_manifest(namespace, []))
    wait_for(lambda: _config_map(control_plane, namespace) is None, "the ConfigMap deleted")


def test_alias_weights_must_sum_to_100_on_the_real_server(
    control_plane: ControlPlane, release: Release
) -> None:
    manifest = json.loads(_manifest("default", ADAPTERS))
    manifest["spec"]["loraAliases"][0]["targets"][1]["weight"] = 20
    refused = control_plane.kubectl(
        "apply", "--dry-run=server", "-f", "-", stdin=json.dumps(manifest), check=False
    )
    assert refused.returncode != 0 and "100" in refused.stderr, refused.stderr
