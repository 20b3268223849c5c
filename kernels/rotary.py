"""Rotary position embedding (GPT-NeoX layout), dispatched to Triton or the torch reference.

See `kvasir.kernels.reference.rotary` for the contract both implementations follow and
`kvasir.kernels.dispatch` for how one is chosen.
"""

from __future__ import annotations

from torch import Tensor

from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.reference import rotary as reference


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` [T, H, D] by the angles `cos`/`sin` [T, 1, D/2] or [T, D/2]; returns a new tensor."""
    if use_triton(x.device):
        from kvasir.kernels.triton_ops.rotary import apply_rotary as impl
    else:
        impl = reference.apply_rotary
    return impl(x, cos, sin)
