"""spec.lora's builders, pure: the pod template depends on the claims and the slot rank only, so
adding an adapter on a mounted claim changes the ConfigMap, never the pods."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvasir.operator.api.source import SpecError
from kvasir.operator.api.spec import parse_spec
from kvasir.operator.children.deployment import build_deployment
from kvasir.operator.children.lora import build_lora_config_map
from kvasir.operator.children.manifests import build_children
from kvasir.operator.lora_sync import plan


def _spec(adapters: list[dict[str, Any]], **extra: Any) -> Any:
    return parse_spec({"model": {"source": "pvc://models/llama"}, "lora": adapters, **extra})


A = {"name": "sql", "source": "pvc://adapters/sql", "rank": 8}
B = {"name": "chat", "source": "pvc://adapters/chat", "rank": 16}
IMAGE = {"name": "img", "source": "/adapters/baked/img", "rank": 4}


def test_adding_an_adapter_on_a_mounted_claim_keeps_the_pod_template() -> None:
    one = build_deployment("demo", "ns", _spec([A]))["spec"]["template"]
    two = build_deployment("demo", "ns", _spec([A, B, IMAGE]))["spec"]["template"]
    assert one == two
    args = one["spec"]["containers"][0]["args"]
    assert "--enable-lora" in args and args[args.index("--lora-root") + 1] == "/adapters"
    mounts = one["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "lora-claim-0", "mountPath": "/adapters/claims/adapters", "readOnly": True} in mounts


def test_the_slot_rank_follows_the_largest_rank() -> None:
    big = {"name": "big", "source": "pvc://adapters/big", "rank": 40}
    args = build_deployment("demo", "ns", _spec([A, big]))["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[args.index("--max-lora-rank") + 1] == "64"


def test_the_config_map_lists_the_declared_set_and_the_aliases() -> None:
    aliases = [
        {"name": "support", "targets": [{"adapter": "chat", "weight": 90}, {"adapter": "sql", "weight": 10}]}
    ]
    spec = _spec([A, B], loraAliases=aliases, routing={"mode": "kvasir"})
    data = build_lora_config_map("demo", "ns", spec)["data"]
    assert json.loads(data["adapters.json"])[1] == {"name": "chat", "path": "/adapters/claims/adapters/chat"}
    assert json.loads(data["aliases.json"]) == {"support": {"chat": 90, "sql": 10}}
    children = build_children("demo", "ns", spec, with_service_monitor=False)
    assert children[0]["kind"] == "ConfigMap"
    router = next(c for c in children if c["metadata"]["name"] == "demo-router" and c["kind"] == "Deployment")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert json.loads(args[args.index("--lora-aliases") + 1]) == {"support": {"chat": 90, "sql": 10}}


def test_without_adapters_nothing_changes() -> None:
    spec = parse_spec({"model": {"source": "pvc://models/llama"}})
    assert build_children("demo", "ns", spec, with_service_monitor=False)[0]["kind"] == "Deployment"
    assert (
        "--enable-lora"
        not in build_deployment("demo", "ns", spec)["spec"]["template"]["spec"]["containers"][0]["args"]
    )


@pytest.mark.parametrize(
    ("adapters", "extra", "field"),
    [
        ([A, {**B, "name": "sql"}], {}, "spec.lora[1].name"),
        ([{**A, "source": "hf://org/sql/x.gguf"}], {}, "spec.lora[0].source"),
        ([{**A, "source": "hf://org/sql@v2"}], {}, "spec.lora[0].source"),
        ([{**A, "revision": "v2"}], {}, "spec.lora[0].revision"),
        ([{**A, "source": "/opt/sql"}], {}, "spec.lora[0].source"),
        ([{**A, "name": "llama"}], {}, "spec.lora[0].name"),
        (
            [A],
            {"loraAliases": [{"name": "s", "targets": [{"adapter": "nope", "weight": 100}]}]},
            "spec.loraAliases[0].targets[0].adapter",
        ),
        (
            [A],
            {"loraAliases": [{"name": "s", "targets": [{"adapter": "sql", "weight": 50}]}]},
            "spec.loraAliases[0].targets",
        ),
        (
            [A],
            {"loraAliases": [{"name": "sql", "targets": [{"adapter": "sql", "weight": 100}]}]},
            "spec.loraAliases[0].name",
        ),
    ],
)
def test_the_parser_refuses_what_the_api_server_refuses(adapters: Any, extra: Any, field: str) -> None:
    with pytest.raises(SpecError) as error:
        _spec(adapters, **extra)
    assert error.value.field == field


HUB = {"name": "hub", "source": "hf://org/sql-lora", "rank": 8}


def test_a_hub_adapter_passes_through_unchanged_with_its_revision_and_the_model_token() -> None:
    pinned = {"name": "pinned", "source": "hf://org/chat-lora", "rank": 16, "revision": "v2"}
    spec = parse_spec(
        {
            "model": {"source": "pvc://models/llama", "tokenSecretRef": {"name": "hf", "key": "token"}},
            "lora": [A, HUB, pinned],
        }
    )
    items = json.loads(build_lora_config_map("demo", "ns", spec)["data"]["adapters.json"])
    assert items[1:] == [
        {"name": "hub", "path": "hf://org/sql-lora"},
        {"name": "pinned", "path": "hf://org/chat-lora", "revision": "v2"},
    ]
    container = build_deployment("demo", "ns", spec)["spec"]["template"]["spec"]["containers"][0]
    # The pod downloads with the model's token, and a hub adapter mounts nothing: the template is
    # the one of the claim adapter alone, so adding it rolls no pod.
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in container[
        "env"
    ]
    assert (
        build_deployment("demo", "ns", _spec([A]))["spec"]["template"]
        == build_deployment("demo", "ns", _spec([A, HUB]))["spec"]["template"]
    )
    # Its /v1/models root is org/name[@revision]: served as declared means nothing to do; a new
    # revision means a reload in place.
    hub, pinned_adapter = spec.lora[1], spec.lora[2]
    assert plan([hub, pinned_adapter], {"hub": "org/sql-lora", "pinned": "org/chat-lora@v2"}).replace == ()
    assert plan([pinned_adapter], {"pinned": "org/chat-lora"}).replace == (pinned_adapter,)
