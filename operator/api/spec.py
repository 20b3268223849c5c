"""The LLMDeployment spec, declared once: each field of these frozen dataclasses is one field of the
CRD, with its kind (type, range, enum), default and description (see declare.py). From this
declaration come `parse_spec` and its errors, the CRD's `spec` schema (crd.py, with the CEL rules
of cel_rules.py laid over it), docs/llmdeployment-reference.md and, for `spec.autoscaling`, the
autoscaler's Policy (declared in autoscaler/policy.py).

A field that becomes a `kvasir serve` flag takes its type, default, choices and range from the
runtime's own flag table (`flag_field`), so the operator can never pass a value the runtime
refuses. `python -m kvasir.operator.crd_sync` writes what this declares into the CRD files."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvasir.operator.api import validation
from kvasir.operator.api.affinity import (
    AFFINITY,
    AFFINITY_CRD,
    TOLERATION,
    TOLERATION_CRD,
    TOPOLOGY_SPREAD_CONSTRAINT,
    TOPOLOGY_SPREAD_CONSTRAINT_CRD,
)
from kvasir.operator.api.cel_rules import ZERO_NEEDS_ROUTER
from kvasir.operator.api.declare import Section, flag_field, spec_field
from kvasir.operator.api.kinds import (
    DNS_1123_SUBDOMAIN,
    Boolean,
    Integer,
    Opaque,
    String,
)
from kvasir.operator.api.kube_kinds import (
    AnnotationMap,
    CommandArgs,
    IntOrPercent,
    KubeObject,
    KubeObjectList,
    LabelMap,
    Names,
    Quantity,
)
from kvasir.operator.api.lora import (
    ADAPTER,
    ALIAS,
    MAX_ADAPTERS,
    MAX_ALIASES,
    LoraAdapter,
    LoraAlias,
    SectionList,
    check_lora,
)
from kvasir.operator.api.objects import ModelSourceString, SecretKeyRef, SecretRef, Speculative
from kvasir.operator.api.parallel import (
    MAX_GPUS_PER_NODE,
    SHM_GIB_PER_GPU,
    ParallelismSpec,
    check_parallelism,
)
from kvasir.operator.api.source import ModelSource, SourceKind, SpecError
from kvasir.operator.autoscaler.policy import Policy, autoscaling_schema, parse_policy
from kvasir.runtime.engine_args import engine_flag
from kvasir.runtime.server.config import server_flag
from kvasir.runtime.spec_decode.config import SpeculativeConfig

__all__ = ["LLMDeploymentSpec", "SecretKeyRef", "SpecError", "parse_name", "parse_spec"]

DEFAULT_IMAGE = "ghcr.io/kvasir-project/kvasir:0.1.0"
# Flags the operator sets itself: letting extraArgs repeat them would make the pod disagree with its
# probes (port), with the model volume (model, download dir) or with its GPUs (tensor parallel size).
RESERVED_FLAGS = ("--model", "--port", "--download-dir", "--tensor-parallel-size")


# An object's name (a claim, a PriorityClass): a DNS-1123 subdomain.
OBJECT_NAME = String(max_length=253, pattern=DNS_1123_SUBDOMAIN, check=validation.dns_1123_subdomain)


# ---- spec.model ---------------------------------------------------------------------------------


def _check_model(model: ModelSpec, path: str) -> None:
    hub = model.source.kind is SourceKind.HUGGING_FACE
    if model.revision is not None and not hub:
        raise SpecError(f"{path}.revision", "a revision applies only to hf:// sources")
    if (model.cache_size is not None or model.cache_volume_claim is not None) and not hub:
        raise SpecError(path, "cacheSize and cacheVolumeClaim apply only to hf:// sources (a download cache)")
    if model.cache_size is not None and model.cache_volume_claim is not None:
        raise SpecError(
            path, "set cacheSize (a per-pod emptyDir) or cacheVolumeClaim (a shared claim), not both"
        )


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource = spec_field(
        ModelSourceString(),
        "Where the weights come from: hf://ORG/NAME (downloaded from the Hugging Face Hub into the "
        "model cache), hf://ORG/NAME/FILE.gguf (one GGUF file of a repository), pvc://CLAIM[/PATH] (a "
        "PersistentVolumeClaim mounted read-only), or an absolute path inside the image.",
    )
    revision: str | None = spec_field(
        String(max_length=255),
        "A branch, tag or commit of the Hugging Face repository (hf:// only); unset means the default branch.",
        default=None,
    )
    served_name: str | None = spec_field(
        String(max_length=255),
        "The model name clients use in requests; unset means the repository id or the last path segment.",
        default=None,
    )
    token_secret: SecretKeyRef | None = spec_field(
        SecretRef("token"),
        "A Secret key holding a Hugging Face token; passed to the runtime as HF_TOKEN.",
        default=None,
        key="tokenSecretRef",
    )
    cache_size: str | None = spec_field(  # canonical quantity; the emptyDir's limit and storage request
        Quantity(),
        "Size of the per-pod model-cache emptyDir (hf:// sources): its size limit and the pod's "
        "ephemeral-storage request, so the scheduler picks a node with room for the download. Unset "
        "means no limit and no request.",
        default=None,
    )
    cache_volume_claim: str | None = spec_field(
        OBJECT_NAME,
        "A PersistentVolumeClaim (ReadWriteMany) used as the download cache of hf:// sources, shared "
        "by every replica: the first one downloads the weights, the others and every restart find "
        "them there.",
        default=None,
    )
    quantization: str | None = flag_field(
        engine_flag("--quantization"),
        "How the weights are stored and run (--quantization, vLLM's names): gguf, fp8, awq or gptq. "
        "Unset means what the checkpoint declares (a .gguf file, a quantization_config), else full "
        "precision; fp8 on a bf16 or fp16 checkpoint quantizes it to FP8 at load. See "
        "docs/quantization.md.",
    )

    @property
    def served_model_name(self) -> str:
        return self.served_name or self.source.default_served_name


# ---- spec.runtime -------------------------------------------------------------------------------

_KV_FRACTION = engine_flag("--kv-cache-memory-fraction")


@dataclass(frozen=True)
class RuntimeSpec:
    image: str = spec_field(String(min_length=1), "The runtime image.", default=DEFAULT_IMAGE)
    image_pull_policy: str = spec_field(
        String(enum=("Always", "IfNotPresent", "Never")),
        "When the kubelet pulls the image.",
        default="IfNotPresent",
    )
    image_pull_secrets: tuple[str, ...] = spec_field(
        Names(max_items=16),
        "Secrets (in this namespace) holding credentials for a private registry.",
        default=(),
    )
    dtype: str = flag_field(
        engine_flag("--dtype"),
        "Weight and activation dtype (--dtype); auto is bfloat16 on a GPU and float32 on a CPU.",
    )
    max_model_len: int | None = flag_field(
        engine_flag("--max-model-len"),
        "Longest prompt plus completion in tokens (--max-model-len); unset means the model's own limit.",
    )
    max_num_seqs: int = flag_field(
        engine_flag("--max-num-seqs"), "Most requests running at once per replica (--max-num-seqs)."
    )
    max_num_batched_tokens: int | None = flag_field(
        engine_flag("--max-num-batched-tokens"),
        "Token budget of one engine step (--max-num-batched-tokens); unset means the runtime's "
        "default for its device (8192 on a GPU, 2048 on a CPU).",
    )
    block_size: int = flag_field(engine_flag("--block-size"), "Tokens per KV-cache block (--block-size).")
    kv_cache_memory_fraction: float = flag_field(
        _KV_FRACTION,
        "Share of the GPU memory left free after loading the weights that the KV cache takes "
        f"(--kv-cache-memory-fraction), from {_KV_FRACTION.minimum:g} to {_KV_FRACTION.maximum:g}.",
    )
    kv_cache_dtype: str = flag_field(
        engine_flag("--kv-cache-dtype"),
        "KV-cache element type (--kv-cache-dtype); auto is the model's dtype, or float16 for a float32 "
        "model on CPU; fp8 stores float8 e4m3 values, twice the tokens of a bf16 cache, and needs an "
        "Ada or Hopper GPU.",
    )
    enable_prefix_caching: bool = flag_field(
        engine_flag("--enable-prefix-caching"),
        "Reuse KV blocks of shared prompt prefixes (--enable-prefix-caching).",
    )
    speculative_decoding: SpeculativeConfig | None = spec_field(
        Speculative(),
        "Speculative decoding (--speculative-config); unset means off. A drafter proposes "
        "numSpeculativeTokens tokens per step and the model verifies them in one forward pass; the "
        "output is the same as without it, only faster when drafts are accepted. See "
        "docs/speculative-decoding.md.",
        default=None,
    )
    max_loras: int = flag_field(
        engine_flag("--max-loras"),
        "Adapter slots per replica (--max-loras, with spec.lora): the most distinct LoRA adapters "
        "one engine step runs; requests for others wait their turn.",
    )
    drain_timeout_seconds: int = flag_field(
        server_flag("--drain-timeout"),
        "Seconds a terminating pod finishes in-flight requests (--drain-timeout); the grace period is longer.",
        integer=True,
    )
    startup_timeout_seconds: int = spec_field(
        Integer(30, 86400),
        "Seconds a pod may take to download and load the model before it is restarted.",
        default=1800,
    )
    extra_args: tuple[str, ...] = spec_field(
        CommandArgs(max_items=64, max_length=1024, reserved=RESERVED_FLAGS),
        "Extra `kvasir serve` arguments, appended verbatim.",
        default=(),
    )


# ---- spec.server, spec.resources ----------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    api_key_secret: SecretKeyRef | None = spec_field(
        SecretRef("api-key"),
        "A Secret key holding the API key clients must send (Authorization: Bearer KEY) on /v1/*; "
        "passed to the runtime as KVASIR_API_KEY, never written in the LLMDeployment. Unset means the "
        "API is open to anyone who can reach it.",
        default=None,
        key="apiKeySecretRef",
    )


def _gpu_resource_name(name: str, path: str) -> str:
    if "/" not in name:
        raise SpecError(path, f"{name!r} must be a domain-prefixed name such as nvidia.com/gpu")
    return validation.qualified_name(name, path)


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = spec_field(
        Integer(0, MAX_GPUS_PER_NODE),
        f"GPUs per pod, 0 to {MAX_GPUS_PER_NODE}; 0 runs on CPU. Above 1 the model is sharded across "
        "them by tensor parallelism (--tensor-parallel-size, unless spec.parallelism says otherwise).",
        default=1,
    )
    gpu_resource_name: str = spec_field(
        String(
            pattern="^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$",
            check=_gpu_resource_name,
        ),
        "The extended resource that counts GPUs (for example amd.com/gpu).",
        default="nvidia.com/gpu",
    )
    cpu: str = spec_field(
        Quantity(),
        'CPU request per replica: an integer or a quantity string (4, "0.5" or 500m).',
        default="4",
    )
    memory: str = spec_field(
        Quantity(),
        "Memory request and limit per replica, a quantity (16Gi, 16G, 1.6e10; not 16GB).",
        default="16Gi",
    )
    shm_size: str = spec_field(
        Quantity(),
        "Size of /dev/shm (a memory-backed emptyDir). With more than one GPU per pod it is at least "
        f"{SHM_GIB_PER_GPU}Gi per GPU (NCCL's and torch's buffers between the ranks); what is used counts "
        "against memory.",
        default="1Gi",
    )


# ---- spec.rollout, spec.service -----------------------------------------------------------------


def _check_rollout(rollout: RolloutSpec, path: str) -> None:
    if validation.is_zero(rollout.max_surge) and validation.is_zero(rollout.max_unavailable):
        raise SpecError(
            path, "maxSurge and maxUnavailable cannot both be 0: the rollout could never progress"
        )


@dataclass(frozen=True)
class RolloutSpec:
    """The Deployment's rolling update: by default a new pod starts before an old one stops."""

    max_surge: int | str = spec_field(
        IntOrPercent(),
        "Pods created above the replica count during a rollout (a count or a percentage).",
        default=1,
    )
    max_unavailable: int | str = spec_field(
        IntOrPercent(),
        "Pods that may be unavailable during a rollout (a count or a percentage).",
        default=0,
    )


