"""Spec parsing: model sources and the errors the operator reports for specs it cannot honour."""

from __future__ import annotations

import pytest

from kvasir.operator.api.source import ModelSource, SourceKind, SpecError, parse_model_source
from kvasir.operator.api.spec import parse_name, parse_spec


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "hf://meta-llama/Llama-3.1-8B-Instruct",
            ModelSource(SourceKind.HUGGING_FACE, repo_id="meta-llama/Llama-3.1-8B-Instruct"),
        ),
        ("pvc://model-store", ModelSource(SourceKind.PVC, claim="model-store")),
        ("pvc://model-store/qwen/7b/", ModelSource(SourceKind.PVC, claim="model-store", path="qwen/7b")),
        ("/opt/models/smol", ModelSource(SourceKind.LOCAL, path="/opt/models/smol")),
    ],
)
def test_valid_sources(source: str, expected: ModelSource) -> None:
    assert parse_model_source(source) == expected


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("hf://org/na me", "'na me' in 'hf://org/na me' is not a valid Hugging Face name"),
        ("hf://org/a--b", "'a--b' in 'hf://org/a--b' is not a valid Hugging Face name"),
        ("hf://org/name/extra", "'hf://org/name/extra' must look like hf://ORG/NAME"),
        ("pvc://Store/x", "'Store' in 'pvc://Store/x' is not a valid PersistentVolumeClaim name"),
        ("pvc://store/../etc", "path '../etc' must not contain '..' segments"),
        ("/models//llama", "must not contain empty segments"),
        ("s3://bucket/model", "unsupported scheme 's3://'"),
        ("relative/path", "not an absolute path"),
        ("", "a model source is required"),
    ],
)
def test_unusable_sources(source: str, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_model_source(source)
    assert caught.value.field == "spec.model.source"
    assert message in str(caught.value)


def test_served_name_and_desired_replicas() -> None:
    spec = parse_spec({"model": {"source": "pvc://store/qwen2.5-7b"}})
    assert spec.model.served_model_name == "qwen2.5-7b"
    assert spec.desired_replicas == 1
    assert parse_spec({"model": {"source": "/m"}, "replicas": 0}).desired_replicas == 0
    scaled = parse_spec({"model": {"source": "/m"}, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}})
    assert scaled.desired_replicas == 2  # spec.replicas (1 by default) kept within min..max
    assert scaled.autoscaling is not None and scaled.autoscaling.target_kv_cache_usage == 0.8
    assert scaled.autoscaling.target_itl_seconds is None  # off unless asked for
    latency = parse_spec(
        {
            "model": {"source": "/m"},
            "autoscaling": {"maxReplicas": 5, "targets": {"interTokenLatencySeconds": 0.05}},
        }
    )
    assert latency.autoscaling is not None and latency.autoscaling.target_itl_seconds == 0.05
    written = parse_spec({"model": {"source": "/m"}, "replicas": 4, "autoscaling": {"maxReplicas": 5}})
    assert written.desired_replicas == 4  # what the autoscaler wrote through /scale
    capped = parse_spec({"model": {"source": "/m"}, "replicas": 9, "autoscaling": {"maxReplicas": 5}})
    assert capped.desired_replicas == 5


