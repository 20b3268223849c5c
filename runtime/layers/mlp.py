"""The gated SiLU feed-forward block of the Llama family: `down(silu(gate(x)) * up(x))`.

Under tensor parallelism each rank holds intermediate_size/N of gate and up (column-parallel: the
activation is elementwise, so it needs nothing from the other ranks) and the matching columns of
down (row-parallel: one all-reduce)."""

from __future__ import annotations

from torch import Tensor, nn

from kvasir.kernels import silu_and_mul
from kvasir.runtime.layers.linear import MergedLinear
from kvasir.runtime.layers.lora import LoRALayerWeights, LoRAStep
from kvasir.runtime.layers.tensor_parallel import RowParallelLinear
from kvasir.runtime.parallel.group import SINGLE, TensorParallel


class GatedMLP(nn.Module):
    """Checkpoint parameters `gate_proj`, `up_proj` (stacked as one GEMM) and `down_proj`."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        quantized: bool = False,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        start, stop = parallel.shard(intermediate_size, "the MLP's intermediate_size")
        width = stop - start
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": width, "up_proj": width}, bias=bias, quantized=quantized
        )
        # Row-parallel at every size: size 1 sums its partial as N ranks do (layers/tensor_parallel.py).
        self.down_proj = RowParallelLinear(width, hidden_size, parallel, bias=bias, quantized=quantized)

    def forward(self, x: Tensor) -> Tensor:
        # The activation reads gate and up as strided views of the one GEMM's output: no copy.
        gate, up = self.gate_up_proj.forward_parts(x)
        return self.down_proj.forward(silu_and_mul(gate, up))  # `forward`: see LlamaDecoderLayer

    def forward_lora(self, x: Tensor, lora: LoRAStep, weights: LoRALayerWeights) -> Tensor:
        """`forward` with the step's adapters added to gate, up and down (steps with adapter rows)."""
        gate, up = lora.linear(self.gate_up_proj, weights.gate_up, x).split_with_sizes(
            self.gate_up_proj.output_sizes, dim=-1
        )
        return lora.linear(self.down_proj, weights.down, silu_and_mul(gate, up))
