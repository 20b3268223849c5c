"""One model split across ranks: who this process is, and the collectives its layers call.

Tensor parallelism (`--tensor-parallel-size N`) runs one process per rank. Every rank builds the
same model with 1/N of each sharded weight; the layers call `all_reduce` (row-parallel outputs)
and `all_gather` (the vocabulary-parallel LM head) through this record. Rank 0 also runs the
scheduler and hands each step to the other ranks with `broadcast_object` over a CPU group (gloo),
so a GPU collective (NCCL) never carries Python objects.

A `TensorParallel` of size 1 (`SINGLE`) makes every collective the identity: code written for N
ranks runs unchanged on one. This module is a leaf below the layers: it imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among `size`, and the process groups its collectives run on."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the device collectives' group (NCCL on GPUs, gloo on CPUs); None at size 1
    cpu_group: Any = None  # gloo: step plans and other Python objects; None at size 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that schedules, samples and answers."""
        return self.rank == 0

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of `total` items split evenly; ValueError naming `what` when
        `total` does not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by --tensor-parallel-size {self.size}")
        per_rank = total // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`obj` from rank `src` to every rank (pickled, over the CPU group); returns it everywhere."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]


SINGLE = TensorParallel()