def test_hub_gguf_files_and_canonical_quantities() -> None:
    spec = parse_spec(
        {
            "model": {"source": "hf://bartowski/Qwen2.5-7B-GGUF/Qwen2.5-7B-Q4_K_M.gguf"},
            "resources": {"cpu": "0.5", "memory": "1024Mi", "shmSize": "1.5Gi"},
        }
    )
    assert spec.model.source.hub_model == "hf://bartowski/Qwen2.5-7B-GGUF/Qwen2.5-7B-Q4_K_M.gguf"
    assert spec.model.served_model_name == "bartowski/Qwen2.5-7B-GGUF"
    assert (spec.resources.cpu, spec.resources.memory, spec.resources.shm_size) == ("500m", "1Gi", "1536Mi")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"model": {"source": "/m"}, "resources": {"cpu": "lots"}},
            "spec.resources.cpu: 'lots' is not a quantity",
        ),
        (
            {"model": {"source": "/m"}, "resources": {"memory": "16GB"}},
            "spec.resources.memory: '16GB' is not a quantity",
        ),
        (
            {"model": {"source": "/m"}, "resources": {"cpu": 0.5}},
            "spec.resources.cpu: must be an integer or a quantity string such as '500m', '0.5' or '16Gi', got 0.5",
        ),
        (
            {"model": {"source": "/m"}, "resources": {"memory": "0"}},
            "spec.resources.memory: must be greater than 0",
        ),
        (
            {"model": {"source": "/m"}, "resources": {"gpus": 9}},
            "spec.resources.gpus: must be between 0 and 8, got 9",
        ),
        (
            {"model": {"source": "/m"}, "resources": {"gpus": 4}, "parallelism": {"tensor": 2, "nodes": 2}},
            "spec.parallelism: tensor x pipeline (2 x 1) must equal resources.gpus x nodes (4 x 2 = 8)",
        ),
        (
            {
                "model": {"source": "/m"},
                "resources": {"gpus": 8},
                "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2},
            },
            "spec.parallelism.pipeline: above 1 is not supported: the runtime has no pipeline parallelism",
        ),
        (
            {"model": {"source": "/m"}, "resources": {"gpus": 0}, "parallelism": {"tensor": 2}},
            "spec.parallelism: tensor x pipeline (2 x 1) must equal resources.gpus x nodes (0 x 1 = 0)",
        ),
        (
            {"model": {"source": "/m"}, "runtime": {"imagePullPolicy": "Sometimes"}},
            "spec.runtime.imagePullPolicy: must be one of Always, IfNotPresent, Never",
        ),
        (
            {"model": {"source": "/m"}, "scheduling": {"nodeSelector": {"pool": "x" * 64}}},
            "spec.scheduling.nodeSelector[pool]: 'xxx",
        ),
        (
            {"model": {"source": "/m"}, "scheduling": {"nodeSelector": {"bad key!": "a"}}},
            "spec.scheduling.nodeSelector: key 'bad key!'",
        ),
        (
            {"model": {"source": "/m"}, "scheduling": {"affinity": {"nodeAffinity": {"required": []}}}},
            "spec.scheduling.affinity.nodeAffinity.required: unknown field",
        ),
        (
            {
                "model": {"source": "/m"},
                "scheduling": {
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "Is"}]}]
                            }
                        }
                    }
                },
            },
            "nodeSelectorTerms[0].matchExpressions[0].operator: must be one of",
        ),
        (
            {"model": {"source": "/m"}, "scheduling": {"tolerations": [{"key": "a", "effect": "Never"}]}},
            "spec.scheduling.tolerations[0].effect: must be one of",
        ),
        (
            {"model": {"source": "/m"}, "scheduling": {"topologySpreadConstraints": [{"maxSkew": 1}]}},
            "spec.scheduling.topologySpreadConstraints[0].topologyKey: is required",
        ),
        (
            {"model": {"source": "/m"}, "rollout": {"maxSurge": 0, "maxUnavailable": 0}},
            "cannot both be 0",
        ),
        ({"model": {"source": "/m"}, "rollout": {"maxSurge": "150%"}}, "spec.rollout.maxSurge: must be"),
        (
            {"model": {"source": "/m"}, "service": {"annotations": {"a": 1}}},
            "an annotation value must be a string",
        ),
        (
            {"model": {"source": "/m"}, "runtime": {"maxNumSeqs": 0}},
            "spec.runtime.maxNumSeqs: must be between 1 and",
        ),
        (
            {"model": {"source": "/m"}, "runtime": {"blockSize": 12}},
            "spec.runtime.blockSize: must be one of 8, 16",
        ),
        ({"model": {"source": "/m", "cacheSize": "1Gi"}}, "apply only to hf:// sources"),
        (
            {"model": {"source": "/m"}, "server": {"apiKeySecretRef": {"name": "Key"}}},
            "not a valid object name",
        ),
        ({"model": {"source": "hf://org/name/weights.bin"}}, "hf://ORG/NAME/FILE.gguf"),
        (
            {"model": {"source": "/m"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
            "less than or equal",
        ),
        ({"model": {"source": "/m", "revision": "main"}}, "applies only to hf:// sources"),
        (
            {"model": {"source": "/m"}, "runtime": {"extraArgs": ["--model=/x"]}},
            "--model is set by the operator",
        ),
        ({"model": {"source": "/m"}, "replicas": "two"}, "spec.replicas: must be an integer"),
        ({"model": {"source": "/m", "tokenSecretRef": {}}}, "the Secret's name is required"),
        ({}, "spec.model: is required"),
        (
            {"model": {"source": "/m"}, "runtime": {"kvCacheDtype": "int8"}},
            "spec.runtime.kvCacheDtype: must be one of auto, float32, float16, bfloat16, fp8",
        ),
        (
            {
                "model": {"source": "/m"},
                "autoscaling": {"maxReplicas": 2, "targets": {"interTokenLatencySeconds": 0}},
            },
            "spec.autoscaling.targets.interTokenLatencySeconds: must be between 0.001 and 60",
        ),
        (
            {"model": {"source": "/m"}, "runtime": {"speculativeDecoding": {"method": "layer_skip"}}},
            "spec.runtime.speculativeDecoding.numSpeculativeTokens: is required",
        ),
        (
            {
                "model": {"source": "/m"},
                "runtime": {"speculativeDecoding": {"method": "layer_skip", "numSpeculativeTokens": 3}},
            },
            "spec.runtime.speculativeDecoding.numLayers: is required for method 'layer_skip'",
        ),
        (
            {
                "model": {"source": "/m"},
                "runtime": {
                    "speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 3, "numLayers": 2}
                },
            },
            "spec.runtime.speculativeDecoding.numLayers: does not apply to method 'ngram'",
        ),
        (
            {"model": {"source": "/m"}, "runtime": {"speculativeDecoding": "ngram"}},
            "spec.runtime.speculativeDecoding: must be an object",
        ),
        # What the CRD refuses, the parser refuses too (the same declaration states both).
        (
            {"model": {"source": "/m"}, "monitoring": {"interval": "often"}},
            "spec.monitoring.interval: must be a duration such as 15s, 500ms or 1m, got 'often'",
        ),
        (
            {"model": {"source": "hf://org/name", "revision": "r" * 256}},
            "spec.model.revision: must be at most 255 characters, got 256",
        ),
        (
            {"model": {"source": "/m"}, "runtime": {"extraArgs": ["--x"] * 65}},
            "spec.runtime.extraArgs: may hold at most 64 items, got 65",
        ),
        (
            {"model": {"source": "/m"}, "scheduling": {"priorityClassName": ""}},
            "spec.scheduling.priorityClassName: '' is not a valid object name",
        ),
        (
            {"model": {"source": "/m"}, "runtime": {"blockSize": 16.5}},
            "spec.runtime.blockSize: must be an integer, got 16.5",
        ),
        (
            {"model": {"source": "/m"}, "replicas": 1e19},
            "spec.replicas: must be an integer, got 1e+19",  # beyond int64: the API server's float
        ),
    ],
)
def test_specs_the_operator_rejects(spec: dict, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    assert message in str(caught.value)


def test_integral_floats_are_integers_as_the_api_server_reads_them() -> None:
    """The API server takes a float without a fraction for a field of type integer (and stores
    it as that integer); so does the operator, and `kvasir render` with it."""
    spec = parse_spec(
        {
            "model": {"source": "/m"},
            "replicas": 3.0,
            "runtime": {"blockSize": 16.0, "maxNumSeqs": 1e2},
            "rollout": {"maxSurge": 2.0},
            "autoscaling": {"minReplicas": 2.0, "maxReplicas": 4.0},
        }
    )
    values = (spec.replicas, spec.runtime.block_size, spec.runtime.max_num_seqs, spec.rollout.max_surge)
    assert values == (3, 16, 100, 2) and all(type(v) is int for v in values)
    assert spec.autoscaling is not None and (
        spec.autoscaling.min_replicas,
        spec.autoscaling.max_replicas,
    ) == (2, 4)
    assert type(spec.autoscaling.max_replicas) is int


@pytest.mark.parametrize("name", ["9lives", "Demo", "a" * 64, "has.dot", "ends-"])
def test_names_that_cannot_name_a_service(name: str) -> None:
    with pytest.raises(SpecError, match=r"metadata.name: .* is not a DNS-1035 label"):
        parse_name(name)


def test_null_is_absent() -> None:
    """The API server prunes a null before defaulting, so the parser reads it as absent too."""
    spec = parse_spec({"model": {"source": "/m", "revision": None}, "runtime": {"maxNumSeqs": None}})
    assert spec.runtime.max_num_seqs == 256 and spec.model.revision is None


def test_scale_to_zero_needs_the_router_and_keeps_replicas_at_zero() -> None:
    model = {"source": "hf://org/m"}
    policy = {"minReplicas": 0, "maxReplicas": 3}
    with pytest.raises(SpecError, match=r"spec.autoscaling.minReplicas: 0 needs routing.mode kvasir"):
        parse_spec({"model": model, "autoscaling": policy})
    with pytest.raises(SpecError, match=r"needs routing.mode kvasir"):
        parse_spec({"model": model, "autoscaling": policy, "routing": {"mode": "gateway"}})
    spec = parse_spec({"model": model, "replicas": 0, "autoscaling": policy, "routing": {"mode": "kvasir"}})
    assert spec.desired_replicas == 0  # zero is within the bounds: no replica runs
    assert spec.autoscaling is not None
    assert (spec.autoscaling.idle_seconds, spec.autoscaling.hold_seconds, spec.autoscaling.max_held) == (
        900,
        300,
        100,
    )
