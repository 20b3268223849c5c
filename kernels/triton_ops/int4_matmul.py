"""Triton group-quantized int4 matmul; see `kvasir.kernels.reference.int4_matmul` for the layout
(`qweight` [K / 8, N]: eight consecutive input rows per int32 word, GPTQ's own packing) and the
contract. Three paths, by the number of rows M:

- M <= GEMV_MAX_ROWS (decode): `_int4_gemv_kernel`, one row per program, no tensor cores. A program
  owns BLOCK_N output columns and streams every word of them, each thread reading whole words and
  doing the eight multiply-adds of a word itself: the reduction over K stays in registers until
  one `tl.sum` at the end, and no K split is needed (so no second kernel adds partial sums).
  A code becomes a float with one OR and one subtract (the bits of 2^23 + q, minus 2^23) instead
  of an integer conversion, which runs at a quarter of the FMA rate.
- M < DEQUANT_MIN_ROWS: `_int4_matmul_kernel`, dequantize a [BLOCK_K, BLOCK_N] tile in registers
  and `tl.dot` it, K split over programs when the output has too few tiles (partial sums added
  in a fixed order after).
- larger M (long prompts): the weight is dequantized once into a bf16 scratch matrix and multiplied
  by cuBLAS (the GEMM is compute-bound there; a tensor-core GEMM does it best), as vLLM does.
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
# The GEMV's tile: BLOCK_N columns by GEMV_TILE / BLOCK_N words (16 words per thread of 4 warps).
GEMV_BLOCK_N = 8
GEMV_TILE = 2048
# From this many rows on, dequantize once and let cuBLAS multiply.
DEQUANT_MIN_ROWS = 256
_FLOAT_2_23 = tl.constexpr(8388608.0)  # 2^23: (0x4B000000 | q) is this float plus q, for q < 2^23
_EXPONENT_2_23 = tl.constexpr(0x4B000000)


@triton.jit
def _codes_as_float(words, shift):
    """The 4-bit fields at `shift` of int32 `words`, as float32, without an int-to-float convert."""
    bits = ((words >> shift) & 0xF) | _EXPONENT_2_23
    return bits.to(tl.float32, bitcast=True) - _FLOAT_2_23


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    group_size,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,  # words (of eight input rows) per step
):
    row = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    num_words = K // 8
    x_row = x_ptr + row * stride_xm

    acc = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.float32)
    for w0 in range(0, num_words, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        w_valid = offs_w < num_words
        valid = w_valid[:, None] & n_valid[None, :]
        words = tl.load(qweight_ptr + offs_w.to(tl.int64)[:, None] * N + offs_n[None, :], mask=valid, other=0)
        # All eight rows of a word share a group (group_size is a multiple of 8).
        group_rows = ((offs_w * 8) // group_size).to(tl.int64)[:, None] * N + offs_n[None, :]
        s = tl.load(scales_ptr + group_rows, mask=valid, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + group_rows, mask=valid, other=0.0).to(tl.float32)
        # sum_i x_i (q_i - z) s = s (sum_i x_i q_i - z sum_i x_i): the scale and zero once per word
        part = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_row + offs_w * 8 + i, mask=w_valid, other=0.0).to(tl.float32)
            part += xi[:, None] * _codes_as_float(words, 4 * i)
            x_sum += xi
        acc += (part - x_sum[:, None] * z) * s
    out = tl.sum(acc, axis=0)
    tl.store(out_ptr + row * N + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_valid)


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
    m_valid = offs_m < M
    n_valid = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_start + k_tiles_per_split * BLOCK_K, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        # Each word is read for each of its eight rows: the repeats are L1 hits.
        words = tl.load(
            qweight_ptr + (offs_k // 8).to(tl.int64)[:, None] * N + offs_n[None, :],
            mask=k_valid[:, None] & n_valid[None, :],
            other=0,
        )
        codes = _codes_as_float(words, ((offs_k % 8) * 4)[:, None])
        group_row = (k0 // group_size).to(tl.int64) * N  # BLOCK_K divides group_size
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
def _int4_dequantize_kernel(
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    N,
    K,
    group_size,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """W [K, N] in the scales' dtype, rounded once from float32 (as the reference)."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    words = tl.load(
        qweight_ptr + (offs_k // 8).to(tl.int64)[:, None] * N + offs_n[None, :], mask=valid, other=0
    )
    groups = (offs_k // group_size).to(tl.int64)[:, None] * N + offs_n[None, :]
    s = tl.load(scales_ptr + groups, mask=valid, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + groups, mask=valid, other=0.0).to(tl.float32)
    w = (_codes_as_float(words, ((offs_k % 8) * 4)[:, None]) - z) * s
    tl.store(
        out_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :],
        w.to(out_ptr.dtype.element_ty),
        mask=valid,
    )


