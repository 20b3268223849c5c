"""The paged-KV ops the attention layer calls, dispatched three ways.

On CUDA (or `KVASIR_KERNELS=triton`) the Triton kernels; on CPU the C kernels of
`kvasir.kernels.cpu_ops.paged_attention` for float32 queries over a float32, float16 or bfloat16
cache (they read the blocks in place; the reference gathers a dense copy per layer); otherwise
(an fp8 cache, half-precision queries, no C compiler) the torch reference. See
`kvasir.kernels.reference.attention` for the contract and `kvasir.kernels.dispatch` for the choice.
"""

from __future__ import annotations

from torch import Tensor

from kvasir.kernels.cpu_ops import paged_attention as cpu
from kvasir.kernels.cpu_ops.paged_attention_step import PagedAttentionStep
from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.reference import attention as reference
from kvasir.kernels.rotary import apply_rotary
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


def rotary_store_kv(
    q: Tensor,
    key: Tensor,
    value: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """`apply_rotary` to q and key, then `store_kv` of the rotated key and value; returns the
    rotated q. On CPU one C call does it all per layer (a few dozen torch ops otherwise)."""
    if not use_triton(q.device) and k_scale == v_scale == 1.0 and cpu.supports(q, k_cache):
        return cpu.rotary_store_kv(q, key, value, cos, sin, k_cache, v_cache, slot_mapping)
    q, key = apply_rotary(q, cos, sin), apply_rotary(key, cos, sin)
    store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q


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
    elif (
        k_scale == v_scale == 1.0
        and _cpu_kernel_fits(max_query_len, max_seq_len)
        and cpu.supports(q, k_cache)
    ):
        return cpu.paged_attention(
            q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, sliding_window
        )
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


def cpu_attention_step(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    slot_mapping: Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
) -> PagedAttentionStep | None:
    """The C kernels bound to one step's metadata, for every layer to call (see
    `PagedAttentionStep`), where `rotary_store_kv` and `paged_attention` would run them for this
    step; None where they would not (Triton, the reference, a chunk too long for the C kernel)."""
    if (
        use_triton(q.device)
        or not _cpu_kernel_fits(max_query_len, max_seq_len)
        or not cpu.supports(q, k_cache)
    ):
        return None
    return PagedAttentionStep(q, k_cache, block_table, seq_lens, query_start_loc, slot_mapping)


# Query rows x keys of the longest prompt chunk above which the torch reference runs instead of the
# C kernel on CPU: SDPA's blocked kernel beats the C kernel's per-row loops on long chunks over long
# contexts (one layer of SmolLM2's shape, a 512-row chunk over 2,048 keys: 34 ms against 68; at 512
# over 512 they tie), while on decode rows the C kernel wins (it needs no gathered copy).
CPU_KERNEL_MAX_CHUNK_WORK = 512 * 512


def _cpu_kernel_fits(max_query_len: int | None, max_seq_len: int | None) -> bool:
    if max_query_len is None or max_seq_len is None:
        return True
    return max_query_len * max_seq_len <= CPU_KERNEL_MAX_CHUNK_WORK
