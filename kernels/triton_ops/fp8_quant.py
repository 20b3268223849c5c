"""Triton per-token FP8 quantization of activations; see `kvasir.kernels.reference.fp8_linear`.

One program per row: the row is read once into registers when it fits (`MAX_BLOCK`), its absolute
maximum taken, and the scaled, saturated values written as e4m3 with the row's scale. Longer rows
are read twice (maximum, then quantize), from L2 mostly. Divisions are IEEE-rounded (`div_rn`;
Triton's default on a GPU is approximate), so scales and codes are torch's to the bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvasir.kernels.reference.fp8_linear import FP8_DTYPE, FP8_MAX, MIN_SCALE
from kvasir.kernels.triton_ops.common import check_float_dtype

MAX_BLOCK = 16384
# Globals a jitted kernel reads must be constexpr.
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, out_ptr, scale_ptr, width, stride_x, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * width
    if NUM_CHUNKS == 1:
        valid = cols < width
        x = tl.load(x_row + cols, mask=valid, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), _FP8_MAX), _MIN_SCALE)
        q = tl.clamp(tl.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
        tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty), mask=valid)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            c = chunk * BLOCK + cols
            x = tl.load(x_row + c, mask=c < width, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), _FP8_MAX), _MIN_SCALE)
        for chunk in range(NUM_CHUNKS):
            c = chunk * BLOCK + cols
            x = tl.load(x_row + c, mask=c < width, other=0.0).to(tl.float32)
            q = tl.clamp(tl.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
            tl.store(out_row + c, q.to(out_ptr.dtype.element_ty), mask=c < width)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (float8 e4m3 [M, K], float32 scales [M, 1]) with x ~ q * scale."""
    check_float_dtype("x", x.dtype)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with contiguous rows, got {list(x.shape)} strides {x.stride()}")
    m, width = x.shape
    out = torch.empty((m, width), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return out, scale
    block = min(triton.next_power_of_2(width), MAX_BLOCK)
    _quantize_per_token_kernel[(m,)](
        x,
        out,
        scale,
        width,
        x.stride(0),
        BLOCK=block,
        NUM_CHUNKS=triton.cdiv(width, block),
        num_warps=8 if block >= 4096 else 4 if block >= 1024 else 1,
    )
    return out, scale
