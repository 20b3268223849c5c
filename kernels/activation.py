"""The gated activation of the Llama MLP, `silu(gate) * up`, dispatched to Triton or the torch reference.

See `kvasir.kernels.reference.activation` for the contract both implementations follow and
`kvasir.kernels.dispatch` for how one is chosen.
"""

from __future__ import annotations

from torch import Tensor

from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.reference import activation as reference


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up` for two tensors of one shape ([T, I] in the model); returns a new tensor."""
    if use_triton(gate.device):
        from kvasir.kernels.triton_ops.activation import silu_and_mul as impl
    else:
        impl = reference.silu_and_mul
    return impl(gate, up)
