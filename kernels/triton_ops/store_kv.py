"""Triton `store_kv`: scatter this step's K and V rows into the paged cache by slot mapping."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kvasir.kernels.checks import check_store_kv
from kvasir.kernels.kv_quant import check_kv_scales, is_fp8
from kvasir.kernels.triton_ops.common import check_float_dtype


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    k_scale,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program per token: its Hkv * D values are one contiguous row of the flattened cache.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding (e.g. CUDA-graph filler rows) owns no slot
        return
    offsets = tl.arange(0, BLOCK)
    valid = offsets < NUM_KV_HEADS * HEAD_DIM
    head = offsets // HEAD_DIM
    dim = offsets % HEAD_DIM
    token_64 = token.to(tl.int64)
    k = tl.load(key_ptr + token_64 * stride_key_token + head * stride_key_head + dim, mask=valid)
    v = tl.load(value_ptr + token_64 * stride_value_token + head * stride_value_head + dim, mask=valid)
    if FP8:  # saturate to e4m3's range (+-448) before rounding, as `quantize_fp8` does
        k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
    row = slot * (NUM_KV_HEADS * HEAD_DIM)  # slot is int64: caches beyond 2**31 elements are fine
    tl.store(k_cache_ptr + row + offsets, k.to(k_cache_ptr.dtype.element_ty), mask=valid)
    tl.store(v_cache_ptr + row + offsets, v.to(v_cache_ptr.dtype.element_ty), mask=valid)


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
    """Write `key`/`value` [T, Hkv, D] into the caches at `slot_mapping` [T] int64; slot -1 is skipped."""
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    for name, t in (("key", key), ("value", value)):
        check_float_dtype(name, t.dtype)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, num_kv_heads, head_dim = k_cache.shape
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_scale,
        v_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
        FP8=is_fp8(k_cache.dtype),
    )
