"""The LLMDeployment spec as frozen dataclasses: parsed once, with the CRD's defaults, then trusted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvasir.operator.source import ModelSource, SpecError, parse_model_source

# Defaults live here and in the CRD; tests/operator/test_crd_schema.py checks that they agree.
DEFAULT_IMAGE = "ghcr.io/kvasir-project/kvasir:0.1.0"


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str = "token"


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource
    revision: str | None = None
    served_name: str | None = None
    token_secret: SecretKeyRef | None = None
    cache_size: str | None = None

    @property
    def served_model_name(self) -> str:
        return self.served_name or self.source.default_served_name


@dataclass(frozen=True)
class RuntimeSpec:
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_cache_memory_fraction: float = 0.9
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    drain_timeout_seconds: int = 30
    startup_timeout_seconds: int = 1800
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = 1
    gpu_resource_name: str = "nvidia.com/gpu"
    cpu: str = "4"
    memory: str = "16Gi"
    shm_size: str = "1Gi"


@dataclass(frozen=True)
class AutoscalingSpec:
    max_replicas: int
    min_replicas: int = 1
    target_kv_cache_usage: float = 0.8
    target_queue_per_replica: float = 4.0
    target_latency_ratio: float = 5.0
    interval_seconds: int = 15
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300


@dataclass(frozen=True)
class ServiceSpec:
    type: str = "ClusterIP"
    port: int = 8000
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulingSpec:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None


@dataclass(frozen=True)
class MonitoringSpec:
    enabled: bool = True
    interval: str = "15s"


@dataclass(frozen=True)
class LLMDeploymentSpec:
    """What the user asked for; `replicas` is None exactly when `autoscaling` is set."""

    model: ModelSpec
    runtime: RuntimeSpec = RuntimeSpec()
    resources: ResourcesSpec = ResourcesSpec()
    replicas: int | None = None
    autoscaling: AutoscalingSpec | None = None
    service: ServiceSpec = ServiceSpec()
    scheduling: SchedulingSpec = SchedulingSpec()
    monitoring: MonitoringSpec = MonitoringSpec()

    @property
    def desired_replicas(self) -> int:
        """The replica count to run now: the fixed count, or the autoscaler's floor until it decides."""
        if self.autoscaling is not None:
            return self.autoscaling.min_replicas
        return 1 if self.replicas is None else self.replicas


def _section(spec: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = spec.get(key) or {}
    if not isinstance(value, Mapping):
        raise SpecError(f"spec.{key}", "must be an object")
    return value


def _int(section: Mapping[str, Any], key: str, path: str, default: int, low: int, high: int) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path}.{key}", f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise SpecError(f"{path}.{key}", f"must be between {low} and {high}, got {value}")
    return value


def _float(section: Mapping[str, Any], key: str, path: str, default: float, low: float, high: float) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{path}.{key}", f"must be a number, got {value!r}")
    if not low <= value <= high:
        raise SpecError(f"{path}.{key}", f"must be between {low} and {high}, got {value}")
    return float(value)


