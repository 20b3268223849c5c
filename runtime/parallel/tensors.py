"""Collectives the model runner needs besides the layers' ones: the driver's sampled tokens sent to
every rank, and one count agreed by all of them.

Both are no-ops at size 1, like every collective of `TensorParallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvasir.runtime.parallel.group import TensorParallel


def broadcast_from_driver(parallel: TensorParallel, tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` written into every rank's `tensor` (same shape and dtype everywhere), over
    the device group: the sampled tokens stay on the device they were made on."""
    if parallel.size > 1:
        dist.broadcast(tensor, group=parallel.group, group_src=0)
    return tensor


def min_over_ranks(parallel: TensorParallel, value: int) -> int:
    """The smallest of every rank's `value` (over the CPU group), the same on all ranks."""
    if parallel.size == 1:
        return value
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=parallel.cpu_group)
    return int(box.item())
