"""Split-K (flash-decoding) paged attention for decode-only batches, in Triton.

A decode has one query row per request, so one program per (request, KV head) leaves most of a
GPU idle when the batch is small and the contexts long. Here each request's keys are cut into
`num_splits` ranges; one program per (request, KV head, split) writes a partial output and its
log-sum-exp, and a merge kernel combines the splits. The split ranges are computed in the kernel
from `seq_lens`, so the launch depends only on (requests, KV heads, splits): capturable in a CUDA
graph, with the partial buffers preallocated in an `AttentionWorkspace`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvasir.kernels.kv_quant import is_fp8
from kvasir.kernels.triton_ops.attention_tile import attend_keys
from kvasir.kernels.triton_ops.common import LOG2E, dot_in_fp32, gpu_tiles
from kvasir.kernels.workspace import MAX_DECODE_SPLITS, AttentionWorkspace

# A split shorter than this many keys costs more in its merge than it saves in parallelism.
MIN_KEYS_PER_SPLIT = 256


@triton.jit
def _decode_split_kernel(
    partial_out_ptr,
    partial_lse_ptr,
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
    num_splits,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    stride_partial_request,
    stride_partial_head,
    stride_partial_split,
    stride_lse_request,
    stride_lse_head,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
    DIRECT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) == q_start:  # a request with no query row this step
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, ROWS)  # the GQA group's query heads, padded to tl.dot's 16 rows
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    # The one query sits at seq_len - 1 and sees every key in [first_key, seq_len): split that range.
    first_key = 0
    if WINDOW > 0:
        first_key = tl.maximum(seq_len - WINDOW, 0)
    keys_per_split = tl.cdiv(tl.cdiv(seq_len - first_key, num_splits), TILE_N) * TILE_N
    begin = first_key + split * keys_per_split
    end = tl.minimum(begin + keys_per_split, seq_len)

    table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    q_pos = tl.zeros([ROWS], tl.int32) + seq_len - 1
    # Whole tiles need no mask (every key in the range is visible); only a last partial tile does.
    unmasked_end = begin + tl.maximum(end - begin, 0) // TILE_N * TILE_N
    acc, m_i, l_i = attend_keys(
        q, k_cache_ptr, v_cache_ptr, table_row, kv_head, begin, unmasked_end, end, q_pos, scale_log2,
        k_scale, v_scale, stride_cache_block, stride_cache_slot, stride_cache_head,
        ROWS, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, WINDOW, DOT_FP32, KV_FP8,
    )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if DIRECT:  # a single split is the whole answer: skip the merge
        tl.store(
            out_ptr
            + q_start.to(tl.int64) * stride_out_token
            + head[:, None] * stride_out_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        # An empty split (a short context) has l = 0: its lse is -inf and the merge gives it no weight.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        partial = seq.to(tl.int64) * stride_partial_request + split * stride_partial_split
        tl.store(
            partial_out_ptr + partial + head[:, None] * stride_partial_head + dims[None, :],
            out,
            mask=q_mask,
        )
        tl.store(
            partial_lse_ptr + seq.to(tl.int64) * stride_lse_request + head * stride_lse_head + split,
            lse,
            mask=row_valid,
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_ptr,
    num_splits,
    stride_out_token,
    stride_out_head,
    stride_partial_request,
    stride_partial_head,
    stride_partial_split,
    stride_lse_request,
    stride_lse_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) == q_start:
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    lse = tl.load(
        partial_lse_ptr + seq.to(tl.int64) * stride_lse_request + head * stride_lse_head + splits,
        mask=split_valid,
        other=float("-inf"),
    )
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    total = tl.sum(weights, 0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    partial = tl.load(
        partial_out_ptr
        + seq.to(tl.int64) * stride_partial_request
        + head * stride_partial_head
        + splits[:, None] * stride_partial_split
        + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(weights[:, None] * partial, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_requests: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per request: enough programs for about two waves over the GPU's SMs, each split at
    least MIN_KEYS_PER_SPLIT keys, at most MAX_DECODE_SPLITS, a power of two (few compiled variants).

    Depends on `max_seq_len`, not the actual lengths, so a CUDA graph captured at the model's
    maximum length replays correctly for any shorter context (the extra splits are empty).
    """
    if device.type == "cuda":
        num_sms = _multiprocessor_count(
            device.index if device.index is not None else torch.cuda.current_device()
        )
    else:
        num_sms = 4  # Triton's interpreter: small, so the CPU tests exercise the split path
    wanted = triton.cdiv(2 * num_sms, max(1, num_requests * num_kv_heads))
    useful = triton.cdiv(max(max_seq_len, 1), MIN_KEYS_PER_SPLIT)
    splits = max(1, min(wanted, useful, MAX_DECODE_SPLITS))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def decode_attention(
    out: Tensor,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    sliding_window: int | None,
    num_splits: int,
    workspace: AttentionWorkspace | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attention of a batch where every request has at most one query row (arguments validated)."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    num_requests = block_table.shape[0]
    num_heads = q.shape[1]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits == 1:
        partial_out, partial_lse = out, out  # unused: the kernel writes `out` directly
    elif workspace is not None and workspace.fits(num_requests, num_heads, head_dim, num_splits):
        partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
    else:
        partial_out = torch.empty(
            num_requests, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(num_requests, num_heads, num_splits, dtype=torch.float32, device=q.device)
    partial_strides = partial_out.stride()[:3] if num_splits > 1 else (0, 0, 0)
    lse_strides = partial_lse.stride()[:2] if num_splits > 1 else (0, 0)
    # IEEE float32 dots keep both operands in registers: on a GPU, half the keys per step and no
    # software pipelining, or Hopper spills (tests/kernels/test_gpu_compile.py checks).
    fp32_on_gpu = gpu_tiles(q) and q.dtype == torch.float32
    tile_n = (32 if fp32_on_gpu else 64) if gpu_tiles(q) else 16
    num_stages = 1 if fp32_on_gpu else 2
    _decode_split_kernel[(num_requests, num_kv_heads, num_splits)](
        partial_out,
        partial_lse,
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
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        *partial_strides,
        *lse_strides,
        GROUP=group,
        ROWS=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        WINDOW=sliding_window or 0,
        DOT_FP32=dot_in_fp32(q.dtype),
        KV_FP8=is_fp8(k_cache.dtype),
        DIRECT=num_splits == 1,
        num_warps=4,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_requests, num_heads)](
            out,
            partial_out,
            partial_lse,
            query_start_loc,
            num_splits,
            out.stride(0),
            out.stride(1),
            *partial_strides,
            *lse_strides,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
