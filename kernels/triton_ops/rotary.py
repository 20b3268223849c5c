"""Triton rotary position embedding (GPT-NeoX layout); see `kvasir.kernels.reference.rotary`.

One program rotates a token's block of heads: the token's cos/sin row is loaded once and shared by
every head of the block, so the angles cost one read per token, not one per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvasir.kernels.checks import check_same_device
from kvasir.kernels.triton_ops.common import check_float_dtype

# Elements per program (heads x D/2 pairs); 32 heads of 128 take two programs per token.
TILE_PAIRS = 1024


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    num_heads,
    stride_x_token,
    stride_x_head,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    cols = tl.arange(0, BLOCK_HALF)
    col_valid = cols < HALF
    valid = (heads < num_heads)[:, None] & col_valid[None, :]

    # The reference casts the float32 angles to x's dtype before using them.
    c = tl.load(cos_ptr + token * stride_cos + cols, mask=col_valid, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_sin + cols, mask=col_valid, other=0.0).to(dtype).to(tl.float32)
    c, s = c[None, :], s[None, :]
    x_row = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head + cols[None, :]
    x1 = tl.load(x_row, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=valid, other=0.0).to(tl.float32)
    # Every product and sum rounded to the dtype, as the reference's separate torch ops are.
    o1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    o2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    out_row = out_ptr + (token * num_heads + heads[:, None]) * (2 * HALF) + cols[None, :]
    tl.store(out_row, o1.to(dtype), mask=valid)
    tl.store(out_row + HALF, o2.to(dtype), mask=valid)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` [T, H, D] by the angles `cos`/`sin` [T, 1, D/2] or [T, D/2]; returns a new tensor."""
    _check(x, cos, sin)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_tokens, num_heads, head_dim = x.shape
    if out.numel() == 0:
        return out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_heads = max(1, min(triton.next_power_of_2(num_heads), TILE_PAIRS // block_half))
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_heads))](
        x,
        cos,
        sin,
        out,
        num_heads,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        HALF=half,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=block_half,
        num_warps=4 if block_heads * block_half >= 1024 else 2,
        # Keep `x1 * c - x2 * s` two roundings, as in the reference, rather than one fused
        # multiply-add: float32 results then match the reference bit for bit on a GPU too.
        enable_fp_fusion=False,
    )
    return out


def _check(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    check_float_dtype("x", x.dtype)
    if x.dim() != 3 or x.shape[2] % 2 != 0:
        raise ValueError(
            f"x must be [num_tokens, num_heads, head_dim] with an even head_dim, got {list(x.shape)}"
        )
    num_tokens, _, head_dim = x.shape
    if x.stride(2) != 1 and x.numel() > 0:
        raise ValueError(f"x must have a contiguous last dimension, got strides {x.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_float_dtype(name, t.dtype)
        if tuple(t.shape) not in ((num_tokens, 1, head_dim // 2), (num_tokens, head_dim // 2)):
            raise ValueError(
                f"{name} must be [{num_tokens}, 1, {head_dim // 2}] or [{num_tokens}, {head_dim // 2}] "
                f"for x {list(x.shape)}, got {list(t.shape)}"
            )
        if t.stride(-1) != 1 and t.numel() > 0:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    check_same_device(x=x, cos=cos, sin=sin)
