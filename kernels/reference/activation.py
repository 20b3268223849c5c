"""Plain-torch gated activation of the Llama MLP; the contract the Triton kernel matches."""

from __future__ import annotations

from torch import Tensor
from torch.nn import functional as F


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up` for two tensors of one shape ([T, I] in the model); returns a new tensor.

    Both steps round to the inputs' dtype (silu itself is computed in float32), as in transformers.
    The model passes the two halves of its merged gate/up projection as strided views: nothing is
    concatenated or copied.
    """
    return F.silu(gate).mul_(up)  # in place into silu's fresh output: one allocation, not two
