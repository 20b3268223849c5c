"""Unified paged attention in Triton: one kernel for a flattened batch of prompt chunks and decodes.

Each program owns one request, one tile of `BLOCK_Q` of its query rows and one KV head. The query
heads sharing that KV head are stacked into the tile (`BLOCK_Q * GROUP_PAD` rows), so every K/V
tile read from the cache serves the whole GQA group. Keys are streamed in tiles of `TILE_N`
tokens, each token's block looked up in the block table (so a chunk may start mid-block after a
prefix-cache hit, and any block size works), with an online softmax in the log2 domain.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvasir.kernels.kv_quant import is_fp8
from kvasir.kernels.triton_ops.attention_tile import attend_keys
from kvasir.kernels.triton_ops.common import LOG2E, dot_in_fp32, gpu_tiles


@triton.jit
def _unified_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale_log2,
    k_scale,
    v_scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # context position of the request's first query row

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    q_index = q_block * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (q_index < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token = (q_start + q_index).to(tl.int64)
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = first_pos + q_index

    # The keys any row of this tile can see: up to its last row's position, from the window's start.
    kv_end = first_pos + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    kv_begin = 0
    if WINDOW > 0:
        kv_begin = tl.maximum(first_pos + q_block * BLOCK_Q - WINDOW + 1, 0)

    table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    # Whole tiles before the tile's first query position are visible to every row: no masks.
    unmasked_end = kv_begin
    if WINDOW == 0:
        unmasked_end = (first_pos + q_block * BLOCK_Q) // TILE_N * TILE_N
    acc, _max, l_i = attend_keys(
        q, k_cache_ptr, v_cache_ptr, table_row, kv_head, kv_begin, unmasked_end, kv_end, q_pos, scale_log2,
        k_scale, v_scale, stride_cache_block, stride_cache_slot, stride_cache_head,
        BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, WINDOW, DOT_FP32, KV_FP8,
    )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def unified_attention(
    out: Tensor,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    sliding_window: int | None,
    max_query_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write the attention of every query row of `q` into `out` (arguments already validated)."""
    num_requests = block_table.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    tiles = _tile_config(q, head_dim, max_query_len)
    # Rows of a tile: the GQA group times BLOCK_Q tokens, never under 16 rows (tl.dot's minimum).
    # On a GPU BLOCK_Q depends only on the tile config, so a server compiles two variants, not one
    # per query length (each compile costs seconds); the interpreter shrinks it for short queries.
    min_block_q = -(-16 // group_pad)
    block_q = max(1, tiles.rows // group_pad, min_block_q)
    if not gpu_tiles(q):
        block_q = max(min(block_q, triton.next_power_of_2(max(max_query_len, 1))), min_block_q)
    grid = (num_requests, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _unified_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale * LOG2E,
        k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE_N=tiles.keys,
        WINDOW=sliding_window or 0,
        DOT_FP32=dot_in_fp32(q.dtype),
        KV_FP8=is_fp8(k_cache.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


class TileConfig(NamedTuple):
    rows: int  # query rows (tokens x heads of a GQA group) per program
    keys: int  # keys per loop iteration
    num_warps: int
    num_stages: int


def _tile_config(q: Tensor, head_dim: int, max_query_len: int) -> TileConfig:
    """Tile sizes per case. Checked without a GPU by tests/kernels/test_gpu_compile.py, which
    compiles every case for sm_90a and sm_80 and requires that no register spills."""
    if not gpu_tiles(q):
        return TileConfig(rows=64, keys=16, num_warps=4, num_stages=2)  # the interpreter: small tiles
    if q.dtype == torch.float32:
        # IEEE float32 dots run on the FMA units with both operands in registers: small tiles.
        return TileConfig(rows=16, keys=32, num_warps=4, num_stages=1)
    if max_query_len >= 128 and head_dim <= 128:
        # Long prompts: 128 rows over 8 warps, the shape Triton's flash-attention tutorial uses.
        return TileConfig(rows=128, keys=64, num_warps=8, num_stages=3)
    # Chunks and decodes: 64 rows; 8 warps, as 4 spill registers on Ampere.
    return TileConfig(rows=64, keys=64, num_warps=8, num_stages=2)
