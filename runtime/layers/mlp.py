"""The gated SiLU feed-forward block of the Llama family: `down(silu(gate(x)) * up(x))`."""

from __future__ import annotations

from torch import Tensor, nn

from kvasir.kernels import silu_and_mul


class GatedMLP(nn.Module):
    """Parameters `gate_proj`, `up_proj`, `down_proj`, named as in Hugging Face checkpoints."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        # Separate gate/up projections (HF's layout): the activation reads both, with no concatenation.
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))
