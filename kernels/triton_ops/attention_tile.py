"""The key loop both attention kernels share: stream a request's cached keys through an online softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load(pointers, mask, USE_MASK: tl.constexpr):
    """`tl.load`, masked (zeros where `mask` is false) only when USE_MASK."""
    if USE_MASK:
        return tl.load(pointers, mask=mask, other=0.0)
    return tl.load(pointers)


@triton.jit
def attend_tile(
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    table_row,
    kv_head,
    tile_start,
    kv_end,
    q_pos,
    scale_log2,
    k_scale,
    v_scale,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Attend the query tile `q` [M, D] to keys `tile_start .. tile_start + TILE_N` of one request.

    Each key's physical block comes from the request's block-table row, so the keys may start
    anywhere in a block. With MASKED, keys at or past `kv_end` and keys a row may not see (causal
    position `q_pos`, sliding window) are excluded; tiles that lie wholly before every row's
    position and inside the window skip all masking (the bulk of a long prompt's tiles).
    Returns the updated (acc, m_i, l_i); scores are in the log2 domain.
    """
    keys = tile_start + tl.arange(0, TILE_N)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    # Masks only where they can be false (past `kv_end` in a MASKED tile, padded head dims):
    # interior tiles load unmasked.
    USE_MASK: tl.constexpr = MASKED or HEAD_DIM_PAD != HEAD_DIM
    key_valid = keys < kv_end
    block = _load(table_row + keys // BLOCK_SIZE, key_valid, MASKED).to(tl.int64)
    offset = (
        block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head
    )
    k = _load(
        k_cache_ptr + offset[None, :] + dims[:, None], key_valid[None, :] & dim_valid[:, None], USE_MASK
    )
    if KV_FP8:  # dequantize: e4m3 value times the layer's scale, in the query's precision
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
    if DOT_FP32:
        scores = tl.dot(q, k.to(tl.float32), input_precision="ieee") * scale_log2
    else:
        scores = tl.dot(q, k) * scale_log2
    if MASKED:
        visible = key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (keys[None, :] > q_pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead (no NaN).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load(
        v_cache_ptr + offset[:, None] + dims[None, :], key_valid[:, None] & dim_valid[None, :], USE_MASK
    )
    if KV_FP8:
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def attend_keys(
    q,
    k_cache_ptr,
    v_cache_ptr,
    table_row,
    kv_head,
    kv_begin,
    unmasked_end,
    kv_end,
    q_pos,
    scale_log2,
    k_scale,
    v_scale,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Attend `q` [ROWS, D] to keys `kv_begin .. kv_end`; tiles before `unmasked_end` skip masking.

    Returns the unnormalised output, the running max and the softmax denominator (log2 domain).
    """
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(kv_begin, unmasked_end, TILE_N):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head, tile_start, kv_end, q_pos,
            scale_log2, k_scale, v_scale, stride_cache_block, stride_cache_slot, stride_cache_head,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, WINDOW, False, DOT_FP32, KV_FP8,
        )  # fmt: skip
    for tile_start in range(unmasked_end, kv_end, TILE_N):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head, tile_start, kv_end, q_pos,
            scale_log2, k_scale, v_scale, stride_cache_block, stride_cache_slot, stride_cache_head,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, WINDOW, True, DOT_FP32, KV_FP8,
        )  # fmt: skip
    return acc, m_i, l_i