@dataclass(frozen=True)
class ServiceSpec:
    type: str = spec_field(
        String(enum=("ClusterIP", "NodePort", "LoadBalancer")), "The Service type.", default="ClusterIP"
    )
    port: int = spec_field(
        Integer(1, 65535), "The Service port (the pods always listen on 8000).", default=8000
    )
    annotations: Mapping[str, str] = spec_field(
        AnnotationMap(),
        "Annotations copied onto the Service (for example for a load balancer).",
        default_factory=dict,
    )


# ---- spec.scheduling ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SchedulingSpec:
    node_selector: Mapping[str, str] = spec_field(
        LabelMap(),
        "Node labels the pods require (label values, at most 63 characters).",
        default_factory=dict,
    )
    tolerations: tuple[Mapping[str, Any], ...] = spec_field(
        KubeObjectList(TOLERATION_CRD, TOLERATION, max_items=64),
        "Taints the pods tolerate (core/v1 Toleration).",
        default=(),
    )
    affinity: Mapping[str, Any] | None = spec_field(
        KubeObject(AFFINITY_CRD, AFFINITY),
        "Node affinity, pod affinity and anti-affinity (core/v1 Affinity), copied verbatim.",
        default=None,
    )
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = spec_field(
        KubeObjectList(TOPOLOGY_SPREAD_CONSTRAINT_CRD, TOPOLOGY_SPREAD_CONSTRAINT, max_items=16),
        "How the pods spread over zones or nodes (core/v1 TopologySpreadConstraint); a constraint "
        "without a labelSelector counts this deployment's pods.",
        default=(),
    )
    priority_class_name: str | None = spec_field(OBJECT_NAME, "The pods' PriorityClass.", default=None)
    runtime_class_name: str | None = spec_field(
        OBJECT_NAME,
        "The pods' RuntimeClass (for example nvidia, where the GPU runtime is not the default).",
        default=None,
    )


