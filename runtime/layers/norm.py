"""RMSNorm as Hugging Face computes it (in float32, cast back), optionally fused with the residual add."""

from __future__ import annotations

from typing import overload

import torch
from torch import Tensor, nn


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
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        # The sum of squares overflows/loses precision in half types: HF upcasts, so do we.
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
