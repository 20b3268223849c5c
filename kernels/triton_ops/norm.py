"""Triton RMSNorm, optionally fused with the residual add; see `kvasir.kernels.reference.norm`.

One program normalises a tile of `ROWS` rows. A row up to `MAX_BLOCK` long is read once and kept
in registers; a longer one is read in chunks twice (sum of squares, then normalise), a case no
model of the Llama family hits (Llama 3.1 405B's hidden size is 16384 = MAX_BLOCK).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvasir.kernels.checks import check_same_device
from kvasir.kernels.triton_ops.common import check_float_dtype

# The longest row a program keeps in registers (a power of two).
MAX_BLOCK = 16384
# Elements per program when rows are short (Qwen3's per-head q/k norm: D = 128): several rows
# share one program so it still moves a few kilobytes.
TILE_ELEMENTS = 4096


@triton.jit
def _row_offsets(rows, inner, stride_outer, stride_inner):
    # Rows of x [A, B, D] are numbered a * B + b; `inner` is B (1 for a 2-D x).
    rows_64 = rows.to(tl.int64)
    return (rows_64 // inner) * stride_outer + (rows_64 % inner) * stride_inner


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    num_rows,
    dim,
    dim_f,
    inner,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_valid = rows < num_rows
    x_rows = _row_offsets(rows, inner, stride_x_outer, stride_x_inner)[:, None]
    r_rows = _row_offsets(rows, inner, stride_r_outer, stride_r_inner)[:, None]
    out_rows = rows.to(tl.int64)[:, None] * dim  # the outputs are contiguous
    cols = tl.arange(0, BLOCK)[None, :]

    if NUM_CHUNKS == 1:
        valid = row_valid[:, None] & (cols < dim)
        sf = _load_input(
            x_ptr + x_rows + cols,
            residual_ptr + r_rows + cols,
            residual_out_ptr + out_rows + cols,
            valid,
            HAS_RESIDUAL,
            True,
        )
        rstd = _rstd(tl.sum(sf * sf, axis=1), dim_f, eps)
        _store_normed(out_ptr + out_rows + cols, weight_ptr + cols, valid, cols < dim, sf, rstd)
    else:
        # Pass 1: sum of squares (and the new residual); pass 2 re-reads the inputs, from L2 mostly.
        sum_sq = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            c = chunk * BLOCK + cols
            valid = row_valid[:, None] & (c < dim)
            sf = _load_input(
                x_ptr + x_rows + c,
                residual_ptr + r_rows + c,
                residual_out_ptr + out_rows + c,
                valid,
                HAS_RESIDUAL,
                True,
            )
            sum_sq += sf * sf
        rstd = _rstd(tl.sum(sum_sq, axis=1), dim_f, eps)
        for chunk in range(NUM_CHUNKS):
            c = chunk * BLOCK + cols
            valid = row_valid[:, None] & (c < dim)
            sf = _load_input(
                x_ptr + x_rows + c,
                residual_ptr + r_rows + c,
                residual_out_ptr + out_rows + c,
                valid,
                HAS_RESIDUAL,
                False,
            )
            _store_normed(out_ptr + out_rows + c, weight_ptr + c, valid, c < dim, sf, rstd)


@triton.jit
def _load_input(
    x_ptrs, residual_ptrs, residual_out_ptrs, valid, HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr
):
    """The values to normalise, in float32: x, or x + residual (also stored, with STORE_SUM)."""
    s = tl.load(x_ptrs, mask=valid, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptrs, mask=valid, other=0.0)
        # Rounded to the dtype, as `x + residual` is in torch, before it is normalised.
        s = (s.to(tl.float32) + r.to(tl.float32)).to(x_ptrs.dtype.element_ty)
        if STORE_SUM:
            tl.store(residual_out_ptrs, s, mask=valid)
    return s.to(tl.float32)


@triton.jit
def _store_normed(out_ptrs, weight_ptrs, valid, col_valid, sf, rstd):
    """Round `sf * rstd` to the dtype, THEN multiply by the weight and round again (as HF does)."""
    dtype = out_ptrs.dtype.element_ty
    w = tl.load(weight_ptrs, mask=col_valid, other=0.0).to(tl.float32)
    normed = (sf * rstd[:, None]).to(dtype).to(tl.float32)
    tl.store(out_ptrs, (normed * w).to(dtype), mask=valid)


@triton.jit
def _rstd(sum_sq, dim_f, eps):
    # IEEE-rounded sqrt and division (Triton's defaults are approximate on GPUs) keep the result
    # within an ulp of torch's `rsqrt(mean + eps)`; one per row, so they cost nothing here.
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_sq, dim_f) + eps))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * (x / sqrt(mean(x^2) + eps))` over the last dimension of `x` [..., D]; `weight` is [D]."""
    _check(x, None, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Normalise `x + residual`; returns (the normalised sum, the sum itself: the new residual)."""
    _check(x, residual, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, summed)
    return out, summed


def _launch(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, out: Tensor, summed: Tensor | None
) -> None:
    """Run the kernel on checked arguments, into the contiguous `out` (and `summed` with a residual)."""
    if x.numel() == 0:
        return
    dim = x.shape[-1]
    inner, stride_x = _row_layout("x", x)
    stride_r = stride_x if residual is None else _row_layout("residual", residual)[1]
    num_rows = x.numel() // dim
    block = min(triton.next_power_of_2(dim), MAX_BLOCK)
    # Not shrunk to small batches: one compiled variant per (D, dtype), masked rows cost nothing.
    rows = max(1, TILE_ELEMENTS // block)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x,
        x if residual is None else residual,  # unread without HAS_RESIDUAL
        weight,
        out,
        out if summed is None else summed,
        num_rows,
        dim,
        float(dim),
        inner,
        stride_x[0],
        stride_x[1],
        stride_r[0],
        stride_r[1],
        eps,
        HAS_RESIDUAL=residual is not None,
        ROWS=rows,
        BLOCK=block,
        NUM_CHUNKS=triton.cdiv(dim, block),
        num_warps=_num_warps(rows * block),
    )


def _row_layout(name: str, t: Tensor) -> tuple[int, tuple[int, int]]:
    """`t` [..., D] seen as [A, B, D] rows: (B, (stride of A, stride of B)), without copying."""
    if t.dim() == 1:
        return 1, (0, 0)
    if t.dim() == 2:
        return 1, (t.stride(0), 0)
    try:
        # A no-op for 3-D tensors, whatever their strides; merges the outer dims of higher ones.
        t3 = t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name} {list(t.shape)} with strides {t.stride()}: its leading dimensions cannot be "
            "merged without a copy; pass a contiguous tensor"
        ) from None
    return t3.shape[1], (t3.stride(0), t3.stride(1))


def _check(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> None:
    check_float_dtype("x", x.dtype)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the one normalised)")
    if x.stride(-1) != 1 and x.numel() > 0:
        raise ValueError(f"x must have a contiguous last dimension, got strides {x.stride()}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [{x.shape[-1]}] (x's last dimension), got {list(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.stride(0) != 1 and weight.numel() > 1:
        raise ValueError(f"weight must be contiguous, got stride {weight.stride(0)}")
    if not eps >= 0:  # also rejects NaN
        raise ValueError(f"eps must be a non-negative number, got {eps}")
    if residual is None:
        check_same_device(x=x, weight=weight)
        return
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual ({residual.dtype}, {list(residual.shape)}) must match x ({x.dtype}, {list(x.shape)})"
        )
    if residual.stride(-1) != 1 and residual.numel() > 0:
        raise ValueError(f"residual must have a contiguous last dimension, got strides {residual.stride()}")
    check_same_device(x=x, residual=residual, weight=weight)


def _num_warps(tile_elements: int) -> int:
    # About 16 elements (two 16-byte vectors of a half type) per thread.
    return max(1, min(16, tile_elements // 512))