@dataclass(frozen=True)
class MonitoringSpec:
    enabled: bool = spec_field(
        Boolean(), "Create a ServiceMonitor when the monitoring.coreos.com CRDs exist.", default=True
    )
    interval: str = spec_field(
        String(pattern="^[0-9]+(ms|s|m|h)$", means="a duration such as 15s, 500ms or 1m"),
        "Scrape interval.",
        default="15s",
    )


# ---- spec.routing -------------------------------------------------------------------------------

ROUTING_MODES = ("none", "kvasir", "gateway")
# The endpoint picker's behaviour when it cannot be reached (InferencePool endpointPickerRef).
PICKER_FAILURE_MODES = ("FailClose", "FailOpen")
# The Inference Extension's stock picker, deployed when endpointPicker.service is absent.
EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.2.0"


def _check_routing(routing: RoutingSpec, path: str) -> None:
    picker = routing.endpoint_picker
    if picker is None:
        return
    if routing.mode != "gateway":
        raise SpecError(f"{path}.endpointPicker", "applies only to mode gateway")
    if picker.service is not None and picker.image is not None:
        raise SpecError(
            f"{path}.endpointPicker.image", "applies only when the operator deploys the picker (no service)"
        )


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = spec_field(
        Integer(1, 100),
        "Router pods; each keeps its own prefix-affinity memory, so one spreads conversations best.",
        default=1,
    )


