"""The paged-KV ops the attention layer calls, dispatched to Triton or the torch reference.

See `kvasir.kernels.reference.attention` for the contract both implementations follow and
`kvasir.kernels.dispatch` for how one is chosen.
"""

from __future__ import annotations

from torch import Tensor

from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.reference import attention as reference
from kvasir.kernels.workspace import AttentionWorkspace


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

    An fp8 cache stores the values divided by `k_scale` / `v_scale` (see `kvasir.kernels.kv_quant`).
    """
    if use_triton(key.device):
        from kvasir.kernels.triton_ops.store_kv import store_kv as impl
    else:
        impl = reference.store_kv
    impl(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


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
    """Causal attention of the flattened batch `q` [T, Hq, D] over the paged cache; returns [T, Hq, D]."""
    if use_triton(q.device):
        from kvasir.kernels.triton_ops.attention import paged_attention as impl
    else:
        impl = reference.paged_attention
    return impl(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        workspace=workspace,
        k_scale=k_scale,
        v_scale=v_scale,
    )
