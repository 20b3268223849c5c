"""`PagedAttentionStep` (the step's metadata checked once, every layer's call reusing it) against the
per-call wrappers of `kvasir.kernels.cpu_ops.paged_attention`, and the checks it keeps: a bad
length, block id or slot still fails with the request or token named, a layer of another shape
is refused. Also `AttentionMetadata.cpu_step`: one plan per step, none where the C kernels do not run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvasir.kernels import attention as dispatched
from kvasir.kernels.cpu_ops import paged_attention as cpu
from kvasir.kernels.cpu_ops.paged_attention_step import PagedAttentionStep
from kvasir.runtime.layers.attention import AttentionMetadata
from tests.kernels.paged_batches import PagedBatch, make_batch

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler: the CPU kernels are not built")

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 32, 4


def new_rows(batch: PagedBatch) -> torch.Tensor:
    """Each query row's slot: its request's last positions, through the block table."""
    slots = []
    for r, query_len in enumerate(batch.query_lens):
        length = int(batch.seq_lens[r])
        for pos in range(length - query_len, length):
            slots.append(int(batch.block_table[r, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    return torch.tensor(slots, dtype=torch.int64)


def layer_inputs(batch: PagedBatch, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as views of one merged projection's rows, as the model passes them."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = batch.q.shape[0]
    sizes = [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM]
    qkv = torch.randn(num_tokens, sum(sizes), generator=g)
    q, k, v = (part.view(num_tokens, -1, HEAD_DIM) for part in qkv.split(sizes, dim=1))
    return q, k, v


def make(requests: list[tuple[int, int]], cache_dtype: torch.dtype = torch.float16) -> PagedBatch:
    batch = make_batch(
        requests, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE
    )
    return dataclasses.replace(
        batch, k_cache=batch.k_cache.to(cache_dtype), v_cache=batch.v_cache.to(cache_dtype)
    )


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 5])
def test_two_layers_match_the_per_call_wrappers(cache_dtype: torch.dtype, window: int | None) -> None:
    batch = make([(9, 1), (17, 3), (4, 4)], cache_dtype)
    slots = new_rows(batch)
    num_tokens = batch.q.shape[0]
    angles = torch.rand(num_tokens, 1, HEAD_DIM // 2, generator=torch.Generator().manual_seed(3)) * 6
    cos, sin = angles.cos(), angles.sin()
    step = PagedAttentionStep(
        batch.q, batch.k_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, slots
    )
    for layer in range(2):  # each layer its own cache and inputs, the step's metadata shared
        q, k, v = layer_inputs(batch, seed=layer)
        caches = batch.k_cache.clone(), batch.v_cache.clone()
        expected_caches = batch.k_cache.clone(), batch.v_cache.clone()

        out = step.attend(step.rotary_store_kv(q, k, v, cos, sin, *caches), *caches, 0.2, window)

        rotated = cpu.rotary_store_kv(q, k, v, cos, sin, *expected_caches, slots)
        expected = cpu.paged_attention(
            rotated, *expected_caches, batch.block_table, batch.seq_lens, batch.query_start_loc, 0.2, window
        )
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        torch.testing.assert_close(caches, expected_caches, atol=0, rtol=0)


def test_bad_lengths_blocks_and_slots_still_name_the_request_or_token() -> None:
    batch = make([(9, 1), (6, 1)])
    slots = new_rows(batch)
    q, k, v = layer_inputs(batch, seed=0)
    cos, sin = torch.ones(2, HEAD_DIM // 2), torch.zeros(2, HEAD_DIM // 2)
    caches = batch.k_cache, batch.v_cache

    bad_table = batch.block_table.clone()
    bad_table[1, 0] = 10_000
    step = PagedAttentionStep(batch.q, batch.k_cache, bad_table, batch.seq_lens, batch.query_start_loc, slots)
    rotated = step.rotary_store_kv(q, k, v, cos, sin, *caches)
    with pytest.raises(ValueError, match="request 1: block_table holds a block id outside the cache"):
        step.attend(rotated, *caches, 0.2, None)

    too_long = torch.tensor([9, 1_000], dtype=torch.int32)
    step = PagedAttentionStep(
        batch.q, batch.k_cache, batch.block_table, too_long, batch.query_start_loc, slots
    )
    with pytest.raises(ValueError, match="request 1: its seq_len exceeds the block table's capacity"):
        step.attend(rotated, *caches, 0.2, None)

    bad_slots = torch.tensor([0, 10_000])
    step = PagedAttentionStep(
        batch.q, batch.k_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, bad_slots
    )
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] is outside"):
        step.rotary_store_kv(q, k, v, cos, sin, *caches)
    with pytest.raises(ValueError, match=r"slot_mapping must be int64 of shape \[2\]"):
        PagedAttentionStep(
            batch.q, batch.k_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, slots[:1]
        )
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        PagedAttentionStep(
            batch.q, batch.k_cache, batch.block_table, batch.seq_lens.long(), batch.query_start_loc, slots
        )


def test_a_layer_of_another_shape_is_refused() -> None:
    batch = make([(9, 1), (6, 1)])
    step = PagedAttentionStep(
        batch.q, batch.k_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, new_rows(batch)
    )
    q, k, v = layer_inputs(batch, seed=0)
    cos, sin = torch.ones(2, HEAD_DIM // 2), torch.zeros(2, HEAD_DIM // 2)
    with pytest.raises(ValueError, match="k must be float32"):
        step.rotary_store_kv(q, k[:1], v, cos, sin, batch.k_cache, batch.v_cache)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        step.rotary_store_kv(q, k, v, cos, sin, batch.k_cache[:-1], batch.v_cache)
    with pytest.raises(ValueError, match="cos must be contiguous float32"):
        step.rotary_store_kv(q, k, v, cos[:1], sin, batch.k_cache, batch.v_cache)
    with pytest.raises(ValueError, match="q must be contiguous float32"):
        step.attend(q, batch.k_cache, batch.v_cache, 0.2, None)  # a strided view, not rotary's output


def test_metadata_builds_one_plan_per_step_and_none_for_long_chunks() -> None:
    batch = make([(9, 1), (6, 1)])
    attn = AttentionMetadata(
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        slot_mapping=new_rows(batch),
        max_query_len=1,
        max_seq_len=9,
    )
    step = attn.cpu_step(batch.q, batch.k_cache)
    assert isinstance(step, PagedAttentionStep)
    assert attn.cpu_step(batch.q, batch.k_cache.clone()) is step  # the next layer's cache: same plan
    assert attn.cpu_step(batch.q, batch.k_cache.float()) is not step  # another cache dtype: its own
    long_chunk = dataclasses.replace(attn, max_query_len=dispatched.CPU_KERNEL_MAX_CHUNK_WORK, max_seq_len=9)
    assert long_chunk.cpu_step(batch.q, batch.k_cache) is None
    assert attn.cpu_step(batch.q.double(), batch.k_cache) is None
