"""Triton FP8 GEMM with row-wise scales for small batches: `out = (a * a_scale) @ (b * b_scale).T`.

`a` [M, K] and `b` [N, K] are float8 e4m3 (the activations quantized per token, the weight per
output row), `a_scale` [M, 1] and `b_scale` [1, N] float32, accumulation in float32, the scales
applied once in the epilogue, output bf16. This is the same function as `torch._scaled_mm` in
row-wise mode (`kvasir.kernels.reference.fp8_linear` states it); it exists because decode batches
(M up to 64) are bound by reading the weight, and a tile shape chosen for that (narrow N tiles,
many programs, deep pipelining) reads it faster than the general-purpose kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvasir.kernels.reference.fp8_linear import FP8_DTYPE
from kvasir.kernels.triton_ops.common import gpu_tiles
from kvasir.kernels.triton_ops.int4_matmul import sm_count

# Up to this many rows the Triton kernel runs; larger batches are compute-bound: `torch._scaled_mm`.
MAX_ROWS = 64


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    a_scale_ptr,
    b_scale_ptr,
    out_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * K
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * K  # b^T [K, N]: column n is weight row n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_cols + offs_k[:, None], mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        if DOT_FP32:  # Triton's interpreter has no float8 dot: the same products in float32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=m_valid, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=n_valid, other=0.0)
    out = acc * a_scale[:, None] * b_scale[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


def fp8_gemm(
    a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, tiles: tuple[int, ...] | None = None
) -> Tensor:
    """(a * a_scale) @ (b * b_scale).T -> bf16 [M, N]; `tiles` (BLOCK_M, BLOCK_N, BLOCK_K,
    num_warps, num_stages) overrides the choice (benchmarks sweep it)."""
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise ValueError(f"a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a must be [M, K] and b [N, K], got {list(a.shape)} and {list(b.shape)}")
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("a and b must be contiguous")
    m, k = a.shape
    n = b.shape[0]
    if tuple(a_scale.shape) != (m, 1) or tuple(b_scale.shape) != (1, n):
        raise ValueError(
            f"a_scale must be [{m}, 1] and b_scale [1, {n}], got {list(a_scale.shape)}, {list(b_scale.shape)}"
        )
    out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    if m == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = tiles or _tiles(a, m, n)
    _fp8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a, b, a_scale, b_scale, out, m, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=not a.is_cuda,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _tiles(a: Tensor, m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): all rows in one tile, and N tiles narrow
    enough for about two programs per SM (the weight streams through once)."""
    if not gpu_tiles(a):
        return 16, 16, 32, 1, 1
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    wanted_programs = 2 * sm_count(a.device) // triton.cdiv(m, block_m)
    widest = 128 if block_m <= 32 else 64  # the accumulator stays in registers
    block_n = next((b for b in (128, 64) if b <= widest and n // b >= wanted_programs), 32)
    return block_m, block_n, 128, 4 if block_m <= 32 else 8, 5
