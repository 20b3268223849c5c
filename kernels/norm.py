"""RMSNorm, plain and fused with the residual add, dispatched three ways: Triton on CUDA, the C
kernel (`kvasir.kernels.cpu_ops.rms_norm`) for float32 on CPU, the torch reference elsewhere.

See `kvasir.kernels.reference.norm` for the contract all of them follow and
`kvasir.kernels.dispatch` for how Triton is chosen.
"""

from __future__ import annotations

from torch import Tensor

from kvasir.kernels.cpu_ops import rms_norm as cpu
from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.reference import norm as reference


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * (x / sqrt(mean(x^2) + eps))` over the last dimension of `x` [..., D]; `weight` is [D]."""
    if use_triton(x.device):
        from kvasir.kernels.triton_ops.norm import rms_norm as impl
    elif cpu.supports(x, weight):
        return cpu.launch(x, None, weight, eps)[0]
    else:
        impl = reference.rms_norm
    return impl(x, weight, eps)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Normalise `x + residual`; returns (the normalised sum, the sum itself: the new residual)."""
    if use_triton(x.device):
        from kvasir.kernels.triton_ops.norm import fused_add_rms_norm as impl
    elif cpu.supports(x, weight) and residual.shape == x.shape and residual.dtype == x.dtype:
        out, summed = cpu.launch(x, residual, weight, eps)
        assert summed is not None  # a residual was given
        return out, summed
    else:
        impl = reference.fused_add_rms_norm
    return impl(x, residual, weight, eps)
