"""What a replica's parallelism adds to its pods: the runtime's parallel flags and /dev/shm sized
for the ranks. Pure; used by the Deployment and the LeaderWorkerSet builders alike."""

from __future__ import annotations

from kvasir.operator.api.parallel import SHM_GIB_PER_GPU
from kvasir.operator.api.quantity import canonical_quantity, parse_quantity
from kvasir.operator.api.spec import LLMDeploymentSpec
from kvasir.runtime.engine_args import engine_flag

TENSOR_PARALLEL_FLAG = "--tensor-parallel-size"
# A multi-node group's flags, as vLLM names them for its multiprocessing (Ray-less) multi-node
# mode. The runtime has none of them yet: they are rendered for LeaderWorkerSet groups only, whose
# pods have never run (docs/tensor-parallel.md, "On Kubernetes"), so they cannot come from the
# runtime's flag table as the single-node flags do.
PIPELINE_PARALLEL_FLAG = "--pipeline-parallel-size"
GROUP_FLAGS = (
    # LeaderWorkerSet puts these variables in every container of a group; the kubelet expands
    # $(VAR) in args from the container's environment, as in vLLM's own LeaderWorkerSet example.
    ("--nnodes", "$(LWS_GROUP_SIZE)"),
    ("--node-rank", "$(LWS_WORKER_INDEX)"),
    ("--master-addr", "$(LWS_LEADER_ADDRESS)"),
)
# A worker computes its ranks and serves no API (vLLM's --headless).
WORKER_FLAG = "--headless"


def tensor_parallel_flag() -> str:
    """The runtime's own flag name, from its flag table (KeyError while the runtime lacks it)."""
    return engine_flag(TENSOR_PARALLEL_FLAG).name


def parallel_args(spec: LLMDeploymentSpec) -> list[str]:
    """The flags that split one replica over its ranks, the same on every pod of a group. Nothing
    at TP=1 on one node: an operator upgrade must not change (and so roll) the pods of every
    single-GPU deployment."""
    args: list[str] = []
    if spec.tensor_parallel_size > 1 or spec.multi_node:
        args += [tensor_parallel_flag(), str(spec.tensor_parallel_size)]
    if spec.multi_node:
        args += [PIPELINE_PARALLEL_FLAG, str(spec.pipeline_parallel_size)]
        for flag, value in GROUP_FLAGS:
            args += [flag, value]
    return args


def shm_size(spec: LLMDeploymentSpec) -> str:
    """The /dev/shm emptyDir's sizeLimit: resources.shmSize, raised to SHM_GIB_PER_GPU GiB per GPU when the
    pod has several (never lowered: a user who sized it bigger knows why)."""
    gpus = spec.resources.gpus
    if gpus <= 1:
        return spec.resources.shm_size
    wanted = f"{SHM_GIB_PER_GPU * gpus}Gi"
    if parse_quantity(spec.resources.shm_size) >= parse_quantity(wanted):
        return spec.resources.shm_size
    return canonical_quantity(wanted)
