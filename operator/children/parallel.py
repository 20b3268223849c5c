"""What a replica's parallelism adds to its pods: the runtime's parallel flags (a group's leader and
workers each their own) and /dev/shm sized for the ranks. Pure; used by the Deployment and the
LeaderWorkerSet builders alike."""

from __future__ import annotations

from kvasir.operator.api.parallel import SHM_GIB_PER_GPU
from kvasir.operator.api.quantity import canonical_quantity, parse_quantity
from kvasir.operator.api.spec import LLMDeploymentSpec
from kvasir.runtime.engine_args import engine_flag
from kvasir.runtime.server.config import server_flag

# Every flag's name comes from the runtime's own tables (KeyError if the runtime lost one): vLLM's
# names for its multi-node mode without Ray.
TENSOR_PARALLEL_FLAG = engine_flag("--tensor-parallel-size").name
NNODES_FLAG = engine_flag("--nnodes").name
NODE_RANK_FLAG = engine_flag("--node-rank").name
MASTER_ADDR_FLAG = engine_flag("--master-addr").name
DISTRIBUTED_TIMEOUT_FLAG = engine_flag("--distributed-timeout-seconds").name
# A worker node runs only its ranks and answers /health and /ready (vLLM's --headless).
WORKER_FLAG = server_flag("--headless").name
# LeaderWorkerSet puts these variables in every container of a group (kubernetes-sigs/lws:
# LWS_LEADER_ADDRESS, the leader pod's DNS name in the group's headless Service; LWS_WORKER_INDEX,
# the pod's index in its group, 0 on the leader), and the kubelet expands $(VAR) in args from the
# container's environment, as vLLM's own LeaderWorkerSet example relies on.
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
WORKER_INDEX = "$(LWS_WORKER_INDEX)"


def tensor_parallel_flag() -> str:
    """The runtime's own flag name, from its flag table."""
    return TENSOR_PARALLEL_FLAG


def parallel_args(spec: LLMDeploymentSpec) -> list[str]:
    """The flags that split one replica over its ranks; on a group's leader (node 0) also where the
    group meets. Nothing at TP=1 on one node: an operator upgrade must not change (and so roll) the
    pods of every single-GPU deployment."""
    args: list[str] = []
    if spec.tensor_parallel_size > 1 or spec.multi_node:
        args += [TENSOR_PARALLEL_FLAG, str(spec.tensor_parallel_size)]
    if spec.multi_node:
        # The leader hosts the rendezvous on --master-port (the runtime's default) on every
        # interface; the workers reach it at the leader pod's DNS name.
        args += [
            NNODES_FLAG,
            str(spec.nodes_per_replica),
            NODE_RANK_FLAG,
            "0",
            MASTER_ADDR_FLAG,
            LEADER_ADDRESS,
        ]
    return args


def worker_args(spec: LLMDeploymentSpec, leader_args: list[str]) -> list[str]:
    """A worker pod's args: the leader's, run --headless at the pod's own node rank. A worker waits
    for the leader's rendezvous at most --distributed-timeout-seconds, and the leader opens it only
    once it has downloaded and opened the model: the workers get the leader's start-up bound
    (runtime.startupTimeoutSeconds, within the flag's range) for that, or a download longer than
    the default 120 s would restart the whole group in a loop. Placed before extraArgs, so a value
    given there wins."""
    args = list(leader_args)
    at = args.index(NODE_RANK_FLAG) + 1
    args[at] = WORKER_INDEX
    flag = engine_flag(DISTRIBUTED_TIMEOUT_FLAG)
    wait = min(float(spec.runtime.startup_timeout_seconds), float(flag.maximum or flag.default))
    args[at + 3 : at + 3] = [DISTRIBUTED_TIMEOUT_FLAG, f"{wait:g}"]
    return [args[0], WORKER_FLAG, *args[1:]]


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
