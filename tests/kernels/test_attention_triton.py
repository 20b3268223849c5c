"""The Triton paged attention (unified and split-K decode) against the torch reference and the definition.

On a machine without CUDA these run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1); with CUDA, on the GPU. Shapes stay small so the interpreter is quick.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvasir.kernels import AttentionWorkspace
from kvasir.kernels import attention as dispatched
from kvasir.kernels.reference import attention as reference
from kvasir.kernels.triton_ops import attention as triton_attention
from kvasir.kernels.triton_ops.decode_attention import choose_num_splits, decode_attention
from kvasir.kernels.workspace import MAX_DECODE_SPLITS
from tests.kernels.paged_batches import CASES, PagedBatch, make_batch, naive_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Output rounding dominates: a half-precision result is off by up to ~1 ulp of values near 1.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def on_device(batch: PagedBatch) -> PagedBatch:
    return PagedBatch(
        q=batch.q.to(DEVICE),
        k_cache=batch.k_cache.to(DEVICE),
        v_cache=batch.v_cache.to(DEVICE),
        block_table=batch.block_table.to(DEVICE),
        seq_lens=batch.seq_lens.to(DEVICE),
        query_start_loc=batch.query_start_loc.to(DEVICE),
        dense_k=batch.dense_k,
        dense_v=batch.dense_v,
        query_lens=batch.query_lens,
    )


def triton_run(batch: PagedBatch, scale: float, window: int | None = None, **kwargs: object) -> torch.Tensor:
    b = on_device(batch)
    out = triton_attention.paged_attention(
        b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, b.query_start_loc, scale, window, **kwargs
    )
    return out.cpu()


def reference_run(batch: PagedBatch, scale: float, window: int | None = None) -> torch.Tensor:
    return reference.paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        window,
    )


def assert_matches(out: torch.Tensor, batch: PagedBatch, scale: float, window: int | None = None) -> None:
    tol = TOLERANCE[batch.q.dtype]
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.double().cpu(), naive_attention(batch, scale, window), atol=tol, rtol=tol)


@pytest.mark.parametrize("requests", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"]
)
def test_matches_definition_on_every_batch_shape(
    requests: list[tuple[int, int]], num_heads: int, num_kv_heads: int
) -> None:
    batch = make_batch(requests, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, block_size=4)
    assert_matches(triton_run(batch, 0.25), batch, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("head_dim", "block_size"), [(64, 16), (128, 32), (80, 16)], ids=["d64-b16", "d128-b32", "d80-b16"]
)
def test_head_dims_block_sizes_and_dtypes(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    """Prompts, a chunk after a cached prefix that starts mid-block, and decodes, in one batch."""
    batch = make_batch(
        [(40, 40), (45, 7), (33, 1), (16, 1)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=head_dim,
    )
    scale = head_dim**-0.5
    out = triton_run(batch, scale)
    assert_matches(out, batch, scale)
    # Same inputs, same answer as the reference up to rounding.
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), reference_run(batch, scale).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_sliding_window(window: int) -> None:
    batch = make_batch(CASES["mixed"], num_heads=8, num_kv_heads=2, head_dim=16, block_size=4, seed=7)
    out = triton_run(batch, 0.5, window)
    assert_matches(out, batch, 0.5, window)


def test_long_block_table_decodes_and_prefill() -> None:
    """Contexts of ~100 blocks: the key loop crosses many blocks scattered over the cache."""
    batch = make_batch(
        [(397, 1), (400, 1), (390, 9)], num_heads=4, num_kv_heads=1, head_dim=16, block_size=4, seed=5
    )
    assert batch.block_table.shape[1] >= 100
    assert_matches(triton_run(batch, 0.2), batch, 0.2)


@pytest.mark.parametrize("num_splits", [1, 2, 4, 16])
@pytest.mark.parametrize("window", [None, 9])
def test_split_k_decode_matches_for_any_number_of_splits(num_splits: int, window: int | None) -> None:
    """More splits than a short context has keys leaves splits empty: the merge must ignore them."""
    batch = on_device(
        make_batch(
            [(1, 1), (5, 1), (37, 1), (64, 1), (5, 0)],
            num_heads=8,
            num_kv_heads=2,
            head_dim=16,
            seed=num_splits,
        )
    )
    out = torch.full_like(batch.q, float("nan"))
    decode_attention(
        out, batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens,
        batch.query_start_loc, 0.3, window, num_splits,
    )  # fmt: skip
    assert_matches(out.cpu(), batch, 0.3, window)


def test_split_k_uses_the_workspace_and_matches_without_it() -> None:
    batch = on_device(
        make_batch([(70, 1), (3, 1), (50, 1)], num_heads=4, num_kv_heads=2, head_dim=16, seed=11)
    )
    workspace = AttentionWorkspace(max_requests=8, num_q_heads=4, head_dim=16, max_splits=4, device=DEVICE)
    workspace.partial_lse.fill_(float("nan"))
    outs = []
    for ws in (workspace, None):
        out = torch.empty_like(batch.q)
        decode_attention(
            out, batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens,
            batch.query_start_loc, 0.3, None, 4, ws,
        )  # fmt: skip
        outs.append(out)
    assert not workspace.partial_lse[:3].isnan().any()  # the kernel wrote its partials there
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    assert_matches(outs[0].cpu(), batch, 0.3)


def test_num_splits_heuristic() -> None:
    cpu = torch.device("cpu")
    assert choose_num_splits(1, 1, 100, cpu) == 1  # too short to be worth splitting
    assert choose_num_splits(1, 1, 4096, cpu) == 8  # 2 waves over the interpreter's 4 "SMs"
    assert choose_num_splits(256, 8, 16384, cpu) == 1  # the batch alone fills the device
    for requests in (1, 3, 8, 64):
        splits = choose_num_splits(requests, 8, 1 << 20, cpu)
        assert 1 <= splits <= MAX_DECODE_SPLITS and splits & (splits - 1) == 0


def test_explicit_lengths_give_the_same_result() -> None:
    """Passing upper bounds for max_query_len/max_seq_len (as the model runner does) changes nothing."""
    batch = make_batch(CASES["mixed"], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=2)
    implicit = triton_run(batch, 0.3)
    explicit = triton_run(batch, 0.3, max_query_len=max(batch.query_lens), max_seq_len=64)
    torch.testing.assert_close(explicit, implicit, atol=0, rtol=0)


@settings(max_examples=25, deadline=None)
@given(
    requests=st.lists(
        st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))),
        min_size=1,
        max_size=5,
    ),
    block_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 2, 4, 8]),
    window=st.one_of(st.none(), st.integers(1, 12)),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_the_reference(
    requests: list[tuple[int, int]], block_size: int, group: int, window: int | None, seed: int
) -> None:
    batch = make_batch(
        requests, num_heads=group, num_kv_heads=1, head_dim=16, block_size=block_size, seed=seed
    )
    torch.testing.assert_close(
        triton_run(batch, 0.3, window), reference_run(batch, 0.3, window), atol=2e-5, rtol=2e-5
    )


def test_empty_batch() -> None:
    batch = make_batch([(5, 0)], head_dim=16)
    assert triton_run(batch, 0.3).shape == (0, 4, 16)


def test_dispatcher_runs_triton_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    kernel = triton_attention.paged_attention

    def spy(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(q.shape[0])
        return kernel(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_attention, "paged_attention", spy)
    monkeypatch.setenv("KVASIR_KERNELS", "triton")
    b = on_device(make_batch(CASES["mixed"], head_dim=16))
    out = dispatched.paged_attention(
        b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, b.query_start_loc, 0.3
    )
    assert calls == [b.q.shape[0]]
    assert_matches(out.cpu(), b, 0.3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": lambda b: b.q.int()}, "q is torch.int32"),
        ({"q": lambda b: b.q.transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous last dimension"),
        ({"block_table": lambda b: b.block_table.long()}, "block_table must be int32"),
        ({"seq_lens": lambda b: b.seq_lens[:-1]}, "seq_lens must be int32"),
        ({"query_start_loc": lambda b: b.query_start_loc.long()}, "query_start_loc must be int32"),
        ({"k_cache": lambda b: b.k_cache.half()}, "v_cache"),
        ({"seq_lens": lambda b: b.seq_lens.to("meta")}, "one device"),
    ],
    ids=["dtype", "strides", "block-table", "seq-lens", "starts", "cache-dtypes", "devices"],
)
def test_wrapper_rejects_bad_arguments(change: dict[str, object], message: str) -> None:
    b = make_batch([(9, 3), (4, 1)], head_dim=16)
    args = {
        "q": b.q, "k_cache": b.k_cache, "v_cache": b.v_cache, "block_table": b.block_table,
        "seq_lens": b.seq_lens, "query_start_loc": b.query_start_loc,
    }  # fmt: skip
    for name, make in change.items():
        args[name] = make(b)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        triton_attention.paged_attention(**args, scale=0.3)  # type: ignore[arg-type]
