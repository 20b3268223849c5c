"""Pure builders of the runtime's Deployment: spec in, a plain manifest dict out (no API calls)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvasir.operator import naming
from kvasir.operator.api.source import SourceKind
from kvasir.operator.api.spec import LLMDeploymentSpec
from kvasir.operator.children.lora import lora_args, lora_volumes
from kvasir.operator.children.parallel import parallel_args, shm_size

MODEL_DIR = "/models"
# The pod stops receiving new connections only after the endpoints controller has removed it;
# pausing before SIGTERM covers that propagation delay, then the runtime drains.
PRESTOP_PAUSE_SECONDS = 5
# Headroom after the drain for the process to flush and exit before the kubelet sends SIGKILL.
GRACE_MARGIN_SECONDS = 15
STARTUP_PERIOD_SECONDS = 10
RUN_AS_USER = 1000
# `kvasir serve --api-key` read from the environment (every flag has a KVASIR_* variable).
API_KEY_ENV = "KVASIR_API_KEY"


def build_runtime_args(spec: LLMDeploymentSpec) -> list[str]:
    """The `kvasir serve` argument list for one replica (extraArgs last)."""
    model, runtime = spec.model, spec.runtime
    if model.source.kind is SourceKind.HUGGING_FACE:
        model_arg = model.source.hub_model
    elif model.source.kind is SourceKind.PVC:
        model_arg = f"{MODEL_DIR}/{model.source.path}".rstrip("/")
    else:
        model_arg = model.source.path
    args = ["serve", "--model", model_arg]
    if model.revision:
        args += ["--revision", model.revision]
    args += ["--served-model-name", model.served_model_name, "--dtype", runtime.dtype]
    if model.quantization is not None:
        args += ["--quantization", model.quantization]
    if runtime.max_model_len is not None:
        args += ["--max-model-len", str(runtime.max_model_len)]
    args += ["--max-num-seqs", str(runtime.max_num_seqs)]
    if runtime.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(runtime.max_num_batched_tokens)]
    args += [
        "--block-size",
        str(runtime.block_size),
        "--kv-cache-memory-fraction",
        str(runtime.kv_cache_memory_fraction),
        "--kv-cache-dtype",
        runtime.kv_cache_dtype,
        "--enable-prefix-caching" if runtime.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if runtime.speculative_decoding is not None:
        args += ["--speculative-config", runtime.speculative_decoding.to_json()]
    if model.source.kind is SourceKind.HUGGING_FACE:
        args += ["--download-dir", MODEL_DIR]
    # Every interface: `kvasir serve` listens on 127.0.0.1 unless told, and the Service, the probes
    # and the router reach the pod at its own address.
    args += ["--host", "0.0.0.0", "--port", str(naming.RUNTIME_PORT)]
    args += ["--drain-timeout", str(runtime.drain_timeout_seconds)]
    args += parallel_args(spec)
    args += lora_args(spec)
    return args + list(runtime.extra_args)


def termination_grace_seconds(spec: LLMDeploymentSpec) -> int:
    """Longer than preStop pause + drain, so SIGKILL never cuts a drain short."""
    return PRESTOP_PAUSE_SECONDS + spec.runtime.drain_timeout_seconds + GRACE_MARGIN_SECONDS


def _env(spec: LLMDeploymentSpec) -> list[dict[str, Any]]:
    # The root filesystem is read-only: every cache the libraries write must point at a volume.
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": f"{MODEL_DIR}/.hf" if _has_cache(spec) else "/tmp/hf"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
    ]
    # Secrets reach the runtime as environment variables read from the Secret, never in the CR.
    token = spec.model.token_secret
    if token is not None:
        ref = {"name": token.name, "key": token.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    api_key = spec.server.api_key_secret
    if api_key is not None:
        ref = {"name": api_key.name, "key": api_key.key}
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": ref}})
    return env


def _has_cache(spec: LLMDeploymentSpec) -> bool:
    return spec.model.source.kind is SourceKind.HUGGING_FACE


def _volumes(name: str, spec: LLMDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts): shared memory, scratch, and the model cache or the model's claim."""
    shm: dict[str, Any] = {"medium": "Memory", "sizeLimit": shm_size(spec)}
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": shm},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    source = spec.model.source
    if source.kind is SourceKind.PVC:
        claim = {"claimName": source.claim, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    elif source.kind is SourceKind.HUGGING_FACE and spec.model.cache_volume_claim:
        # A shared (ReadWriteMany) claim: the first replica downloads, the others find the files.
        claim = {"claimName": spec.model.cache_volume_claim}
        volumes.append({"name": "model-cache", "persistentVolumeClaim": claim})
        mounts.append({"name": "model-cache", "mountPath": MODEL_DIR})
    elif source.kind is SourceKind.HUGGING_FACE:
        cache: dict[str, Any] = {}
        if spec.model.cache_size:
            cache["sizeLimit"] = spec.model.cache_size
        volumes.append({"name": "model-cache", "emptyDir": cache})
        mounts.append({"name": "model-cache", "mountPath": MODEL_DIR})
    lora_vols, lora_mounts = lora_volumes(name, spec)
    return volumes + lora_vols, mounts + lora_mounts


def _resources(spec: LLMDeploymentSpec) -> dict[str, Any]:
    # Quantities are in the API server's canonical form (the spec parser made them so): what is
    # sent is what is stored, and an unchanged spec compares equal to the live object.
    res = spec.resources
    requests: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    limits: dict[str, Any] = {"memory": res.memory}
    if spec.model.cache_size and not spec.model.cache_volume_claim:
        # The emptyDir download cache lives on the node's disk: let the scheduler account for it.
        requests["ephemeral-storage"] = spec.model.cache_size
    if res.gpus > 0:
        # Extended resources must have request == limit; setting the limit alone implies both.
        limits[res.gpu_resource_name] = str(res.gpus)
    return {"requests": requests, "limits": limits}


def _probes() -> dict[str, Any]:
    port = naming.RUNTIME_PORT_NAME
    return {
        "readinessProbe": {
            "httpGet": {"path": naming.READY_PATH, "port": port},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": naming.HEALTH_PATH, "port": port},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def _startup_probe(spec: LLMDeploymentSpec) -> dict[str, Any]:
    # Liveness stays off until this passes, so a long download or load is never mistaken for a hang.
    # It probes readiness, not liveness: /health answers 200 while the model loads, so probing it
    # would pass at once and a hung download would never be restarted; /ready turns 200 only once
    # the model is loaded (and a pod that is starting is never draining).
    threshold = max(1, math.ceil(spec.runtime.startup_timeout_seconds / STARTUP_PERIOD_SECONDS))
    return {
        "httpGet": {"path": naming.READY_PATH, "port": naming.RUNTIME_PORT_NAME},
        "periodSeconds": STARTUP_PERIOD_SECONDS,
        "timeoutSeconds": 5,
        "failureThreshold": threshold,
    }


def _container(name: str, spec: LLMDeploymentSpec) -> dict[str, Any]:
    _, mounts = _volumes(name, spec)
    container: dict[str, Any] = {
        "name": naming.CONTAINER_NAME,
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["kvasir"],
        "args": build_runtime_args(spec),
        "ports": [
            {"name": naming.RUNTIME_PORT_NAME, "containerPort": naming.RUNTIME_PORT, "protocol": "TCP"}
        ],
        "env": _env(spec),
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "startupProbe": _startup_probe(spec),
        **_probes(),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_PAUSE_SECONDS}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return container


def _pod_spec(name: str, spec: LLMDeploymentSpec) -> dict[str, Any]:
    volumes, _ = _volumes(name, spec)
    pod: dict[str, Any] = {
        "containers": [_container(name, spec)],
        "volumes": volumes,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        # The runtime never talks to the Kubernetes API: no token in the pod, no service-link env.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if spec.runtime.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in spec.runtime.image_pull_secrets]
    scheduling = spec.scheduling
    if scheduling.node_selector:
        pod["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        pod["tolerations"] = [dict(t) for t in scheduling.tolerations]
    if scheduling.affinity:
        pod["affinity"] = dict(scheduling.affinity)
    if scheduling.topology_spread_constraints:
        pod["topologySpreadConstraints"] = [
            _spread_over_own_pods(constraint, name) for constraint in scheduling.topology_spread_constraints
        ]
    if scheduling.priority_class_name:
        pod["priorityClassName"] = scheduling.priority_class_name
    if scheduling.runtime_class_name:
        pod["runtimeClassName"] = scheduling.runtime_class_name
    return pod


def _spread_over_own_pods(constraint: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A constraint without a labelSelector counts no pods at all; default it to this deployment's."""
    spread = dict(constraint)
    spread.setdefault("labelSelector", {"matchLabels": naming.selector_labels(name)})
    return spread


def pod_template(name: str, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The runtime pod's template (labels, scrape annotations, spec): a Deployment's, and a
    LeaderWorkerSet's leader and workers (children/leaderworkerset.py)."""
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(naming.RUNTIME_PORT),
        "prometheus.io/path": naming.METRICS_PATH,
    }
    labels = naming.common_labels(name, spec.runtime.image)
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": _pod_spec(name, spec)}


def build_deployment(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict[str, Any]:
    """The apps/v1 Deployment running `spec.desired_replicas` runtime pods; same name as the parent."""
    labels = naming.common_labels(name, spec.runtime.image)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": spec.desired_replicas,
            "selector": {"matchLabels": naming.selector_labels(name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxUnavailable": spec.rollout.max_unavailable,
                    "maxSurge": spec.rollout.max_surge,
                },
            },
            # A rollout is stuck only well after a replica could have loaded its model.
            "progressDeadlineSeconds": spec.runtime.startup_timeout_seconds + 600,
            "revisionHistoryLimit": 5,
            "template": pod_template(name, spec),
        },
    }
