"""Argument checks shared by the torch references and the Triton launch wrappers.

Every check raises `ValueError` naming the argument at fault. The structural checks (shape, dtype,
device, layout) never read tensor data, so the Triton wrappers run them on every call without a
device sync; `attention_lengths` reads the lengths and is for the references and tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvasir.kernels.kv_quant import KV_CACHE_DTYPES, is_fp8
from kvasir.kernels.lora_rows import LoRARows


def check_same_device(**tensors: Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listed}")


def check_caches(k_cache: Tensor, v_cache: Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {list(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache ({v_cache.dtype}, {list(v_cache.shape)}) must match "
            f"k_cache ({k_cache.dtype}, {list(k_cache.shape)})"
        )
    if k_cache.dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"the KV cache must be float32, float16, bfloat16 or float8_e4m3fn, got {k_cache.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (slots are addressed as flat rows)")


def check_store_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    check_caches(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
                f"got {list(t.shape)}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens but value has {value.shape[0]}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be int64 of shape [{key.shape[0]}], "
            f"got {slot_mapping.dtype} of shape {list(slot_mapping.shape)}"
        )
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def check_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    sliding_window: int | None,
) -> None:
    """Shapes, dtypes, layout and devices of `paged_attention`'s arguments (reads no data)."""
    check_caches(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [num_tokens, num_heads, {head_dim}], got {list(q.shape)}")
    if q.stride(-1) != 1:
        raise ValueError(f"q must have a contiguous last dimension, got strides {q.stride()}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    # A float32 model may keep a narrower cache (the CPU default: float16); it is read as float32.
    if q.dtype != k_cache.dtype and not is_fp8(k_cache.dtype) and q.dtype != torch.float32:
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        raise ValueError(
            f"block_table must be int32 [num_requests, max_blocks] with contiguous rows, "
            f"got {block_table.dtype} {list(block_table.shape)}"
        )
    num_requests = block_table.shape[0]
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (num_requests,):
        raise ValueError(
            f"seq_lens must be int32 [{num_requests}], got {seq_lens.dtype} {list(seq_lens.shape)}"
        )
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (num_requests + 1,):
        raise ValueError(
            f"query_start_loc must be int32 [{num_requests + 1}], "
            f"got {query_start_loc.dtype} {list(query_start_loc.shape)}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )


def attention_lengths(
    q: Tensor, block_size: int, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor
) -> tuple[list[int], list[int]]:
    """Check the per-request lengths (reads them: a device sync); return query_start_loc and seq_lens."""
    starts: list[int] = query_start_loc.tolist()
    lens: list[int] = seq_lens.tolist()
    if starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"query_start_loc must run from 0 to num_tokens ({q.shape[0]}), got {starts}")
    capacity = block_table.shape[1] * block_size
    for r in range(len(lens)):
        query_len = starts[r + 1] - starts[r]
        if query_len < 0 or query_len > lens[r]:
            raise ValueError(
                f"request {r}: query length {query_len} must be between 0 and its seq_len {lens[r]}"
            )
        if lens[r] > capacity:
            raise ValueError(
                f"request {r}: seq_len {lens[r]} exceeds the block table's capacity "
                f"({block_table.shape[1]} blocks of {block_size})"
            )
    return starts, lens


def check_int4_matmul(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> None:
    """Shapes, dtypes and devices of `int4_matmul`'s arguments (reads no data)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {list(x.shape)}")
    k = x.shape[1]
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] * 8 != k:
        raise ValueError(
            f"qweight must be int32 [{k // 8}, N] (eight inputs per word) for x {list(x.shape)}, "
            f"got {qweight.dtype} {list(qweight.shape)}"
        )
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    n = qweight.shape[1]
    groups = -(-k // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (groups, n):
            raise ValueError(f"{name} must be [{groups}, {n}], got {list(t.shape)}")
        if t.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if not qweight.is_contiguous():
        raise ValueError("qweight must be contiguous")
    check_same_device(x=x, qweight=qweight, scales=scales, zeros=zeros)


LORA_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_lora_shrink(x: Tensor, a: Tensor, scalings: Tensor, rows: LoRARows) -> None:
    """`lora_shrink`'s arguments: x [T, in], a [S, n*R, in], scalings [S] float32, rows of T."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"x must be [num_tokens, in_features] with a contiguous last dimension, got {list(x.shape)}"
        )
    if a.dim() != 3 or a.shape[2] != x.shape[1] or not a.is_contiguous():
        raise ValueError(f"a must be a contiguous [slots, slices * rank, {x.shape[1]}], got {list(a.shape)}")
    if scalings.dtype != torch.float32 or tuple(scalings.shape) != (a.shape[0],):
        raise ValueError(
            f"scalings must be float32 [{a.shape[0]}], got {scalings.dtype} {list(scalings.shape)}"
        )
    # The pool's dtype (--lora-dtype) may differ from x's: the kernels compute in float32 then.
    if x.dtype not in LORA_FLOAT_DTYPES or a.dtype not in LORA_FLOAT_DTYPES:
        raise ValueError(f"x and a must be float32, float16 or bfloat16, got {x.dtype} and {a.dtype}")
    if tuple(rows.token_slots.shape) != (x.shape[0],):
        raise ValueError(f"rows map {rows.token_slots.shape[0]} tokens, x has {x.shape[0]}")
    if rows.dense_mask is not None and tuple(rows.dense_mask.shape) != (x.shape[0], a.shape[0], 1):
        raise ValueError(f"rows were laid out dense for {rows.dense_mask.shape[1]} slots, a has {a.shape[0]}")
    check_same_device(x=x, a=a, scalings=scalings, sorted_rows=rows.sorted_rows)


def check_lora_expand(out: Tensor, y: Tensor, b: Tensor, rows: LoRARows) -> None:
    """`lora_expand`'s arguments: out [T, out], y float32 from `lora_shrink`, b [S, n*R, out]."""
    if out.dim() != 2 or out.stride(-1) != 1:
        raise ValueError(
            f"out must be [num_tokens, out_features] with a contiguous last dimension, got {list(out.shape)}"
        )
    if b.dim() != 3 or b.shape[2] != out.shape[1] or not b.is_contiguous():
        raise ValueError(
            f"b must be a contiguous [slots, slices * rank, {out.shape[1]}], got {list(b.shape)}"
        )
    # The pool's dtype (--lora-dtype) may differ from out's: the kernels compute in float32 then.
    if out.dtype not in LORA_FLOAT_DTYPES or b.dtype not in LORA_FLOAT_DTYPES:
        raise ValueError(f"out and b must be float32, float16 or bfloat16, got {out.dtype} and {b.dtype}")
    dense = rows.dense_mask is not None
    expected = (out.shape[0], b.shape[0] * b.shape[1]) if dense else (rows.num_rows, b.shape[1])
    if y.dtype != torch.float32 or tuple(y.shape) != expected or not y.is_contiguous():
        raise ValueError(f"y must be a contiguous float32 {list(expected)}, got {y.dtype} {list(y.shape)}")
    if tuple(rows.token_slots.shape) != (out.shape[0],):
        raise ValueError(f"rows map {rows.token_slots.shape[0]} tokens, out has {out.shape[0]}")
    check_same_device(out=out, y=y, b=b, sorted_rows=rows.sorted_rows)
