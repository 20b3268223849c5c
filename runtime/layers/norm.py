"""RMSNorm as Hugging Face computes it (in float32, cast back), optionally fused with the residual add.

The arithmetic lives in `kvasir.kernels` (a Triton kernel on CUDA, the torch reference elsewhere).
"""

from __future__ import annotations

from typing import overload

import torch
from torch import Tensor, nn

from kvasir.kernels import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dimension; the parameter is `weight`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @overload
    def forward(self, x: Tensor, residual: None = None) -> Tensor: ...

    @overload
    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]: ...

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Normalise `x`; with `residual`, normalise `x + residual` and also return that sum."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
