"""Triton group-quantized int4 matmul (dequantize in registers, then `tl.dot`); see
`kvasir.kernels.reference.int4_matmul` for the layout and the contract.

Each program owns a [BLOCK_M, BLOCK_N] tile of the output and a slice of K. Per K step it reads
the packed words [BLOCK_K, BLOCK_N / 8] once, spreads each word over its eight columns
(`tl.interleave` three times), shifts and masks out the codes, and dequantizes them with ONE scale
and zero row: BLOCK_K divides `group_size`, so a step never straddles two groups.

Decode (a few rows) reads the whole weight to produce a few outputs, so it is bound by memory
bandwidth and needs every SM streaming: K is split over `split_k` programs whose float32 partial
sums are added afterwards (in a fixed order: the result does not depend on scheduling).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvasir.kernels.checks import check_int4_matmul
from kvasir.kernels.triton_ops.common import check_float_dtype, dot_in_fp32, gpu_tiles

MIN_BLOCK_K = 16  # tl.dot's smallest K
# Up to this many rows, one program per row reduces in registers; more go through tl.dot.
GEMV_MAX_ROWS = 4


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    group_size,
    k_tiles_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_words = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    m_valid = offs_m < M
    n_valid = offs_n < N
    words_valid = offs_words < N // 8
    # Column 8j + i of a tile sits in field i of word j: after the interleaves, column c holds its
    # word, and (c % 8) * 4 is its field's shift.
    shifts = (tl.arange(0, BLOCK_N) % 8) * 4
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    packed_cols = qweight_ptr + offs_words[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_start + k_tiles_per_split * BLOCK_K, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        words = tl.load(
            packed_cols + offs_k.to(tl.int64)[:, None] * (N // 8),
            mask=k_valid[:, None] & words_valid[None, :],
            other=0,
        )
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)  # [BLOCK_K, BLOCK_N]
        codes = ((words >> shifts[None, :]) & 0xF).to(tl.float32)
        group_row = (k0 // group_size).to(tl.int64) * N
        s = tl.load(scales_ptr + group_row + offs_n, mask=n_valid, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + group_row + offs_n, mask=n_valid, other=0.0).to(tl.float32)
        w = ((codes - z[None, :]) * s[None, :]).to(dtype)  # rounded as the reference rounds it
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)

    out_rows = out_ptr + pid_k.to(tl.int64) * M * N + offs_m.to(tl.int64)[:, None] * N
    tl.store(
        out_rows + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :]
    )


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    group_size,
    k_tiles_per_split,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One row of x per program (decode): no tensor cores, the reduction over K in registers.

    Within a K step (one group) `sum_k x[k] (q[k, n] - z[n]) s[n] = s[n] (sum_k x[k] q[k, n] - z[n] sum_k x[k])`:
    one multiply-add per code, the scale and zero applied once per step."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_words = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    n_valid = offs_n < N
    words_valid = offs_words < N // 8
    shifts = (tl.arange(0, BLOCK_N) % 8) * 4
    packed_cols = qweight_ptr + offs_words[None, :]

    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_start = pid_k * k_tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_start + k_tiles_per_split * BLOCK_K, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(x_ptr + row * stride_xm + offs_k, mask=k_valid, other=0.0).to(tl.float32)
        words = tl.load(
            packed_cols + offs_k.to(tl.int64)[:, None] * (N // 8),
            mask=k_valid[:, None] & words_valid[None, :],
            other=0,
        )
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)  # [BLOCK_K, BLOCK_N]
        codes = ((words >> shifts[None, :]) & 0xF).to(tl.float32)
        group_row = (k0 // group_size).to(tl.int64) * N
        s = tl.load(scales_ptr + group_row + offs_n, mask=n_valid, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + group_row + offs_n, mask=n_valid, other=0.0).to(tl.float32)
        acc += s * (tl.sum(a[:, None] * codes, axis=0) - z * tl.sum(a, axis=0))

    out_row = out_ptr + pid_k.to(tl.int64) * M * N + row * N
    tl.store(out_row + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_valid)


def int4_matmul(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """x [M, K] @ the dequantized weight [K, N] -> [M, N] in x's dtype."""
    check_int4_matmul(x, qweight, scales, zeros, group_size)
    check_float_dtype("x", x.dtype)
    if x.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dimension, got strides {x.stride()}")
    m, k = x.shape
    n = qweight.shape[1] * 8
    block_k = block_k_for(group_size)
    if block_k is None:
        raise ValueError(
            f"group_size {group_size} is not a multiple of {MIN_BLOCK_K}: the kernel cannot tile it"
        )
    gemv = m <= GEMV_MAX_ROWS
    block_m, block_n, block_k, num_warps, num_stages = _tiles(x, m, n, block_k, gemv)
    grid_mn = (m if gemv else triton.cdiv(m, block_m)) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    k_tiles_per_split = triton.cdiv(k_tiles, _split_k(x, grid_mn, k_tiles))
    split_k = triton.cdiv(k_tiles, k_tiles_per_split)  # no empty splits
    if split_k == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    if m == 0:
        return out if split_k == 1 else out.sum(0).to(x.dtype)
    args = (x, qweight, scales, zeros, out, m, n, k, x.stride(0), group_size, k_tiles_per_split)
    if gemv:
        _int4_gemv_kernel[(triton.cdiv(n, block_n), split_k, m)](
            *args, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages
        )
    else:
        _int4_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)](
            *args,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            DOT_FP32=dot_in_fp32(x.dtype),
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return out if split_k == 1 else out.sum(0).to(x.dtype)


def block_k_for(group_size: int, largest: int = 128) -> int | None:
    """The largest power of two <= `largest` dividing `group_size` (so a K step stays in one group)."""
    block = largest
    while block >= MIN_BLOCK_K:
        if group_size % block == 0:
            return block
        block //= 2
    return None


def _tiles(x: Tensor, m: int, n: int, block_k: int, gemv: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for this shape."""
    if not gpu_tiles(x):  # the interpreter: small tiles, so tests cover several of each
        return 16, 32, min(block_k, 32), 1, 1
    if gemv:  # stream the weight: [BLOCK_K, BLOCK_N] codes per step, loads pipelined ahead
        return 1, 128, min(block_k, 64), 4, 4
    if m <= 16:
        return 16, 64, block_k, 4, 4
    if m <= 64:
        return 64, 64, min(block_k, 64), 4, 4
    return 128, 128, min(block_k, 64), 8, 3


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_k(x: Tensor, grid_mn: int, k_tiles: int) -> int:
    """Split K until there are about two programs per SM (decode has too few output tiles)."""
    if not gpu_tiles(x):
        return min(2, k_tiles)  # the interpreter: exercise the split path
    sms = sm_count(x.device)
    wanted = max(1, (2 * sms) // max(grid_mn, 1))
    return max(1, min(wanted, k_tiles, 16))
