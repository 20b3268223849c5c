"""Triton GEMM over group-affine quantized weights; see `kvasir.kernels.reference.group_affine`.

One program computes a [BLOCK_M, BLOCK_N] tile of `y = x @ W.T`: it walks K in steps of BLOCK_K,
loads the codes of its W rows (4-bit codes two per byte, in the reference's nibble order),
dequantizes them in registers with their group's scale and offset, and accumulates a float32
`tl.dot`. The weight never exists in full precision in memory: decode (small M) reads the packed
bytes once, which is the point of keeping it packed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvasir.kernels.checks import check_same_device
from kvasir.kernels.reference.group_affine import GroupAffineWeight
from kvasir.kernels.triton_ops.common import check_float_dtype, gpu_tiles


@triton.jit
def _group_affine_gemm_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    offset_ptr,
    y_ptr,
    M,
    N,
    K,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    row_bytes = K * BITS // 8
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        within = ks % GROUP
        if BITS == 4:
            byte = (ks // GROUP) * (GROUP // 2) + within % (GROUP // 2)
            shift = (within // (GROUP // 2)) * 4
        else:
            byte = ks
            shift = within * 0
        w_mask = col_ok[:, None] & k_ok[None, :]
        packed = tl.load(
            codes_ptr + cols[:, None].to(tl.int64) * row_bytes + byte[None, :], mask=w_mask, other=0
        )
        codes = ((packed.to(tl.int32) >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        group_index = cols[:, None].to(tl.int64) * groups + (ks // GROUP)[None, :]
        scale = tl.load(scale_ptr + group_index, mask=w_mask, other=0.0)
        offset = tl.load(offset_ptr + group_index, mask=w_mask, other=0.0)
        w = codes * scale + offset  # [BLOCK_N, BLOCK_K] float32
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    out = y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def group_affine_linear(x: Tensor, weight: GroupAffineWeight) -> Tensor:
    """`x [.., K] @ W.T -> [.., N]` in x's dtype (float32 accumulation)."""
    check_float_dtype("x", x.dtype)
    check_same_device(x=x, codes=weight.codes, scale=weight.scale, offset=weight.offset)
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
    if weight.codes.dtype != torch.uint8 or weight.scale.dtype != torch.float32:
        raise ValueError("codes must be uint8 and scale/offset float32")
    flat = x.reshape(-1, k).contiguous()
    m = flat.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    on_gpu = gpu_tiles(x)
    block_m = 16 if m <= 16 or not on_gpu else 64
    block_n = 64 if on_gpu else 32
    block_k = 64 if on_gpu else 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _group_affine_gemm_kernel[grid](
        flat,
        weight.codes,
        weight.scale,
        weight.offset,
        y,
        m,
        n,
        k,
        BITS=weight.bits,
        GROUP=weight.group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y.view(*x.shape[:-1], n)
