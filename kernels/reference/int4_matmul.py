"""Plain-torch group-quantized int4 matmul: the contract the Triton kernel matches.

The weight [N, K] arrives in the kernels' layout (see `kvasir.kernels.int4_matmul`):

- `qweight` int32 [K / 8, N]: eight 4-bit codes of consecutive input rows per word, field i
  (bits 4i..4i+3) holding row 8j + i (GPTQ's packing: a GEMV thread reads whole words and does the
  eight multiply-adds of one output itself);
- `scales` [G, N] and `zeros` [G, N] in the activations' dtype, one row per group of `group_size`
  consecutive inputs (G = ceil(K / group_size));

    out[m, n] = sum_k x[m, k] * (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]

The dequantized weight is formed in float32 and rounded to the activations' dtype (the kernel feeds
the same rounded values to its dot), then multiplied with float32 accumulation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvasir.kernels.checks import check_int4_matmul
from kvasir.kernels.int4_packing import unpack_int32


def dequantize_int4(qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """The weight [K, N] in the dtype of `scales` (rounded once, from float32)."""
    codes = unpack_int32(qweight, dim=0).float()  # [K, N]
    groups = torch.arange(codes.shape[0], device=codes.device) // group_size
    w = (codes - zeros.float()[groups]) * scales.float()[groups]
    return w.to(scales.dtype)


def int4_matmul(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """x [M, K] @ the dequantized weight [K, N] -> [M, N] in x's dtype."""
    check_int4_matmul(x, qweight, scales, zeros, group_size)
    w = dequantize_int4(qweight, scales, zeros, group_size)
    return (x.float() @ w.float()).to(x.dtype)
