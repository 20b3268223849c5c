"""LLMDeployments the API server must refuse, with the message kube-apiserver 1.36 gives for each (its
first error; a pattern message goes on with the pattern), as read off a real server. Checked by the
emulator in tests/operator and by a real kube-apiserver in tests/e2e."""

from __future__ import annotations

import copy
from typing import Any


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


SOURCE = "model.source must be hf://ORG/NAME, hf://ORG/NAME/FILE.gguf, pvc://CLAIM[/PATH] or an absolute path"
INVALID = [
    (
        "min-above-max",
        {"spec": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
        "spec.autoscaling: Invalid value: autoscaling.minReplicas must be less than or equal to autoscaling.maxReplicas",
    ),
    (
        "no-max-replicas",
        {"spec": {"autoscaling": {"minReplicas": 1}}},
        "spec.autoscaling.maxReplicas: Required value",
    ),
    (
        "no-source",
        {"spec": {"model": {"source": None, "servedName": "x"}}},
        "spec.model.source: Required value",
    ),
    ("no-model", {"spec": {"model": None, "replicas": 1}}, "spec.model: Required value"),
    (
        "s3-source",
        {"spec": {"model": {"source": "s3://bucket/llama"}}},
        f'spec.model.source: Invalid value: "s3://bucket/llama": {SOURCE}',
    ),
    (
        "hf-without-name",
        {"spec": {"model": {"source": "hf://meta-llama"}}},
        f'spec.model.source: Invalid value: "hf://meta-llama": {SOURCE}',
    ),
    (
        "relative-path",
        {"spec": {"model": {"source": "models/llama"}}},
        f'spec.model.source: Invalid value: "models/llama": {SOURCE}',
    ),
    (
        "revision-on-pvc",
        {"spec": {"model": {"source": "pvc://store/llama", "revision": "main"}}},
        "spec.model: Invalid value: model.revision applies only to hf:// sources",
    ),
    (
        "secret-without-name",
        {"spec": {"model": {"tokenSecretRef": {"key": "token"}}}},
        "spec.model.tokenSecretRef.name: Required value",
    ),
    (
        "kv-fraction-too-high",
        {"spec": {"runtime": {"kvCacheMemoryFraction": 1.5}}},
        "spec.runtime.kvCacheMemoryFraction: Invalid value: 1.5: runtime.kvCacheMemoryFraction must be between 0.01 and 0.98",
    ),
    # Integer input: kube-openapi would compare it with a truncated bound (0), hence CEL ranges.
    (
        "kv-fraction-integer-zero",
        {"spec": {"runtime": {"kvCacheMemoryFraction": 0}}},
        "spec.runtime.kvCacheMemoryFraction: Invalid value: 0: runtime.kvCacheMemoryFraction must be between 0.01 and 0.98",
    ),
    (
        "kv-fraction-integer-one",
        {"spec": {"runtime": {"kvCacheMemoryFraction": 1}}},
        "spec.runtime.kvCacheMemoryFraction: Invalid value: 1: runtime.kvCacheMemoryFraction must be between 0.01 and 0.98",
    ),
    (
        "tolerance-integer-one",
        {"spec": {"autoscaling": {"maxReplicas": 2, "behavior": {"tolerance": 1}}}},
        "spec.autoscaling.behavior.tolerance: Invalid value: 1: autoscaling.behavior.tolerance must be between 0 and 0.5",
    ),
    (
        "min-replicas-zero-without-router",
        {"spec": {"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}},
        "spec: Invalid value: autoscaling.minReplicas 0 needs routing.mode kvasir",
    ),
    (
        "scale-to-zero-idle-zero",
        {"spec": {"autoscaling": {"maxReplicas": 2, "scaleToZero": {"idleSeconds": 0}}}},
        "spec.autoscaling.scaleToZero.idleSeconds: Invalid value: 0: spec.autoscaling.scaleToZero.idleSeconds in body should be greater than or equal to 1",
    ),
    (
        "kv-target-zero",
        {"spec": {"autoscaling": {"maxReplicas": 2, "targets": {"kvCacheUsage": 0}}}},
        "spec.autoscaling.targets.kvCacheUsage: Invalid value: 0: autoscaling.targets.kvCacheUsage must be between 0.05 and 1",
    ),
    (
        "block-size",
        {"spec": {"runtime": {"blockSize": 12}}},
        'spec.runtime.blockSize: Unsupported value: 12: supported values: "8", "16", "32", "64", "128"',
    ),
    (
        "kv-cache-dtype",
        {"spec": {"runtime": {"kvCacheDtype": "int8"}}},
        'spec.runtime.kvCacheDtype: Unsupported value: "int8": supported values: "auto", "float32", "float16", "bfloat16", "fp8"',
    ),
    (
        "dtype",
        {"spec": {"runtime": {"dtype": "int4"}}},
        'spec.runtime.dtype: Unsupported value: "int4": supported values: "auto", "float32", "float16", "bfloat16"',
    ),
    (
        "quantization",
        {"spec": {"model": {"quantization": "int4"}}},
        'spec.model.quantization: Unsupported value: "int4": supported values: "gguf", "fp8", "awq", "gptq"',
    ),
    (
        "routing-mode",
        {"spec": {"routing": {"mode": "random"}}},
        'spec.routing.mode: Unsupported value: "random": supported values: "none", "kvasir", "gateway"',
    ),
    (
        "routing-picker-without-gateway",
        {"spec": {"routing": {"mode": "kvasir", "endpointPicker": {"service": "epp"}}}},
        "spec.routing: Invalid value: routing.endpointPicker applies only to mode gateway",
    ),
    (
        "routing-picker-service-and-image",
        {"spec": {"routing": {"mode": "gateway", "endpointPicker": {"service": "epp", "image": "epp:v1"}}}},
        "spec.routing.endpointPicker: Invalid value: routing.endpointPicker.image applies only when the "
        "operator deploys the picker (no service)",
    ),
    (
        "routing-picker-service-name",
        {"spec": {"routing": {"mode": "gateway", "endpointPicker": {"service": "9-epp"}}}},
        'spec.routing.endpointPicker.service: Invalid value: "9-epp": spec.routing.endpointPicker.service in body should match',
    ),
    (
        "routing-picker-failure-mode",
        {
            "spec": {
                "routing": {"mode": "gateway", "endpointPicker": {"service": "epp", "failureMode": "Open"}}
            }
        },
        'spec.routing.endpointPicker.failureMode: Unsupported value: "Open": supported values: "FailClose", "FailOpen"',
    ),
    (
        "negative-replicas",
        {"spec": {"replicas": -1}},
        "spec.replicas: Invalid value: -1: spec.replicas in body should be greater than or equal to 0",
    ),
    (
        "too-many-gpus",
        {"spec": {"resources": {"gpus": 9}}},
        "spec.resources.gpus: Invalid value: 9: spec.resources.gpus in body should be less than or equal to 8",
    ),
    (
        "parallelism-split",
        {"spec": {"resources": {"gpus": 4}, "parallelism": {"tensor": 2, "nodes": 2}}},
        "spec: Invalid value: parallelism.tensor x parallelism.pipeline must equal resources.gpus x "
        "parallelism.nodes (the GPUs of one replica)",
    ),
    (
        "pipeline-stages",
        {"spec": {"resources": {"gpus": 8}, "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}}},
        "spec.parallelism: Invalid value: parallelism.pipeline above 1 is not supported: the runtime has no "
        "pipeline parallelism; split a model across nodes with parallelism.tensor (resources.gpus x "
        "parallelism.nodes)",
    ),
    (
        "pull-policy",
        {"spec": {"runtime": {"imagePullPolicy": "Sometimes"}}},
        'spec.runtime.imagePullPolicy: Unsupported value: "Sometimes": supported values: "Always", "IfNotPresent", "Never"',
    ),
    (
        "rollout-both-zero",
        {"spec": {"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}},
        "spec.rollout: Invalid value: rollout.maxSurge and rollout.maxUnavailable cannot both be 0: the rollout could never progress",
    ),
    (
        "rollout-not-a-percentage",
        {"spec": {"rollout": {"maxSurge": "one"}}},
        'spec.rollout.maxSurge: Invalid value: "one": rollout.maxSurge must be a count',
    ),
    (
        "cache-on-pvc",
        {"spec": {"model": {"source": "pvc://store/llama", "cacheSize": "10Gi"}}},
        "spec.model: Invalid value: model.cacheSize and model.cacheVolumeClaim apply only to hf:// sources (a download cache)",
    ),
    (
        "cache-twice",
        {"spec": {"model": {"cacheSize": "10Gi", "cacheVolumeClaim": "models"}}},
        "spec.model: Invalid value: set model.cacheSize (a per-pod emptyDir) or model.cacheVolumeClaim (a shared claim), not both",
    ),
    (
        "node-selector-value-too-long",
        {"spec": {"scheduling": {"nodeSelector": {"pool": "x" * 64}}}},
        "spec.scheduling.nodeSelector.pool: Too long: may not be more than 63 bytes",
    ),
    (
        "affinity-typo",
        {"spec": {"scheduling": {"affinity": {"nodeAfinity": {}}}}},
        'unknown field "spec.scheduling.affinity.nodeAfinity"',
    ),
    (
        "spread-without-key",
        {
            "spec": {
                "scheduling": {
                    "topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]
                }
            }
        },
        "spec.scheduling.topologySpreadConstraints[0].topologyKey: Required value",
    ),
    (
        "priority-class",
        {"spec": {"scheduling": {"priorityClassName": "High_Priority"}}},
        'spec.scheduling.priorityClassName: Invalid value: "High_Priority"',
    ),
    (
        "api-key-without-name",
        {"spec": {"server": {"apiKeySecretRef": {"key": "k"}}}},
        "spec.server.apiKeySecretRef.name: Required value",
    ),
    (
        "gpu-resource-name",
        {"spec": {"resources": {"gpuResourceName": "gpu"}}},
        'spec.resources.gpuResourceName: Invalid value: "gpu": spec.resources.gpuResourceName in body should match',
    ),
    (
        "service-port",
        {"spec": {"service": {"port": 70000}}},
        "spec.service.port: Invalid value: 70000: spec.service.port in body should be less than or equal to 65535",
    ),
    (
        "service-type",
        {"spec": {"service": {"type": "Ingress"}}},
        'spec.service.type: Unsupported value: "Ingress": supported values: "ClusterIP", "NodePort", "LoadBalancer"',
    ),
    ("unknown-field", {"spec": {"gpus": 1}}, 'unknown field "spec.gpus"'),
    (
        "max-num-seqs-zero",
        {"spec": {"runtime": {"maxNumSeqs": 0}}},
        "spec.runtime.maxNumSeqs: Invalid value: 0: spec.runtime.maxNumSeqs in body should be greater than or equal to 1",
    ),
    (
        "extra-args-port",
        {"spec": {"runtime": {"extraArgs": ["--port=9000"]}}},
        "spec.runtime.extraArgs: Invalid value: runtime.extraArgs must not set --model, --port, --download-dir or "
        "--tensor-parallel-size: the operator sets them",
    ),
    (
        "speculative-draft-model-without-model",
        {"spec": {"runtime": {"speculativeDecoding": {"method": "draft_model", "numSpeculativeTokens": 4}}}},
        "spec.runtime.speculativeDecoding: Invalid value: speculativeDecoding.model is required for method draft_model and applies to no other",
    ),
    (
        "speculative-lookup-bounds-crossed",
        {
            "spec": {
                "runtime": {
                    "speculativeDecoding": {
                        "method": "ngram",
                        "numSpeculativeTokens": 4,
                        "promptLookupMax": 2,
                        "promptLookupMin": 5,
                    }
                }
            }
        },
        "spec.runtime.speculativeDecoding: Invalid value: speculativeDecoding.promptLookupMin must not exceed promptLookupMax",
    ),
    (
        "speculative-too-many-tokens",
        {"spec": {"runtime": {"speculativeDecoding": {"method": "ngram", "numSpeculativeTokens": 17}}}},
        "spec.runtime.speculativeDecoding.numSpeculativeTokens: Invalid value: 17: spec.runtime.speculativeDecoding.numSpeculativeTokens in body should be less than or equal to 16",
    ),
    (
        "replicas-as-string",
        {"spec": {"replicas": "3"}},
        'spec.replicas: Invalid value: "string": spec.replicas in body must be of type integer: "string"',
    ),
    (
        "name-not-dns-1035",
        {"metadata": {"name": "9lives"}},
        "<nil>: Invalid value: metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter, at most 63 characters): it names the Service",
    ),
    (
        "secret-name",
        {"spec": {"server": {"apiKeySecretRef": {"name": "API_KEY"}}}},
        'spec.server.apiKeySecretRef.name: Invalid value: "API_KEY": spec.server.apiKeySecretRef.name in body should match',
    ),
    (
        "memory-16GB",
        {"spec": {"resources": {"memory": "16GB"}}},
        'spec.resources.memory: Invalid value: "16GB": spec.resources.memory in body should match',
    ),
    (
        "memory-zero",
        {"spec": {"resources": {"memory": "0Gi"}}},
        'spec.resources.memory: Invalid value: "0Gi": resources.memory must be greater than 0',
    ),
    (
        "cpu-fractional-number",
        {"spec": {"resources": {"cpu": 0.5}}},
        'spec.resources.cpu: Invalid value: "number": spec.resources.cpu in body must be of type integer,string: "number"',
    ),
    (
        "shm-size",
        {"spec": {"resources": {"shmSize": "lots"}}},
        'spec.resources.shmSize: Invalid value: "lots": spec.resources.shmSize in body should match',
    ),
    (
        "lora-duplicate-names",
        {
            "spec": {
                "lora": [
                    {"name": "sql", "source": "pvc://adapters/sql", "rank": 8},
                    {"name": "sql", "source": "pvc://adapters/sql-v2", "rank": 8},
                ]
            }
        },
        "spec.lora: Invalid value: lora adapter names must be unique",
    ),
    (
        "lora-hf-file-source",
        {"spec": {"lora": [{"name": "sql", "source": "hf://org/sql-lora/x.gguf", "rank": 8}]}},
        'spec.lora[0].source: Invalid value: "hf://org/sql-lora/x.gguf": lora source must be pvc://CLAIM/PATH, hf://ORG/NAME or an absolute path under /adapters/ in the image',
    ),
    (
        "lora-revision-not-hf",
        {"spec": {"lora": [{"name": "sql", "source": "pvc://adapters/sql", "rank": 8, "revision": "v2"}]}},
        "spec.lora: Invalid value: a lora revision applies only to hf:// sources",
    ),
    (
        "lora-rank-too-large",
        {"spec": {"lora": [{"name": "sql", "source": "pvc://adapters/sql", "rank": 1024}]}},
        "spec.lora[0].rank: Invalid value: 1024: spec.lora[0].rank in body should be less than or equal to 512",
    ),
    (
        "lora-served-name",
        {
            "spec": {
                "model": {"servedName": "base"},
                "lora": [{"name": "base", "source": "pvc://adapters/sql", "rank": 8}],
            }
        },
        "spec: Invalid value: a lora adapter may not take the base model's servedName",
    ),
    (
        "lora-alias-weights",
        {
            "spec": {
                "lora": [
                    {"name": "v1", "source": "pvc://adapters/v1", "rank": 8},
                    {"name": "v2", "source": "pvc://adapters/v2", "rank": 8},
                ],
                "loraAliases": [
                    {
                        "name": "support",
                        "targets": [{"adapter": "v2", "weight": 90}, {"adapter": "v1", "weight": 20}],
                    }
                ],
            }
        },
        "spec.loraAliases: Invalid value: the weights of each loraAliases entry must sum to 100",
    ),
    (
        "lora-alias-unknown-adapter",
        {
            "spec": {
                "lora": [{"name": "v1", "source": "pvc://adapters/v1", "rank": 8}],
                "loraAliases": [{"name": "support", "targets": [{"adapter": "v3", "weight": 100}]}],
            }
        },
        "spec: Invalid value: every loraAliases target must name an adapter of spec.lora",
    ),
]