@dataclass(frozen=True)
class EndpointPickerSpec:
    service: str | None = spec_field(
        String(max_length=63, pattern="^[a-z]([-a-z0-9]*[a-z0-9])?$", check=validation.dns_1035_label),
        "A picker you deployed yourself: its Service in this namespace (for example the one the "
        "inferencepool Helm chart deploys). Absent: the operator deploys the stock picker as "
        "<name>-epp, configured for Kvasir's metric names.",
        default=None,
    )
    image: str | None = spec_field(
        String(min_length=1),
        "The picker image the operator deploys when service is absent (default the Gateway API "
        f"Inference Extension's {EPP_IMAGE}).",
        default=None,
    )
    port: int = spec_field(Integer(1, 65535), "The picker Service's ext-proc gRPC port.", default=9002)
    failure_mode: str = spec_field(
        String(enum=PICKER_FAILURE_MODES),
        "What the gateway does when the picker cannot be reached: FailClose refuses the request, "
        "FailOpen sends it to any pod.",
        default="FailClose",
    )


@dataclass(frozen=True)
class RoutingSpec:
    mode: str = spec_field(
        String(enum=ROUTING_MODES),
        "Who chooses the pod of each request: none (the Service spreads requests at random), kvasir "
        "(the operator deploys `kvasir router`, which routes on prefix affinity, queue and KV usage, "
        "and status.endpoint points at it) or gateway (the operator writes an InferencePool "
        "(inference.networking.k8s.io/v1) for the Gateway API Inference Extension, whose endpoint "
        "picker chooses). See docs/routing.md.",
        default="none",
    )
    router: RouterSpec = spec_field(
        Section(RouterSpec), "Kvasir's router (mode kvasir).", default=RouterSpec()
    )
    endpoint_picker: EndpointPickerSpec | None = spec_field(
        Section(EndpointPickerSpec),
        "The endpoint picker the InferencePool names (mode gateway only; absent, the operator "
        "deploys the stock picker).",
        default=None,
    )


