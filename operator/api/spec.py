"""The LLMDeployment spec as frozen dataclasses: parsed once, with the CRD's defaults, then trusted.

Every runtime setting's default, choices and range come from the runtime's own flag table
(`kvasir.runtime.engine_args.ENGINE_FLAGS`, `kvasir.runtime.server.config.SERVER_FLAGS`), so the
operator can never pass a value `kvasir serve` refuses; tests/operator/test_runtime_contract.py
proves the CRD agrees with the same table."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvasir.operator.api import affinity, validation
from kvasir.operator.api.source import ModelSource, SourceKind, SpecError, parse_model_source
from kvasir.operator.autoscaler.policy import Policy, parse_policy
from kvasir.runtime.engine_args import engine_flag
from kvasir.runtime.server.config import server_flag
from kvasir.runtime.settings import Flag
from kvasir.runtime.spec_decode.config import SpeculativeConfig, parse_speculative_config

# Defaults live here and in the CRD; tests/operator/test_crd_schema.py checks that they agree.
DEFAULT_IMAGE = "ghcr.io/kvasir-project/kvasir:0.1.0"
IMAGE_PULL_POLICIES = ("Always", "IfNotPresent", "Never")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
# One model replica per GPU: the runtime has no tensor or pipeline parallelism yet.
MAX_GPUS_PER_REPLICA = 1


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource
    revision: str | None = None
    served_name: str | None = None
    token_secret: SecretKeyRef | None = None
    cache_size: str | None = None  # canonical quantity; the emptyDir's limit and storage request
    cache_volume_claim: str | None = None  # a shared (ReadWriteMany) claim used as the download cache

    @property
    def served_model_name(self) -> str:
        return self.served_name or self.source.default_served_name


@dataclass(frozen=True)
class RuntimeSpec:
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    dtype: str = engine_flag("--dtype").default
    max_model_len: int | None = None
    max_num_seqs: int = engine_flag("--max-num-seqs").default
    max_num_batched_tokens: int | None = None  # None: the runtime's default for its device
    block_size: int = engine_flag("--block-size").default
    kv_cache_memory_fraction: float = engine_flag("--kv-cache-memory-fraction").default
    kv_cache_dtype: str = engine_flag("--kv-cache-dtype").default
    enable_prefix_caching: bool = True
    speculative_decoding: SpeculativeConfig | None = None  # None: off
    drain_timeout_seconds: int = int(server_flag("--drain-timeout").default)
    startup_timeout_seconds: int = 1800
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerSpec:
    api_key_secret: SecretKeyRef | None = None


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = 1
    gpu_resource_name: str = "nvidia.com/gpu"
    cpu: str = "4"
    memory: str = "16Gi"
    shm_size: str = "1Gi"


@dataclass(frozen=True)
class RolloutSpec:
    """The Deployment's rolling update: by default a new pod starts before an old one stops."""

    max_surge: int | str = 1
    max_unavailable: int | str = 0


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
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    priority_class_name: str | None = None
    runtime_class_name: str | None = None


@dataclass(frozen=True)
class MonitoringSpec:
    enabled: bool = True
    interval: str = "15s"


@dataclass(frozen=True)
class LLMDeploymentSpec:
    """What the user asked for. `replicas` is the scale subresource's count (default 1); with
    `autoscaling` set, the autoscaler writes it and the operator keeps it within min and max."""

    model: ModelSpec
    runtime: RuntimeSpec = RuntimeSpec()
    server: ServerSpec = ServerSpec()
    resources: ResourcesSpec = ResourcesSpec()
    replicas: int = 1
    autoscaling: Policy | None = None  # declared in autoscaler/policy.py, with its CRD schema
    rollout: RolloutSpec = RolloutSpec()
    service: ServiceSpec = ServiceSpec()
    scheduling: SchedulingSpec = SchedulingSpec()
    monitoring: MonitoringSpec = MonitoringSpec()

    @property
    def desired_replicas(self) -> int:
        """The replica count to run now: spec.replicas, kept within the autoscaling bounds."""
        if self.autoscaling is not None:
            return min(max(self.replicas, self.autoscaling.min_replicas), self.autoscaling.max_replicas)
        return self.replicas


# ---- field readers ------------------------------------------------------------------------------


def _section(spec: Mapping[str, Any], key: str, path: str = "spec") -> Mapping[str, Any]:
    return validation.section(spec, key, path)


