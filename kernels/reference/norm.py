"""Plain-torch RMSNorm as Hugging Face computes it; the contract the Triton kernels match.

Rounding points (the kernels round at the same ones): an optional residual add in the input's
dtype, the normalisation in float32, the normalised value cast back to the input's dtype, and only
THEN the product with `weight` (so a half-precision model rounds twice, exactly as transformers'
`LlamaRMSNorm` does).
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * (x / sqrt(mean(x^2) + eps))` over the last dimension of `x` [..., D]; `weight` is [D]."""
    dtype = x.dtype
    # The sum of squares overflows or loses precision in half types: HF upcasts, so do we.
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Normalise `x + residual`; returns (the normalised sum, the sum itself: the new residual)."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
