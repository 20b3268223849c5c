"""16-bit float weights (a GGUF file's F16 and BF16 matrices) kept in 16 bits.

No integer code with one scale per group holds a float16 exactly (11 significant bits and an
exponent per value), so these are not repacked for the group-affine kernels: the weight stays in
its stored dtype, half the bytes of float32, and each call widens it to the activations' dtype
(exact: float16 and bfloat16 both widen to float32 without rounding). On the CPU a float32 call
widens and multiplies a chunk of rows at a time, so the float32 copy of a chunk stays in cache and
no float32 copy of the whole weight exists; the result is the float32 weight's GEMM up to the
order of the sums. Where the activations already have the weight's dtype (a bfloat16 model on a
GPU with BF16 matrices) the weight is used as it is.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor, nn

from kvasir.runtime.layers.quantization.weights import (
    EmbeddingKernel,
    FloatWeight,
    LinearKernel,
    QuantizedWeight,
)

HALF_DTYPES = (torch.float16, torch.bfloat16)
# Weights widened per chunk on the CPU: 2**18 float32 values (1 MiB) stay in a core's L2.
CHUNK_VALUES = 1 << 18


class HalfWeight(FloatWeight):
    """A float16 or bfloat16 matrix, as stored (a `FloatWeight` that keeps its dtype)."""

    def __init__(self, tensor: Tensor) -> None:
        if tensor.dtype not in HALF_DTYPES or tensor.dim() != 2:
            raise ValueError(
                f"HalfWeight takes a 2-D float16 or bfloat16 tensor, got {tensor.dtype} {tuple(tensor.shape)}"
            )
        super().__init__(tensor)

    @property
    def merge_key(self) -> Hashable:
        return ("half", self.tensor.dtype)

    @classmethod
    def build_linear(
        cls, parts: Sequence[QuantizedWeight], device: torch.device, dtype: torch.dtype
    ) -> LinearKernel:
        tensors = [part.tensor for part in parts if isinstance(part, HalfWeight)]
        if len(tensors) != len(parts):
            raise TypeError("HalfWeight.build_linear takes HalfWeight parts only")
        weight = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        return HalfLinear(weight.to(device))

    def build_embedding(self, device: torch.device, dtype: torch.dtype) -> EmbeddingKernel:
        return HalfEmbedding(self.tensor.to(device), dtype)


class HalfLinear(LinearKernel):
    """`x @ W.T` with W kept in 16 bits and widened per call (per chunk of rows on the CPU)."""

    weight: Tensor

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight, persistent=False)
        self.chunk_rows = max(1, CHUNK_VALUES // max(1, self.in_features))
        self._description = f"{str(weight.dtype).removeprefix('torch.')} kept 16-bit (widened per call)"

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if x.dtype == weight.dtype:
            return nn.functional.linear(x, weight)
        if x.device.type != "cpu" or self.out_features <= self.chunk_rows:
            return nn.functional.linear(x, weight.to(x.dtype))
        flat = x.reshape(-1, self.in_features)
        # Transposed, so each chunk's output rows are contiguous for `out=`.
        out = torch.empty((self.out_features, flat.shape[0]), dtype=x.dtype)
        for start in range(0, self.out_features, self.chunk_rows):
            stop = min(start + self.chunk_rows, self.out_features)
            torch.mm(weight[start:stop].to(x.dtype), flat.t(), out=out[start:stop])
        return out.t().contiguous().view(*x.shape[:-1], self.out_features)

    def describe(self) -> str:
        return self._description


class HalfEmbedding(EmbeddingKernel):
    """Row lookup in a 16-bit table: only the gathered rows are widened."""

    weight: Tensor

    def __init__(self, weight: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.dtype = dtype

    def forward(self, ids: Tensor) -> Tensor:
        return nn.functional.embedding(ids, self.weight).to(self.dtype)

    def describe(self) -> str:
        return f"{str(self.weight.dtype).removeprefix('torch.')} (row lookup)"