def _int(
    section: Mapping[str, Any], key: str, path: str, default: int, low: float, high: float | None
) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path}.{key}", f"must be an integer, got {value!r}")
    if high is None and value < low:
        raise SpecError(f"{path}.{key}", f"must be at least {low:g}, got {value}")
    if value < low or (high is not None and value > high):
        raise SpecError(f"{path}.{key}", f"must be between {low:g} and {high:g}, got {value}")
    return value


def _float(section: Mapping[str, Any], key: str, path: str, default: float, low: float, high: float) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{path}.{key}", f"must be a number, got {value!r}")
    if not low <= value <= high:
        raise SpecError(f"{path}.{key}", f"must be between {low:g} and {high:g}, got {value}")
    return float(value)


def _bool(section: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{path}.{key}", f"must be true or false, got {value!r}")
    return value


def _str(section: Mapping[str, Any], key: str, path: str, default: str | None = None) -> str | None:
    value = section.get(key, default)
    if value is not None and not isinstance(value, str):
        raise SpecError(f"{path}.{key}", f"must be a string, got {value!r}")
    return value


def _choice(section: Mapping[str, Any], key: str, path: str, default: Any, allowed: tuple[Any, ...]) -> Any:
    value = section.get(key, default)
    if value not in allowed:
        raise SpecError(f"{path}.{key}", f"must be one of {', '.join(map(str, allowed))}, got {value!r}")
    return value


def _from_flag(section: Mapping[str, Any], key: str, path: str, flag: Flag) -> Any:
    """A field that becomes a runtime flag: the flag's default, choices and range apply."""
    if flag.choices is not None:
        return _choice(section, key, path, flag.default, flag.choices)
    low = flag.minimum if flag.minimum is not None else float("-inf")
    high = flag.maximum if flag.maximum is not None else float("inf")
    if flag.type is int:
        return _int(section, key, path, flag.default, low, high if flag.maximum is not None else None)
    return _float(section, key, path, flag.default, low, high)


def _speculative(value: Any, path: str) -> SpeculativeConfig | None:
    """spec.runtime.speculativeDecoding, checked by the runtime's own `--speculative-config` parser."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SpecError(path, "must be an object (method, numSpeculativeTokens, ...)")
    snake = {_snake_case(key): item for key, item in value.items()}
    try:
        return parse_speculative_config(snake)
    except ValueError as exc:
        # The runtime names `speculative_config.<field>`; a user of the CRD wrote `<path>.<fieldName>`.
        match = re.match(r"speculative_config\.(\w+) (.*)", str(exc), re.DOTALL)
        if match is None:
            raise SpecError(path, str(exc).removeprefix("speculative_config ")) from None
        raise SpecError(f"{path}.{_camel_case(match[1])}", match[2]) from None


def _snake_case(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


def _camel_case(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _secret_ref(value: Any, path: str, default_key: str) -> SecretKeyRef | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SpecError(path, "must be an object with the Secret's name (and key)")
    if not value.get("name"):
        raise SpecError(f"{path}.name", "the Secret's name is required")
    name = validation.dns_1123_subdomain(value.get("name"), f"{path}.name")
    key = value.get("key") or default_key
    if not isinstance(key, str) or not key:
        raise SpecError(f"{path}.key", "must be a non-empty string")
    return SecretKeyRef(name=name, key=key)


# ---- sections -----------------------------------------------------------------------------------


def _model(section: Mapping[str, Any]) -> ModelSpec:
    path = "spec.model"
    source = parse_model_source(section.get("source", ""))
    revision = _str(section, "revision", path)
    if revision is not None and source.kind is not SourceKind.HUGGING_FACE:
        raise SpecError(f"{path}.revision", "a revision applies only to hf:// sources")
    cache_size = section.get("cacheSize")
    claim = section.get("cacheVolumeClaim")
    if (cache_size is not None or claim is not None) and source.kind is not SourceKind.HUGGING_FACE:
        raise SpecError(path, "cacheSize and cacheVolumeClaim apply only to hf:// sources (a download cache)")
    if cache_size is not None and claim is not None:
        raise SpecError(
            path, "set cacheSize (a per-pod emptyDir) or cacheVolumeClaim (a shared claim), not both"
        )
    return ModelSpec(
        source=source,
        revision=revision,
        served_name=_str(section, "servedName", path),
        token_secret=_secret_ref(section.get("tokenSecretRef"), f"{path}.tokenSecretRef", "token"),
        cache_size=None
        if cache_size is None
        else validation.quantity(cache_size, f"{path}.cacheSize", positive=True),
        cache_volume_claim=None
        if claim is None
        else validation.dns_1123_subdomain(claim, f"{path}.cacheVolumeClaim"),
    )


# Flags the operator sets itself: letting extraArgs repeat them would make the pod disagree with its
# probes (port) or with the model volume (model, download dir).
RESERVED_FLAGS = ("--model", "--port", "--download-dir")


def _runtime(section: Mapping[str, Any]) -> RuntimeSpec:
    path = "spec.runtime"
    defaults = RuntimeSpec()
    extra = section.get("extraArgs", [])
    if not isinstance(extra, list) or not all(isinstance(arg, str) for arg in extra):
        raise SpecError(f"{path}.extraArgs", "must be a list of strings")
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_FLAGS:
            raise SpecError(f"{path}.extraArgs", f"{flag} is set by the operator and cannot be overridden")
    image = _str(section, "image", path, defaults.image)
    if not image:
        raise SpecError(f"{path}.image", "must not be empty")
    max_len = section.get("maxModelLen")
    batched = section.get("maxNumBatchedTokens")
    return RuntimeSpec(
        image=image,
        image_pull_policy=_choice(
            section, "imagePullPolicy", path, defaults.image_pull_policy, IMAGE_PULL_POLICIES
        ),
        image_pull_secrets=validation.name_list(
            section.get("imagePullSecrets", []), f"{path}.imagePullSecrets"
        ),
        dtype=_from_flag(section, "dtype", path, engine_flag("--dtype")),
        max_model_len=None
        if max_len is None
        else _from_flag(section, "maxModelLen", path, engine_flag("--max-model-len")),
        max_num_seqs=_from_flag(section, "maxNumSeqs", path, engine_flag("--max-num-seqs")),
        max_num_batched_tokens=None
        if batched is None
        else _from_flag(section, "maxNumBatchedTokens", path, engine_flag("--max-num-batched-tokens")),
        block_size=_from_flag(section, "blockSize", path, engine_flag("--block-size")),
        kv_cache_memory_fraction=_from_flag(
            section, "kvCacheMemoryFraction", path, engine_flag("--kv-cache-memory-fraction")
        ),
        kv_cache_dtype=_from_flag(section, "kvCacheDtype", path, engine_flag("--kv-cache-dtype")),
        enable_prefix_caching=_bool(section, "enablePrefixCaching", path, defaults.enable_prefix_caching),
        speculative_decoding=_speculative(section.get("speculativeDecoding"), f"{path}.speculativeDecoding"),
        drain_timeout_seconds=_int(
            section,
            "drainTimeoutSeconds",
            path,
            defaults.drain_timeout_seconds,
            0,
            server_flag("--drain-timeout").maximum,
        ),
        startup_timeout_seconds=_int(
            section, "startupTimeoutSeconds", path, defaults.startup_timeout_seconds, 30, 86400
        ),
        extra_args=tuple(extra),
    )


def _server(section: Mapping[str, Any]) -> ServerSpec:
    return ServerSpec(
        api_key_secret=_secret_ref(section.get("apiKeySecretRef"), "spec.server.apiKeySecretRef", "api-key")
    )


def _resources(section: Mapping[str, Any]) -> ResourcesSpec:
    path = "spec.resources"
    defaults = ResourcesSpec()
    gpus = _int(section, "gpus", path, defaults.gpus, 0, 64)
    if gpus > MAX_GPUS_PER_REPLICA:
        raise SpecError(
            f"{path}.gpus",
            f"{gpus} GPUs per replica cannot be used: the runtime runs one model copy per GPU (no tensor "
            "parallelism yet); use 1 and scale out with replicas",
        )
    gpu_resource = (
        _str(section, "gpuResourceName", path, defaults.gpu_resource_name) or defaults.gpu_resource_name
    )
    if "/" not in gpu_resource:
        raise SpecError(
            f"{path}.gpuResourceName",
            f"{gpu_resource!r} must be a domain-prefixed name such as nvidia.com/gpu",
        )
    validation.qualified_name(gpu_resource, f"{path}.gpuResourceName")
    return ResourcesSpec(
        gpus=gpus,
        gpu_resource_name=gpu_resource,
        cpu=validation.quantity(section.get("cpu", defaults.cpu), f"{path}.cpu", positive=True),
        memory=validation.quantity(section.get("memory", defaults.memory), f"{path}.memory", positive=True),
        shm_size=validation.quantity(
            section.get("shmSize", defaults.shm_size), f"{path}.shmSize", positive=True
        ),
    )


def _rollout(section: Mapping[str, Any]) -> RolloutSpec:
    path = "spec.rollout"
    defaults = RolloutSpec()
    surge = validation.int_or_percent(section.get("maxSurge", defaults.max_surge), f"{path}.maxSurge")
    unavailable = validation.int_or_percent(
        section.get("maxUnavailable", defaults.max_unavailable), f"{path}.maxUnavailable"
    )
    if validation.is_zero(surge) and validation.is_zero(unavailable):
        raise SpecError(
            path, "maxSurge and maxUnavailable cannot both be 0: the rollout could never progress"
        )
    return RolloutSpec(max_surge=surge, max_unavailable=unavailable)


def _service(section: Mapping[str, Any]) -> ServiceSpec:
    path = "spec.service"
    return ServiceSpec(
        type=_choice(section, "type", path, "ClusterIP", SERVICE_TYPES),
        port=_int(section, "port", path, ServiceSpec().port, 1, 65535),
        annotations=validation.annotation_map(section.get("annotations") or {}, f"{path}.annotations"),
    )


def _scheduling(section: Mapping[str, Any]) -> SchedulingSpec:
    path = "spec.scheduling"
    tolerations = validation.object_list(section.get("tolerations") or [], f"{path}.tolerations")
    for index, toleration in enumerate(tolerations):
        affinity.check(toleration, affinity.TOLERATION, f"{path}.tolerations[{index}]")
    spread = validation.object_list(
        section.get("topologySpreadConstraints") or [], f"{path}.topologySpreadConstraints"
    )
    for index, constraint in enumerate(spread):
        affinity.check(
            constraint, affinity.TOPOLOGY_SPREAD_CONSTRAINT, f"{path}.topologySpreadConstraints[{index}]"
        )
    rules = section.get("affinity")
    if rules is not None:
        affinity.check(rules, affinity.AFFINITY, f"{path}.affinity")
    priority = _str(section, "priorityClassName", path)
    runtime_class = _str(section, "runtimeClassName", path)
    return SchedulingSpec(
        node_selector=validation.label_map(section.get("nodeSelector") or {}, f"{path}.nodeSelector"),
        tolerations=tolerations,
        affinity=dict(rules) if rules else None,
        topology_spread_constraints=spread,
        priority_class_name=None
        if not priority
        else validation.dns_1123_subdomain(priority, f"{path}.priorityClassName"),
        runtime_class_name=None
        if not runtime_class
        else validation.dns_1123_subdomain(runtime_class, f"{path}.runtimeClassName"),
    )


def _monitoring(section: Mapping[str, Any]) -> MonitoringSpec:
    path = "spec.monitoring"
    interval = _str(section, "interval", path, MonitoringSpec().interval) or MonitoringSpec().interval
    return MonitoringSpec(enabled=_bool(section, "enabled", path, True), interval=interval)


def parse_spec(spec: Mapping[str, Any]) -> LLMDeploymentSpec:
    """Parse `.spec` of an LLMDeployment, filling the CRD's defaults; raises SpecError when unusable."""
    if not isinstance(spec, Mapping):
        raise SpecError("spec", "must be an object")
    if "model" not in spec:
        raise SpecError("spec.model", "is required")
    autoscaling = spec.get("autoscaling")
    return LLMDeploymentSpec(
        model=_model(_section(spec, "model")),
        runtime=_runtime(_section(spec, "runtime")),
        server=_server(_section(spec, "server")),
        resources=_resources(_section(spec, "resources")),
        replicas=_int(spec, "replicas", "spec", 1, 0, 10_000),
        autoscaling=None if autoscaling is None else parse_policy(_section(spec, "autoscaling")),
        rollout=_rollout(_section(spec, "rollout")),
        service=_service(_section(spec, "service")),
        scheduling=_scheduling(_section(spec, "scheduling")),
        monitoring=_monitoring(_section(spec, "monitoring")),
    )


def parse_name(name: Any) -> str:
    """An LLMDeployment's name names its Service, so it must be a DNS-1035 label."""
    return validation.dns_1035_label(name, "metadata.name")