# ---- spec ---------------------------------------------------------------------------------------

DESCRIPTION = "The desired state."


@dataclass(frozen=True)
class LLMDeploymentSpec:
    """What the user asked for. `replicas` is the scale subresource's count (default 1); with
    `autoscaling` set, the autoscaler writes it and the operator keeps it within min and max."""

    model: ModelSpec = spec_field(Section(ModelSpec, check=_check_model), "The model to serve.")
    runtime: RuntimeSpec = spec_field(
        Section(RuntimeSpec),
        "How the Kvasir runtime runs (each field maps to a `kvasir serve` flag).",
        default=RuntimeSpec(),
    )
    server: ServerSpec = spec_field(Section(ServerSpec), "The runtime's HTTP server.", default=ServerSpec())
    resources: ResourcesSpec = spec_field(
        Section(ResourcesSpec), "Compute per replica.", default=ResourcesSpec()
    )
    replicas: int = spec_field(
        Integer(0, 10_000),
        "The replica count: the scale subresource's target, so kubectl scale, an HPA or KEDA can set "
        "it. With autoscaling set, Kvasir's autoscaler writes it (within minReplicas and maxReplicas) "
        "and is its only writer, but for Kvasir's router waking a deployment at zero (0 to 1, with "
        "minReplicas 0): do not point an HPA at an LLMDeployment that has autoscaling.",
        default=1,
    )
    # Declared in autoscaler/policy.py (one field of Policy per knob), schema and reader included.
    autoscaling: Policy | None = spec_field(Opaque(autoscaling_schema, parse_policy), default=None)
    rollout: RolloutSpec = spec_field(
        Section(RolloutSpec, check=_check_rollout),
        "How the Deployment replaces pods when the spec changes. The default starts a new pod before "
        "stopping an old one (no capacity lost); on a cluster with no spare GPU set maxSurge 0 and "
        "maxUnavailable 1, or the rollout waits for a GPU forever.",
        default=RolloutSpec(),
    )
    service: ServiceSpec = spec_field(Section(ServiceSpec), "The endpoint Service.", default=ServiceSpec())
    scheduling: SchedulingSpec = spec_field(
        Section(SchedulingSpec), "Where the pods may run.", default=SchedulingSpec()
    )
    parallelism: ParallelismSpec | None = spec_field(
        Section(ParallelismSpec),
        "How one replica is split across GPUs and nodes: tensor and pipeline parallel sizes and nodes "
        "per replica. Unset: one pod per replica, tensor-parallel over its resources.gpus.",
        default=None,
    )
    monitoring: MonitoringSpec = spec_field(
        Section(MonitoringSpec), "Prometheus Operator integration.", default=MonitoringSpec()
    )
    routing: RoutingSpec = spec_field(
        Section(RoutingSpec, check=_check_routing),
        "How requests reach the pods: at random through the Service, through Kvasir's router, or "
        "through a gateway's endpoint picker.",
        default=RoutingSpec(),
    )

    lora: tuple[LoraAdapter, ...] = spec_field(
        SectionList(ADAPTER, MAX_ADAPTERS),
        "LoRA adapters served on the base model, batched on one copy of its weights. The operator "
        "loads and unloads them on the running pods (no restart), and a new pod is ready only once "
        "every one is loaded. See docs/lora.md.",
        default=(),
    )
    lora_aliases: tuple[LoraAlias, ...] = spec_field(
        SectionList(ALIAS, MAX_ALIASES),
        "Names that split requests among adapters by weight (a rollout: 90% v2, 10% v1). Honoured "
        "by Kvasir's router (spec.routing.mode kvasir).",
        default=(),
    )

    @property
    def desired_replicas(self) -> int:
        """The replica count to run now: spec.replicas, kept within the autoscaling bounds."""
        if self.autoscaling is not None:
            return min(max(self.replicas, self.autoscaling.min_replicas), self.autoscaling.max_replicas)
        return self.replicas

    @property
    def tensor_parallel_size(self) -> int:
        """--tensor-parallel-size: spec.parallelism.tensor, else every GPU of the pod (1 on CPU)."""
        if self.parallelism is not None:
            return self.parallelism.tensor
        return max(self.resources.gpus, 1)

    @property
    def pipeline_parallel_size(self) -> int:
        return 1 if self.parallelism is None else self.parallelism.pipeline

    @property
    def nodes_per_replica(self) -> int:
        """Pods of one replica: above 1, the replica is a LeaderWorkerSet group."""
        return 1 if self.parallelism is None else self.parallelism.nodes

    @property
    def multi_node(self) -> bool:
        return self.nodes_per_replica > 1


def _check_spec(spec: LLMDeploymentSpec, path: str) -> None:
    check_lora(spec.lora, spec.lora_aliases, spec.model.served_model_name)
    if spec.autoscaling is not None and spec.autoscaling.min_replicas == 0 and spec.routing.mode != "kvasir":
        raise SpecError(
            f"{path}.autoscaling.minReplicas", ZERO_NEEDS_ROUTER.removeprefix("autoscaling.minReplicas ")
        )
    check_parallelism(spec.parallelism, spec.resources.gpus, path)


SPEC = Section(LLMDeploymentSpec, check=_check_spec)


def parse_spec(spec: Mapping[str, Any]) -> LLMDeploymentSpec:
    """Parse `.spec` of an LLMDeployment, filling the CRD's defaults; raises SpecError when unusable."""
    if not isinstance(spec, Mapping):
        raise SpecError("spec", "must be an object")
    parsed: LLMDeploymentSpec = SPEC.parse(spec, "spec")
    return parsed


def parse_name(name: Any) -> str:
    """An LLMDeployment's name names its Service, so it must be a DNS-1035 label."""
    return validation.dns_1035_label(name, "metadata.name")
