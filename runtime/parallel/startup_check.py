"""Whether a model can be split across N ranks on this machine, asked before any rank starts.

Every refusal is one line naming the flag and the number at fault, raised in the serving process
before a rank is spawned or a weight is read: a bad `--tensor-parallel-size` is a start-up error
the operator reads in the pod's log, not a rank that dies halfway through loading.
"""

from __future__ import annotations

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.parallel.group import TensorParallel
from kvasir.runtime.parallel.partition import head_shard


def check_tensor_parallel(
    config: ModelConfig, size: int, device_type: str, cuda_devices: int, nnodes: int = 1
) -> None:
    """ValueError unless `size` ranks can split `config`'s heads and MLP and, on CUDA, each rank of
    this node (`size / nnodes` of them) has a GPU.

    The heads' rule is the layers' own (`partition.head_shard`): with at least N KV heads, each
    rank takes whole KV heads and their query groups (evenly when N divides them, else differing by
    one); with fewer, N is a multiple of them and divides the query heads (each KV head is then
    replicated). The MLP's intermediate size splits evenly (`models/sharding.py`)."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
    if size == 1:
        return
    per_node = size // nnodes
    if device_type == "cuda" and cuda_devices < per_node:
        spread = f" over --nnodes {nnodes}" if nnodes > 1 else ""
        raise ValueError(
            f"--tensor-parallel-size {size}{spread} needs {per_node} CUDA devices on this node (one "
            f"per rank); torch sees {cuda_devices}: lower the size, or give the pod more GPUs"
        )
    for rank in range(size):
        head_shard(
            TensorParallel(rank=rank, size=size), config.num_attention_heads, config.num_key_value_heads
        )
    TensorParallel(size=size).shard(config.intermediate_size, "the MLP's intermediate_size")
