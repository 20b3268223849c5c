"""How one replica of a model spans GPUs and nodes: `resources.gpus` per pod, and `spec.parallelism`
for the split (tensor x pipeline) and the group size (nodes per replica).

Without `spec.parallelism` a replica is one pod whose `resources.gpus` GPUs all shard the model by
tensor parallelism (`--tensor-parallel-size gpus`, vLLM's meaning). With it, the GPUs of a group
(`resources.gpus` on each of `nodes` pods) are split into `tensor` x `pipeline` ranks; more than one
node makes the replica a LeaderWorkerSet group (children/leaderworkerset.py). `pipeline` stays 1:
the runtime has no pipeline parallelism, so a group is tensor-parallel across its nodes."""

from __future__ import annotations

from dataclasses import dataclass

from kvasir.operator.api.declare import flag_field, spec_field
from kvasir.operator.api.kinds import Integer
from kvasir.operator.api.source import SpecError
from kvasir.runtime.engine_args import engine_flag

# The most GPUs one node offers today (8 x H100/H200/MI300X in a node); a replica needing more
# spans nodes with spec.parallelism.nodes.
MAX_GPUS_PER_NODE = 8
MAX_NODES_PER_REPLICA = 64
# /dev/shm per GPU of a pod with more than one: NCCL's shared-memory transport (where GPUs have no
# peer-to-peer path) and torch's inter-process tensors live there; Docker's 64 MiB default is
# NCCL's most common failure. vLLM's multi-node example gives 15Gi to 8 GPUs; 2Gi each is that.
SHM_GIB_PER_GPU = 2


@dataclass(frozen=True)
class ParallelismSpec:
    tensor: int = flag_field(
        engine_flag("--tensor-parallel-size"),
        "Tensor-parallel ranks of one replica (--tensor-parallel-size): each layer's weights are "
        "split across them. tensor x pipeline must equal resources.gpus x nodes.",
    )
    pipeline: int = spec_field(
        Integer(1, MAX_NODES_PER_REPLICA),
        "Pipeline-parallel stages of one replica (--pipeline-parallel-size). Only 1 is accepted: "
        "the runtime has no pipeline parallelism; a replica spread over nodes is tensor-parallel "
        "across them (tensor = resources.gpus x nodes).",
        default=1,
    )
    nodes: int = spec_field(
        Integer(1, MAX_NODES_PER_REPLICA),
        "Pods (one per node) that run one replica together, tensor/nodes ranks each. Above 1, a replica "
        "is a LeaderWorkerSet group (leaderworkerset.x-k8s.io/v1): the leader serves, the workers "
        "compute (kvasir serve --headless). Needs the "
        "LeaderWorkerSet CRD and controller installed. See docs/tensor-parallel.md.",
        default=1,
    )


def check_parallelism(parallelism: ParallelismSpec | None, gpus: int, path: str) -> None:
    """The split must use exactly the GPUs the group asks for (the CEL overlay says the same)."""
    if parallelism is None:
        return
    group_gpus = gpus * parallelism.nodes
    if parallelism.tensor * parallelism.pipeline != group_gpus:
        raise SpecError(
            f"{path}.parallelism",
            f"tensor x pipeline ({parallelism.tensor} x {parallelism.pipeline}) must equal resources.gpus "
            f"x nodes ({gpus} x {parallelism.nodes} = {group_gpus}), the GPUs of one replica",
        )
    if parallelism.pipeline > 1:
        raise SpecError(
            f"{path}.parallelism.pipeline",
            "above 1 is not supported: the runtime has no pipeline parallelism; split a model across "
            "nodes with tensor (resources.gpus x nodes)",
        )
