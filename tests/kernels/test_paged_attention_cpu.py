"""The CPU C kernels of the paged cache (`kvasir.kernels.cpu_ops.paged_attention`) against the torch
reference and the naive definition: attention over float32, float16 and bfloat16 caches, the
rotary-then-store op, and the argument checks of their wrappers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvasir.kernels.cpu_ops import paged_attention as cpu
from kvasir.kernels.reference import attention as reference
from kvasir.kernels.reference.rotary import apply_rotary
from tests.kernels.paged_batches import CASES, PagedBatch, make_batch, naive_attention

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler: the CPU kernels are not built")

# Requests crossing block boundaries at block size 16 (the default) and a long one.
LONG_CASES = {
    "block-edges": [(15, 1), (16, 1), (17, 1), (32, 1), (33, 1)],
    "long-mixed": [(300, 1), (1, 1), (129, 1), (70, 6), (48, 48)],
}


def in_cache_dtype(batch: PagedBatch, dtype: torch.dtype) -> PagedBatch:
    """The batch with its cache (and dense copies) rounded to `dtype`; q stays float32."""
    return dataclasses.replace(
        batch,
        k_cache=batch.k_cache.to(dtype),
        v_cache=batch.v_cache.to(dtype),
        dense_k=[k.to(dtype) for k in batch.dense_k],
        dense_v=[v.to(dtype) for v in batch.dense_v],
    )


def run(impl, batch: PagedBatch, scale: float, window: int | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, batch.query_start_loc)
    return impl(*args, scale, window)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("requests", [*CASES.values(), *LONG_CASES.values()], ids=[*CASES, *LONG_CASES])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 16), (9, 3, 64), (8, 2, 128), (8, 1, 32), (6, 2, 24)],
    ids=["mha", "gqa3-d64", "gqa4-d128", "gqa8", "d24-portable"],
)
def test_attention_matches_reference_and_definition(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
) -> None:
    """With AVX-512, head_dim 64 and 128 run the tile loops (64 floats at a time), 16 and 32 the
    per-key vector loops, 24 (not a multiple of 16) the portable ones."""
    batch = in_cache_dtype(
        make_batch(
            requests, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16
        ),
        cache_dtype,
    )
    scale = head_dim**-0.5
    out = run(cpu.paged_attention, batch, scale)
    torch.testing.assert_close(out, run(reference.paged_attention, batch, scale), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), naive_attention(batch, scale), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 8, 32])
@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_block_sizes_and_sliding_windows(block_size: int, window: int | None) -> None:
    batch = make_batch(
        CASES["mixed"] + [(90, 1)], num_heads=8, num_kv_heads=2, head_dim=32, block_size=block_size
    )
    out = run(cpu.paged_attention, batch, 0.3, window)
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.3, window), atol=2e-5, rtol=1e-5)


def test_large_scores_stay_finite() -> None:
    """Scores in the hundreds: the online softmax must subtract each tile's running maximum."""
    batch = make_batch([(70, 1), (33, 2)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, seed=5)
    batch = dataclasses.replace(batch, q=batch.q * 40)
    out = run(cpu.paged_attention, batch, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), naive_attention(batch, 1.0), atol=1e-4, rtol=1e-4)


def test_two_threads_give_the_same_result() -> None:
    """Enough work for the kernel to split its (row, KV head) items between two threads."""
    batch = make_batch([(600, 1)] * 8 + [(40, 8)], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = run(cpu.paged_attention, batch, 0.125)
        torch.set_num_threads(2)
        torch.testing.assert_close(run(cpu.paged_attention, batch, 0.125), one, atol=0, rtol=0)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rotary_store_matches_rotate_then_store(cache_dtype: torch.dtype, head_dim: int) -> None:
    g = torch.Generator().manual_seed(1)
    num_tokens, num_heads, num_kv_heads, block_size = 5, 6, 2, 4
    # q/k/v as views of one merged projection's rows, as the model passes them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    q, k, v = (
        part.view(num_tokens, -1, head_dim)
        for part in qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    )
    angles = torch.rand(num_tokens, head_dim // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([7, 0, -1, 12, 3], dtype=torch.int64)
    shape = (4, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    q_out = cpu.rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)

    reference.store_kv(apply_rotary(k, cos, sin), v, expected_k, expected_v, slots)
    torch.testing.assert_close(q_out, apply_rotary(q, cos, sin), atol=0, rtol=0)
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0)


def test_wrappers_reject_what_the_kernel_cannot_read() -> None:
    batch = make_batch([(9, 1)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    assert not cpu.supports(batch.q.double(), batch.k_cache)
    assert not cpu.supports(batch.q, batch.k_cache.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="does not take this call"):
        run(cpu.paged_attention, dataclasses.replace(batch, q=batch.q.double()), 0.5)
    short_table = dataclasses.replace(batch, block_table=batch.block_table[:, :2].contiguous())
    with pytest.raises(ValueError, match="exceeds the block table's capacity"):
        run(cpu.paged_attention, short_table, 0.5)
    bad_blocks = dataclasses.replace(batch, block_table=torch.full_like(batch.block_table, 1000))
    with pytest.raises(ValueError, match="request 0: block_table holds a block id outside the cache"):
        run(cpu.paged_attention, bad_blocks, 0.5)
    too_long = dataclasses.replace(batch, query_start_loc=torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="query_start_loc must run from 0 to num_tokens"):
        run(cpu.paged_attention, too_long, 0.5)
    k = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] is outside -1..23"):
        cpu.rotary_store_kv(
            torch.zeros(1, 4, 16),
            k,
            k,
            torch.ones(1, 8),
            torch.zeros(1, 8),
            batch.k_cache,
            batch.v_cache,
            torch.tensor([10_000]),
        )


def test_long_prompt_chunks_go_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher sends decode rows and short chunks to the C kernel, and a chunk whose rows x
    keys exceed CPU_KERNEL_MAX_CHUNK_WORK to SDPA (faster there); both give the same result."""
    from kvasir.kernels import attention as dispatched

    calls: list[str] = []
    real_cpu, real_reference = cpu.paged_attention, reference.paged_attention

    def spy(name: str, real):  # type: ignore[no-untyped-def]
        return lambda *args, **kwargs: calls.append(name) or real(*args, **kwargs)

    monkeypatch.setattr(cpu, "paged_attention", spy("cpu", real_cpu))
    monkeypatch.setattr(reference, "paged_attention", spy("reference", real_reference))
    batch = make_batch([(40, 8), (9, 1)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, batch.query_start_loc)
    limit = dispatched.CPU_KERNEL_MAX_CHUNK_WORK
    short = dispatched.paged_attention(*args, 0.25, max_query_len=8, max_seq_len=40)
    long = dispatched.paged_attention(*args, 0.25, max_query_len=limit // 40 + 1, max_seq_len=40)
    dispatched.paged_attention(*args, 0.25)  # no host bounds: the kernel
    assert calls == ["cpu", "reference", "cpu"]
    torch.testing.assert_close(short, long, atol=2e-5, rtol=1e-5)