def int4_matmul(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """x [M, K] @ the dequantized weight [K, N] -> [M, N] in x's dtype."""
    check_int4_matmul(x, qweight, scales, zeros, group_size)
    check_float_dtype("x", x.dtype)
    if x.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dimension, got strides {x.stride()}")
    if group_size % 8:
        raise ValueError(
            f"group_size {group_size} is not a multiple of 8 (a word's eight rows share a group)"
        )
    m, k = x.shape
    n = qweight.shape[1]
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    if m <= GEMV_MAX_ROWS:
        return gemv(x, qweight, scales, zeros, group_size, *_gemv_tiles(x, n))
    if m >= DEQUANT_MIN_ROWS and gpu_tiles(x):
        return x @ dequantize(qweight, scales, zeros, group_size)
    block_k = block_k_for(group_size)
    if block_k is None:
        raise ValueError(
            f"group_size {group_size} is not a multiple of {MIN_BLOCK_K}: the kernel cannot tile it"
        )
    block_m, block_n, block_k, num_warps, num_stages = _tiles(x, m, block_k)
    grid_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    k_tiles_per_split = triton.cdiv(k_tiles, _split_k(x, grid_mn, k_tiles))
    split_k = triton.cdiv(k_tiles, k_tiles_per_split)  # no empty splits
    if split_k == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _int4_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)](
        x, qweight, scales, zeros, out, m, n, k, x.stride(0), group_size, k_tiles_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=dot_in_fp32(x.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out if split_k == 1 else out.sum(0).to(x.dtype)


def gemv(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    group_size: int,
    block_n: int,
    block_w: int,
    num_warps: int,
    num_stages: int,
) -> Tensor:
    """The GEMV path with explicit tiles (`int4_matmul` picks them; benchmarks sweep them)."""
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _int4_gemv_kernel[(m, triton.cdiv(n, block_n))](
        x, qweight, scales, zeros, out, n, k, x.stride(0), group_size,
        BLOCK_N=block_n, BLOCK_W=block_w, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def dequantize(qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """The weight [K, N] in the scales' dtype (a fresh matrix)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    out = torch.empty((k, n), dtype=scales.dtype, device=qweight.device)
    block_k, block_n = (64, 128) if gpu_tiles(qweight) else (16, 32)
    _int4_dequantize_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, block_n))](
        qweight, scales, zeros, out, n, k, group_size, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4
    )
    return out


def block_k_for(group_size: int, largest: int = 128) -> int | None:
    """The largest power of two <= `largest` dividing `group_size` (so a K step stays in one group)."""
    block = largest
    while block >= MIN_BLOCK_K:
        if group_size % block == 0:
            return block
        block //= 2
    return None


def _gemv_tiles(x: Tensor, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_W, num_warps, num_stages). Decode is bound by how many loads are in flight,
    so many narrow programs: 8 columns (one 32-byte sector of words per row) by 256 words. On an
    H200 this beat every wider tile at every Llama-3-8B shape (docs/benchmarks.md, the tile sweep
    of benchmarks/quantized_linear.py)."""
    if not gpu_tiles(x):
        return 16, 8, 1, 1
    return GEMV_BLOCK_N, GEMV_TILE // GEMV_BLOCK_N, 4, 3


def _tiles(x: Tensor, m: int, block_k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for this shape."""
    if not gpu_tiles(x):  # the interpreter: small tiles, so tests cover several of each
        return 16, 32, min(block_k, 32), 1, 1
    if m <= 16:
        return 16, 64, block_k, 4, 4
    if m <= 64:
        return 64, 64, min(block_k, 64), 4, 4
    return 128, 128, min(block_k, 64), 8, 3


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_k(x: Tensor, grid_mn: int, k_tiles: int) -> int:
    """Split K until there are about two programs per SM (small batches have few output tiles)."""
    if not gpu_tiles(x):
        return min(2, k_tiles)  # the interpreter: exercise the split path
    wanted = max(1, (2 * sm_count(x.device)) // max(grid_mn, 1))
    return max(1, min(wanted, k_tiles, 16))
