"""Scratch buffers of split-K decode attention, allocated once so a captured CUDA graph can reuse them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

# The most key ranges split-K decode attention cuts one request's context into.
MAX_DECODE_SPLITS = 16


@dataclass(frozen=True)
class AttentionWorkspace:
    """Partial outputs and log-sum-exps of up to `max_splits` key ranges per (request, query head).

    One workspace serves every layer of a step (layers run one after another). A decode batch
    larger than `max_requests`, or wanting more splits, allocates its own buffers instead.
    """

    max_requests: int
    num_q_heads: int
    head_dim: int
    max_splits: int
    device: torch.device
    partial_out: Tensor = field(init=False)  # [max_requests, Hq, max_splits, D] float32
    partial_lse: Tensor = field(init=False)  # [max_requests, Hq, max_splits] float32 (log2 domain)

    def __post_init__(self) -> None:
        for name in ("max_requests", "num_q_heads", "head_dim", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"AttentionWorkspace.{name} must be at least 1, got {getattr(self, name)}")
        shape = (self.max_requests, self.num_q_heads, self.max_splits)
        object.__setattr__(
            self, "partial_out", torch.empty(*shape, self.head_dim, dtype=torch.float32, device=self.device)
        )
        object.__setattr__(self, "partial_lse", torch.empty(shape, dtype=torch.float32, device=self.device))

    def fits(self, num_requests: int, num_q_heads: int, head_dim: int, num_splits: int) -> bool:
        return (
            num_requests <= self.max_requests
            and num_q_heads == self.num_q_heads
            and head_dim == self.head_dim
            and num_splits <= self.max_splits
        )
