"""The Triton `paged_attention`: validates, then runs split-K decode or the unified kernel."""

from __future__ import annotations

import torch
from torch import Tensor

from kvasir.kernels.checks import check_attention
from kvasir.kernels.kv_quant import check_kv_scales
from kvasir.kernels.triton_ops.common import check_float_dtype
from kvasir.kernels.triton_ops.decode_attention import choose_num_splits, decode_attention
from kvasir.kernels.triton_ops.unified_attention import unified_attention
from kvasir.kernels.workspace import AttentionWorkspace


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
    """Causal attention of the flattened batch `q` [T, Hq, D] over the paged cache; returns [T, Hq, D].

    Same contract as `kvasir.kernels.reference.attention.paged_attention`. The lengths are not read
    back to check them (that would sync the device every layer): pass `max_query_len` and
    `max_seq_len` (upper bounds are fine) to skip the one sync that finds them.
    """
    check_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, sliding_window)
    check_float_dtype("q", q.dtype)
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    out = torch.empty_like(q)
    num_requests = block_table.shape[0]
    if num_requests == 0 or q.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if max_query_len <= 1:
        num_kv_heads = k_cache.shape[2]
        splits = choose_num_splits(num_requests, num_kv_heads, max_seq_len, q.device)
        decode_attention(
            out,
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            query_start_loc,
            scale,
            sliding_window,
            splits,
            workspace,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    else:
        unified_attention(
            out,
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            query_start_loc,
            scale,
            sliding_window,
            max_query_len,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return out
