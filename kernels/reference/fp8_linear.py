"""Plain-torch FP8 linear layer: the contract `torch._scaled_mm` runs on a GPU.

Activations are quantized per token (row) at run time, `scale[m] = max(amax(|x[m]|), eps) / 448`,
or with a static per-tensor `input_scale` from the checkpoint; the weight is float8 e4m3 [N, K]
with one float32 scale per output row. The product of the two dequantized operands is accumulated
in float32 and rounded once to the output dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# The smallest activation scale: an all-zero row must not divide by zero (vLLM uses the same floor).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (float8 e4m3 [M, K], float32 scales [M, 1]) with x ~ q * scale."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize_static(x, scale), scale


def quantize_static(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale (one scale, or one per row [M, 1]) saturated to e4m3's range and rounded to it."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None, bias: Tensor | None
) -> Tensor:
    """x [M, K] @ (weight [N, K] * weight_scale [N]).T (+ bias) -> [M, N] in x's dtype."""
    if input_scale is None:
        xq, x_scale = quantize_per_token(x)
    else:
        x_scale = input_scale.float().reshape(1, 1)
        xq = quantize_static(x, x_scale)
    out = (xq.float() * x_scale) @ (weight.float() * weight_scale.float()[:, None]).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
