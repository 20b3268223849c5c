"""Random paged batches and the definition of causal attention over them, for the kernel tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvasir.kernels.reference.attention import store_kv


@dataclass(frozen=True)
class PagedBatch:
    """A batch laid out in a paged cache, plus the dense K/V/q it was built from."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    dense_k: list[torch.Tensor]  # per request [L, Hkv, D]
    dense_v: list[torch.Tensor]
    query_lens: list[int]


def make_batch(
    requests: list[tuple[int, int]],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """`requests` are (context length, query length); blocks are handed out in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(length / block_size) for length, _ in requests]
    num_blocks = sum(blocks_needed) + 3  # spare blocks hold garbage that must never be read
    free = torch.randperm(num_blocks, generator=g).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    max_blocks = max(blocks_needed, default=0) + 1  # one column of 0-padding beyond the longest
    block_table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    dense_k, dense_v, queries = [], [], []
    for r, ((length, query_len), n) in enumerate(zip(requests, blocks_needed, strict=True)):
        blocks = [free.pop() for _ in range(n)]
        block_table[r, :n] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(length, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(length, num_kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(length)
        slots = torch.tensor(blocks, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
        store_kv(k, v, k_cache, v_cache, slots)
        dense_k.append(k)
        dense_v.append(v)
        queries.append(torch.randn(query_len, num_heads, head_dim, generator=g).to(dtype))
    query_lens = [query_len for _, query_len in requests]
    starts = torch.zeros(len(requests) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    return PagedBatch(
        q=torch.cat(queries) if queries else torch.zeros(0, num_heads, head_dim, dtype=dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=torch.tensor([length for length, _ in requests], dtype=torch.int32),
        query_start_loc=starts,
        dense_k=dense_k,
        dense_v=dense_v,
        query_lens=query_lens,
    )


def naive_attention(batch: PagedBatch, scale: float, window: int | None = None) -> torch.Tensor:
    """Row by row, head by head, in float64 on the CPU (whatever the batch's device): the
    definition, not an optimisation of it."""
    num_heads = batch.q.shape[1]
    group = num_heads // batch.dense_k[0].shape[1] if batch.dense_k else 1
    out = torch.zeros(batch.q.shape, dtype=torch.float64)
    row = 0
    for k, v, query_len in zip(batch.dense_k, batch.dense_v, batch.query_lens, strict=True):
        length = k.shape[0]
        for i in range(query_len):
            pos = length - query_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(num_heads):
                keys = k[lo : pos + 1, h // group].double().cpu()
                values = v[lo : pos + 1, h // group].double().cpu()
                weights = torch.softmax(keys @ batch.q[row, h].double().cpu() * scale, dim=0)
                out[row, h] = weights @ values
            row += 1
    return out


# (context length, query length) per request: the shapes every implementation must get right.
CASES = {
    "single-token": [(1, 1)],
    "decodes-only": [(5, 1), (16, 1), (17, 1), (33, 1), (1, 1)],
    "prompts-only": [(7, 7), (16, 16), (20, 20), (2, 2)],
    "chunk-mid-block": [(11, 5), (19, 3), (10, 2)],
    "chunk-at-block-start": [(12, 4), (8, 8)],
    "mixed": [(13, 13), (9, 1), (30, 4), (1, 1), (17, 1), (6, 6)],
    "empty-query-request": [(5, 0), (9, 1), (7, 3)],
}
