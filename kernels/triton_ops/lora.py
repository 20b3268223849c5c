"""Triton LoRA shrink and expand over segments of one adapter each (Punica's / S-LoRA's SGMV).

A program takes a tile of one group's rows (`LoRARows`: the rows with an adapter, grouped by
slot), so it reads its adapter's A or B tile once for up to BLOCK_T rows, with a real `tl.dot`
(not a per-token matrix-vector product). The grid is sized from host-side counts (the number of
groups and the longest group), so a launch never reads a tensor back. Same contract as
`kvasir.kernels.reference.lora`; the launch wrappers check shapes and dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvasir.kernels.checks import check_lora_expand, check_lora_shrink
from kvasir.kernels.lora_rows import LoRARows
from kvasir.kernels.triton_ops.common import dot_in_fp32

BLOCK_T = 16  # rows per program (tl.dot's smallest M)
BLOCK_R = 16  # rank columns per program (shrink) / per step of the expand's reduction
BLOCK_K = 32  # input features per step of the shrink's reduction
BLOCK_N = 32  # output columns per program (expand)


@triton.jit
def _tile_bounds(seg_starts_ptr, BLOCK_T: tl.constexpr):
    """This program's first row in its group's segment, and the segment's end."""
    group = tl.program_id(0)
    end = tl.load(seg_starts_ptr + group + 1)
    return tl.load(seg_starts_ptr + group) + tl.program_id(1) * BLOCK_T, end


@triton.jit
def _tile_rows(rows_ptr, seg_slots_ptr, first, end, BLOCK_T: tl.constexpr):
    """The tile's slot, its positions in the grouped order, their mask and the batch rows."""
    slot = tl.load(seg_slots_ptr + tl.program_id(0)).to(tl.int64)
    offs_t = first + tl.arange(0, BLOCK_T)
    t_mask = offs_t < end
    return slot, offs_t, t_mask, tl.load(rows_ptr + offs_t, mask=t_mask, other=0)


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    scale_ptr,
    y_ptr,
    rows_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    in_features,
    width,
    stride_x,
    stride_a_slot,
    stride_a_row,
    stride_y,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    first, end = _tile_bounds(seg_starts_ptr, BLOCK_T)
    if first >= end:
        return
    slot, offs_t, t_mask, rows = _tile_rows(rows_ptr, seg_slots_ptr, first, end, BLOCK_T)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < width
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_features
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask=t_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + slot * stride_a_slot + offs_r[None, :] * stride_a_row + offs_k[:, None],
            mask=r_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    acc *= tl.load(scale_ptr + slot).to(tl.float32)
    tl.store(
        y_ptr + offs_t[:, None] * stride_y + offs_r[None, :], acc, mask=t_mask[:, None] & r_mask[None, :]
    )


@triton.jit
def _expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    rows_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    width,
    out_features,
    stride_y,
    stride_b_slot,
    stride_b_row,
    stride_out,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    first, end = _tile_bounds(seg_starts_ptr, BLOCK_T)
    if first >= end:
        return
    slot, offs_t, t_mask, rows = _tile_rows(rows_ptr, seg_slots_ptr, first, end, BLOCK_T)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    # b is block-diagonal over the slices: one reduction over all n*R rows adds each slice into
    # its own columns (the zero blocks cost flops, not launches).
    for r0 in range(0, width, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < width
        y = tl.load(
            y_ptr + offs_t[:, None] * stride_y + offs_r[None, :],
            mask=t_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + slot * stride_b_slot + offs_r[:, None] * stride_b_row + offs_n[None, :],
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if FP32_DOT:
            acc += tl.dot(y, b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(y.to(b.dtype), b)
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    mask = t_mask[:, None] & n_mask[None, :]
    # Each row belongs to one group, so no two programs add into the same element.
    dtype = out_ptr.dtype.element_ty
    current = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    # Rounded as the reference rounds: the product to out's dtype, then the sum.
    tl.store(out_ptrs, (current + acc.to(dtype).to(tl.float32)).to(dtype), mask=mask)


def lora_shrink(x: Tensor, a: Tensor, scalings: Tensor, rows: LoRARows) -> Tensor:
    """x [T, in] -> y [A, n*R] float32 (see `kvasir.kernels.reference.lora`)."""
    check_lora_shrink(x, a, scalings, rows)
    if rows.dense_mask is not None:
        raise ValueError("rows laid out dense are for the CPU path; build them without dense_slots")
    y = torch.empty(rows.num_rows, a.shape[1], dtype=torch.float32, device=x.device)
    if rows.num_rows == 0:
        return y
    grid = (len(rows.groups), triton.cdiv(rows.max_group_rows, BLOCK_T), triton.cdiv(a.shape[1], BLOCK_R))
    _shrink_kernel[grid](
        x,
        a,
        scalings,
        y,
        rows.sorted_rows,
        rows.seg_starts,
        rows.seg_slots,
        a.shape[2],
        a.shape[1],
        x.stride(0),
        a.stride(0),
        a.stride(1),
        y.stride(0),
        BLOCK_T=BLOCK_T,
        BLOCK_R=BLOCK_R,
        BLOCK_K=BLOCK_K,
        FP32_DOT=dot_in_fp32(x.dtype) or a.dtype != x.dtype,  # a pool of another dtype: float32 dots
    )
    return y


def lora_expand(out: Tensor, y: Tensor, b: Tensor, rows: LoRARows) -> None:
    """out[row] += y[i] @ b[slot], in place (see `kvasir.kernels.reference.lora`)."""
    check_lora_expand(out, y, b, rows)
    if rows.dense_mask is not None:
        raise ValueError("rows laid out dense are for the CPU path; build them without dense_slots")
    if rows.num_rows == 0:
        return
    grid = (len(rows.groups), triton.cdiv(rows.max_group_rows, BLOCK_T), triton.cdiv(out.shape[1], BLOCK_N))
    _expand_kernel[grid](
        y,
        b,
        out,
        rows.sorted_rows,
        rows.seg_starts,
        rows.seg_slots,
        b.shape[1],
        out.shape[1],
        y.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        BLOCK_T=BLOCK_T,
        BLOCK_R=BLOCK_R,
        BLOCK_N=BLOCK_N,
        FP32_DOT=dot_in_fp32(out.dtype) or b.dtype != out.dtype,
    )