def _strings(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise SpecError(path, "must be a list of strings")
    if not all(isinstance(item, str) for item in value):
        raise SpecError(path, "must be a list of strings")
    return tuple(value)


def _model(section: Mapping[str, Any]) -> ModelSpec:
    source = parse_model_source(section.get("source", ""))
    revision = section.get("revision")
    if revision is not None and source.kind.value != "hf":
        raise SpecError("spec.model.revision", "a revision applies only to hf:// sources")
    token: SecretKeyRef | None = None
    ref = section.get("tokenSecretRef")
    if ref is not None:
        if not isinstance(ref, Mapping) or not ref.get("name"):
            raise SpecError("spec.model.tokenSecretRef.name", "the Secret's name is required")
        token = SecretKeyRef(name=str(ref["name"]), key=str(ref.get("key") or "token"))
    return ModelSpec(
        source=source,
        revision=revision,
        served_name=section.get("servedName"),
        token_secret=token,
        cache_size=section.get("cacheSize"),
    )


# Flags the operator sets itself: letting extraArgs repeat them would make the pod disagree with its
# probes (port) or with the model volume (model, download dir).
RESERVED_FLAGS = ("--model", "--port", "--download-dir")


def _runtime(section: Mapping[str, Any]) -> RuntimeSpec:
    path = "spec.runtime"
    defaults = RuntimeSpec()
    extra = _strings(section.get("extraArgs", []), f"{path}.extraArgs")
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_FLAGS:
            raise SpecError(f"{path}.extraArgs", f"{flag} is set by the operator and cannot be overridden")
    max_len = section.get("maxModelLen")
    return RuntimeSpec(
        image=str(section.get("image") or defaults.image),
        image_pull_policy=str(section.get("imagePullPolicy") or defaults.image_pull_policy),
        dtype=str(section.get("dtype") or defaults.dtype),
        max_model_len=None if max_len is None else _int(section, "maxModelLen", path, 0, 1, 10_000_000),
        max_num_seqs=_int(section, "maxNumSeqs", path, defaults.max_num_seqs, 1, 65536),
        max_num_batched_tokens=_int(
            section, "maxNumBatchedTokens", path, defaults.max_num_batched_tokens, 1, 10_000_000
        ),
        block_size=_int(section, "blockSize", path, defaults.block_size, 1, 1024),
        kv_cache_memory_fraction=_float(
            section, "kvCacheMemoryFraction", path, defaults.kv_cache_memory_fraction, 0.01, 1.0
        ),
        kv_cache_dtype=_choice(section, "kvCacheDtype", path, defaults.kv_cache_dtype, ("auto", "fp8")),
        enable_prefix_caching=bool(section.get("enablePrefixCaching", defaults.enable_prefix_caching)),
        drain_timeout_seconds=_int(
            section, "drainTimeoutSeconds", path, defaults.drain_timeout_seconds, 0, 3600
        ),
        startup_timeout_seconds=_int(
            section, "startupTimeoutSeconds", path, defaults.startup_timeout_seconds, 30, 86400
        ),
        extra_args=extra,
    )


def _choice(section: Mapping[str, Any], key: str, path: str, default: str, allowed: tuple[str, ...]) -> str:
    value = str(section.get(key) or default)
    if value not in allowed:
        raise SpecError(f"{path}.{key}", f"must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _resources(section: Mapping[str, Any]) -> ResourcesSpec:
    defaults = ResourcesSpec()
    return ResourcesSpec(
        gpus=_int(section, "gpus", "spec.resources", defaults.gpus, 0, 64),
        gpu_resource_name=str(section.get("gpuResourceName") or defaults.gpu_resource_name),
        cpu=str(section.get("cpu", defaults.cpu)),
        memory=str(section.get("memory", defaults.memory)),
        shm_size=str(section.get("shmSize", defaults.shm_size)),
    )


def _autoscaling(section: Mapping[str, Any]) -> AutoscalingSpec:
    path = "spec.autoscaling"
    if "maxReplicas" not in section:
        raise SpecError(f"{path}.maxReplicas", "is required")
    targets = section.get("targets") or {}
    windows = section.get("windows") or {}
    d = AutoscalingSpec(max_replicas=1)
    spec = AutoscalingSpec(
        max_replicas=_int(section, "maxReplicas", path, 1, 1, 10_000),
        min_replicas=_int(section, "minReplicas", path, d.min_replicas, 0, 10_000),
        target_kv_cache_usage=_float(
            targets, "kvCacheUsage", f"{path}.targets", d.target_kv_cache_usage, 0, 1
        ),
        target_queue_per_replica=_float(
            targets, "queuePerReplica", f"{path}.targets", d.target_queue_per_replica, 0, 1e6
        ),
        target_latency_ratio=_float(
            targets, "latencyRatio", f"{path}.targets", d.target_latency_ratio, 1, 1000
        ),
        interval_seconds=_int(windows, "intervalSeconds", f"{path}.windows", d.interval_seconds, 1, 3600),
        scale_up_stabilization_seconds=_int(
            windows, "scaleUpSeconds", f"{path}.windows", d.scale_up_stabilization_seconds, 0, 3600
        ),
        scale_down_stabilization_seconds=_int(
            windows, "scaleDownSeconds", f"{path}.windows", d.scale_down_stabilization_seconds, 0, 86400
        ),
    )
    if spec.min_replicas > spec.max_replicas:
        raise SpecError(f"{path}.minReplicas", "must be less than or equal to maxReplicas")
    return spec


def _scheduling(section: Mapping[str, Any]) -> SchedulingSpec:
    tolerations = section.get("tolerations") or []
    if not isinstance(tolerations, Sequence) or not all(isinstance(t, Mapping) for t in tolerations):
        raise SpecError("spec.scheduling.tolerations", "must be a list of objects")
    return SchedulingSpec(
        node_selector=dict(section.get("nodeSelector") or {}),
        tolerations=tuple(dict(t) for t in tolerations),
        affinity=dict(section["affinity"]) if section.get("affinity") else None,
        priority_class_name=section.get("priorityClassName") or None,
    )


def parse_spec(spec: Mapping[str, Any]) -> LLMDeploymentSpec:
    """Parse `.spec` of an LLMDeployment, filling the CRD's defaults; raises SpecError when unusable."""
    if not isinstance(spec, Mapping):
        raise SpecError("spec", "must be an object")
    if "model" not in spec:
        raise SpecError("spec.model", "is required")
    replicas = spec.get("replicas")
    autoscaling = spec.get("autoscaling")
    if replicas is not None and autoscaling is not None:
        raise SpecError("spec", "replicas and autoscaling are mutually exclusive")
    service = _section(spec, "service")
    monitoring = _section(spec, "monitoring")
    return LLMDeploymentSpec(
        model=_model(_section(spec, "model")),
        runtime=_runtime(_section(spec, "runtime")),
        resources=_resources(_section(spec, "resources")),
        replicas=None if replicas is None else _int(spec, "replicas", "spec", 1, 0, 10_000),
        autoscaling=None if autoscaling is None else _autoscaling(_section(spec, "autoscaling")),
        service=ServiceSpec(
            type=str(service.get("type") or "ClusterIP"),
            port=_int(service, "port", "spec.service", ServiceSpec().port, 1, 65535),
            annotations=dict(service.get("annotations") or {}),
        ),
        scheduling=_scheduling(_section(spec, "scheduling")),
        monitoring=MonitoringSpec(
            enabled=bool(monitoring.get("enabled", True)),
            interval=str(monitoring.get("interval") or MonitoringSpec().interval),
        ),
    )
