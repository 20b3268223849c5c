"""Plain-torch reference for the paged KV cache: write K/V rows into blocks, attend over them.

The cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
A token's slot is `block_id * block_size + offset`; a request's blocks are listed, in order, in
its row of the block table. These functions define the contract the Triton kernels must match,
so they validate every argument and raise `ValueError` with the name of the one at fault.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvasir.kernels.checks import attention_lengths, check_attention, check_store_kv
from kvasir.kernels.kv_quant import FP8_DTYPE, check_kv_scales, is_fp8, quantize_fp8
from kvasir.kernels.workspace import AttentionWorkspace

# The most K+V bytes one batched gather of decode rows may take (see `paged_attention`).
GATHER_CHUNK_BYTES = 4 << 20


def store_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write `key`/`value` [T, Hkv, D] into the caches at `slot_mapping` [T] int64; slot -1 is skipped.

    An fp8 cache stores `quantize_fp8(key, k_scale)` and `quantize_fp8(value, v_scale)`.
    """
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    keep = slot_mapping >= 0  # -1 marks padding tokens (e.g. CUDA-graph filler) that own no slot
    slots, key, value = slot_mapping[keep], key[keep], value[keep]
    if is_fp8(k_cache.dtype):
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    for cache, rows in ((k_cache, key), (v_cache, value)):
        rows = rows.to(cache.dtype)
        # CPU torch has no index_copy_ for float8: copy the bytes (same element size) instead.
        if is_fp8(cache.dtype):
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    workspace: AttentionWorkspace | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """Causal attention of a flattened variable-length batch `q` [T, Hq, D] over the paged cache.

    Request r owns rows `query_start_loc[r]:query_start_loc[r+1]`; its context holds `seq_lens[r]`
    tokens (this step's included, already stored), so its last query row sits at position
    `seq_lens[r] - 1`. With `sliding_window` w, position p sees keys p-w+1..p. Returns [T, Hq, D].

    `max_query_len`, `max_seq_len` and `workspace` are for the Triton kernel (launch sizes known
    without a device sync, split-K buffers allocated once); the reference reads the lengths itself.
    An fp8 cache is read back as `value * k_scale` (K) and `value * v_scale` (V).
    """
    del max_query_len, max_seq_len, workspace
    check_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, sliding_window)
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    scales = (k_scale, v_scale)
    starts, lens = attention_lengths(q, k_cache.shape[1], block_table, seq_lens, query_start_loc)
    out = torch.empty_like(q)
    decodes = [r for r in range(len(lens)) if starts[r + 1] - starts[r] == 1]
    if decodes:
        # Single-token rows are batched: gather each request's blocks, pad to the longest, mask.
        # In chunks of rows whose gathered K/V stay within GATHER_CHUNK_BYTES: a buffer that size
        # stays in cache and malloc hands it back on the next call, while one of hundreds of MiB
        # is mmapped and page-faulted in afresh by every layer of every step (10x slower).
        token_bytes = 2 * k_cache[0, 0].numel() * k_cache.element_size()
        rows_per_chunk = max(1, GATHER_CHUNK_BYTES // (token_bytes * max(lens[r] for r in decodes)))
        for first in range(0, len(decodes), rows_per_chunk):
            chunk = decodes[first : first + rows_per_chunk]
            idx = torch.tensor(chunk, device=q.device)
            rows = query_start_loc[idx].long()
            context = seq_lens[idx].long()
            k, v = _gather(k_cache, v_cache, block_table[idx], [lens[r] for r in chunk], scales)
            q_pos = (context - 1)[:, None]
            out[rows] = _attend(q[rows][:, None], k, v, q_pos, scale, sliding_window)[:, 0]
    for r in range(len(lens)):
        start, end = starts[r], starts[r + 1]
        if end - start <= 1:
            continue
        # A prompt chunk: its rows are the last (end - start) positions of the context.
        k, v = _gather(k_cache, v_cache, block_table[r : r + 1], [lens[r]], scales)
        q_pos = torch.arange(lens[r] - (end - start), lens[r], device=q.device)[None]
        out[start:end] = _attend(q[start:end][None], k, v, q_pos, scale, sliding_window)[0]
    return out


def _gather(
    k_cache: Tensor, v_cache: Tensor, block_table: Tensor, lens: list[int], scales: tuple[float, float]
) -> tuple[Tensor, Tensor]:
    """The blocks holding the first `lens[i]` tokens of block-table row i: two [R, L, Hkv, D] tensors.

    L is the longest length rounded up to whole blocks. The slots past a row's length are zeros:
    `_attend` masks them, but a masked key still multiplies its value by a zero weight, and a slot
    never written (a CPU cache is allocated without touching its pages) may hold a NaN pattern,
    which would turn the row into NaN. An fp8 cache comes back dequantized to float32.
    """
    if is_fp8(k_cache.dtype):
        k, v = _gather(k_cache.view(torch.uint8), v_cache.view(torch.uint8), block_table, lens, scales)
        return k.view(FP8_DTYPE).float() * scales[0], v.view(FP8_DTYPE).float() * scales[1]
    block_size = k_cache.shape[1]
    num_blocks = -(-max(lens) // block_size)
    blocks = block_table[:, :num_blocks].reshape(-1)
    shape = (block_table.shape[0], num_blocks * block_size, *k_cache.shape[2:])
    # index_select over whole blocks copies contiguous rows; advanced indexing is several times
    # slower on CPU, and slicing to max_len would cost another copy in the attention below.
    k, v = k_cache.index_select(0, blocks).view(shape), v_cache.index_select(0, blocks).view(shape)
    for row, length in enumerate(lens):
        if length < shape[1]:
            k[row, length:] = 0
            v[row, length:] = 0
    return k, v


def _attend(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, window: int | None) -> Tensor:
    """Dense masked attention: q [B, Q, Hq, D] at positions q_pos [B, Q] over k/v [B, K, Hkv, D].

    Key j is visible to the query at position p when j <= p (and j > p - window). Keys past a
    request's context are thereby masked too, since every query sits inside its own context.
    """
    batch, num_q, num_heads, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[2], k.shape[1]
    group = num_heads // num_kv_heads
    key_pos = torch.arange(num_keys, device=q.device)
    visible = key_pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        visible &= key_pos[None, None, :] > q_pos[:, :, None] - window
    # GQA without copying K/V: the query heads sharing a KV head become extra query rows of it
    # ([B, Hkv, G*Q, D]), so one fused SDPA call reads each KV head once. That is several times
    # faster on CPU than spelled-out scores, mask and softmax, and than SDPA's own enable_gqa.
    qg = q.float().reshape(batch, num_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    mask = visible[:, None, None].expand(batch, 1, group, num_q, num_keys)
    out = F.scaled_dot_product_attention(
        qg.reshape(batch, num_kv_heads, group * num_q, head_dim),
        k.float().transpose(1, 2),
        v.float().transpose(1, 2),
        attn_mask=mask.reshape(batch, 1, group * num_q, num_keys),
        scale=scale,
    )
    out = out.reshape(batch, num_kv_heads, group, num_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, num_q, num_heads, head_dim).to(q.dtype)
