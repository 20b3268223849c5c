"""LoRA on the model's projections: the slot pool's weights as the layers read them, and the step's
adapter rows (`LoRAStep`), which reach the layers on the step's `AttentionMetadata`.

A step with no adapter row carries no `LoRAStep` (`AttentionMetadata.lora is None`) and the layers
run exactly their base code. Otherwise each target projection runs its base GEMM, then adds the
adapters' low-rank terms in place: `lora_shrink` then `lora_expand`, per slice of a merged
projection (q/k/v, gate/up), one batched product per adapter present. Weights are never merged.

Under tensor parallelism the pool holds each rank's share (`LoRASlots`): B's rows of this rank's
outputs for a column-parallel projection, A's columns of this rank's inputs for a row-parallel one.
A row-parallel term `B @ (A_r @ x_r)` is then this rank's part of a sum, so it is added to the
partial product before the layer's all-reduce, which sums both at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvasir.kernels.cpu_ops.decoder_stack_lora import LoRAPool
from kvasir.kernels.lora import lora_expand, lora_shrink
from kvasir.kernels.lora_rows import LoRARows
from kvasir.runtime.layers.linear import Linear
from kvasir.runtime.layers.tensor_parallel import RowParallelLinear


@dataclass(frozen=True)
class LoRAProjection:
    """One projection's slot stacks: `a` [S, n*R, in] and `b` [S, n*R, out], block-diagonal over
    the projection's `slice_sizes` (see `kvasir.kernels.reference.lora` for the layout)."""

    a: Tensor
    b: Tensor
    slice_sizes: tuple[int, ...]


@dataclass(frozen=True)
class LoRALayerWeights:
    """A decoder layer's four projections' stacks (q/k/v merged, o, gate/up merged, down)."""

    qkv: LoRAProjection
    o: LoRAProjection
    gate_up: LoRAProjection
    down: LoRAProjection


@dataclass(frozen=True)
class LoRAStep:
    """This step's adapter rows and the pool they index, built once per step by the model runner."""

    rows: LoRARows
    scalings: Tensor  # [S] float32: each slot's lora_alpha / r (or / sqrt(r))
    layers: tuple[LoRALayerWeights, ...]
    # The same pool as the C decoder stack reads it (float32 on the CPU), or None where it cannot.
    stack_pool: LoRAPool | None = None

    def linear(self, linear: Linear, weights: LoRAProjection, x: Tensor) -> Tensor:
        """`linear(x)` plus every adapter row's `scaling * B @ A @ x`, per slice."""
        if isinstance(linear, RowParallelLinear):
            out = linear.partial(x)
            if out.dtype == x.dtype:
                lora_expand(out, lora_shrink(x, weights.a, self.scalings, self.rows), weights.b, self.rows)
            else:  # a float64 partial (the CPU's packed GEMM): the terms are made in x's dtype
                terms = torch.zeros_like(out, dtype=x.dtype)
                lora_expand(terms, lora_shrink(x, weights.a, self.scalings, self.rows), weights.b, self.rows)
                out += terms
            return linear.reduce(out)
        out = linear.forward(x)  # a fresh tensor: the low-rank terms are added into it
        y = lora_shrink(x, weights.a, self.scalings, self.rows)
        lora_expand(out, y, weights.b, self.rows)
        return out
