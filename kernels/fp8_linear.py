"""FP8 linear layers: `fp8_linear` quantizes the activations and runs an FP8 GEMM.

On CUDA the activations are quantized per token by a Triton kernel (or with the checkpoint's static
input scale) and multiplied with one float32 scale per activation row and one per weight row,
applied in the GEMM's epilogue, accumulation in float32, output in bfloat16 (other dtypes are
converted after): up to `fp8_gemm.MAX_ROWS` rows (decode) by Kvasir's Triton FP8 GEMM, tiled to
stream the weight; larger batches by `torch._scaled_mm` in row-wise mode. Elsewhere the torch
reference computes the same function in float32.

`torch._scaled_mm` needs K and N divisible by 16 and an FP8-capable GPU (compute capability 8.9+:
Ada, Hopper, Blackwell); `fp8_gemm_supported` says whether a device has one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.reference import fp8_linear as reference

FP8_MIN_CAPABILITY = (8, 9)


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether `device` runs FP8 GEMMs (a CUDA GPU of compute capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def fp8_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None, bias: Tensor | None
) -> Tensor:
    """x [M, K] @ (weight [N, K] * weight_scale [N]).T (+ bias) -> [M, N] in x's dtype."""
    if not use_triton(x.device):
        return reference.fp8_linear(x, weight, weight_scale, input_scale, bias)
    return scaled_mm_linear(x, weight, weight_scale, input_scale, bias)


def scaled_mm_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None, bias: Tensor | None
) -> Tensor:
    """`fp8_linear` through the per-token Triton quantizer and `torch._scaled_mm` (row-wise scales).

    `weight_scale` must be float32 [1, N] here (the layer keeps it in that shape at load, so no
    per-call reshape launches a copy)."""
    from kvasir.kernels.triton_ops.fp8_gemm import MAX_ROWS, fp8_gemm
    from kvasir.kernels.triton_ops.fp8_quant import quantize_per_token

    if input_scale is None:
        xq, x_scale = quantize_per_token(x)
    else:
        # Row-wise mode wants one contiguous scale per row, even when all rows share one.
        x_scale = input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
        xq = reference.quantize_static(x, x_scale)
    if x.shape[0] <= MAX_ROWS and x.is_cuda:
        out = fp8_gemm(xq, weight, x_scale, weight_scale.reshape(1, -1))
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out if x.dtype == torch.bfloat16 else out.to(x.dtype)
    out = torch._scaled_mm(
        xq,
        weight.t(),
        scale_a=x_scale,
        scale_b=weight_scale.reshape(1, -1),
        bias=None if bias is None else bias.to(torch.bfloat16),
        out_dtype=torch.bfloat16,
    )
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)
