"""The plain-torch paged attention against a naive dense causal attention, on random paged batches."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvasir.kernels.reference.attention import paged_attention, store_kv
from tests.kernels.paged_batches import CASES, PagedBatch, make_batch, naive_attention

# The reference module itself, to count and patch its private helpers.
paged_module = importlib.import_module("kvasir.kernels.reference.attention")


def run(batch: PagedBatch, scale: float, window: int | None = None) -> torch.Tensor:
    return paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        window,
    )


@pytest.mark.parametrize("requests", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_matches_naive_attention(requests: list[tuple[int, int]], num_heads: int, num_kv_heads: int) -> None:
    batch = make_batch(requests, num_heads=num_heads, num_kv_heads=num_kv_heads)
    scale = 8**-0.5
    torch.testing.assert_close(
        run(batch, scale).double(), naive_attention(batch, scale), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("window", [1, 3, 4, 7, 100])
def test_sliding_window(window: int) -> None:
    batch = make_batch(CASES["mixed"], num_heads=8, num_kv_heads=2, seed=3)
    out = run(batch, 0.5, window)
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.5, window), atol=1e-5, rtol=1e-5)
    if window < 30:  # the window must actually change something
        assert not torch.allclose(out, run(batch, 0.5))


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(
        st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))),
        min_size=1,
        max_size=6,
    ),
    block_size=st.sampled_from([1, 2, 4, 16]),
    group=st.sampled_from([1, 2, 4]),
    window=st.one_of(st.none(), st.integers(1, 12)),
    seed=st.integers(0, 2**16),
)
def test_random_batches(
    requests: list[tuple[int, int]], block_size: int, group: int, window: int | None, seed: int
) -> None:
    batch = make_batch(requests, num_heads=2 * group, num_kv_heads=2, block_size=block_size, seed=seed)
    torch.testing.assert_close(
        run(batch, 0.3, window).double(), naive_attention(batch, 0.3, window), atol=1e-5, rtol=1e-5
    )


def test_half_precision_keeps_dtype_and_stays_close() -> None:
    batch = make_batch(CASES["mixed"], dtype=torch.bfloat16)
    out = run(batch, 8**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(batch, 8**-0.5), atol=2e-2, rtol=2e-2)


def test_decodes_are_one_batched_computation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four decodes and two prompt chunks: one dense call for all decodes, one per chunk."""
    calls: list[tuple[int, ...]] = []
    attend = paged_module._attend

    def counting(q: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(tuple(q.shape[:2]))
        return attend(q, *args)

    monkeypatch.setattr(paged_module, "_attend", counting)
    batch = make_batch([(9, 1), (13, 13), (30, 1), (5, 1), (11, 5), (2, 1)])
    torch.testing.assert_close(run(batch, 0.4).double(), naive_attention(batch, 0.4), atol=1e-5, rtol=1e-5)
    assert sorted(calls) == [(1, 5), (1, 13), (4, 1)]


def test_decode_rows_split_into_gather_chunks_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gather budget below one row's K/V puts every decode in its own chunk: same output."""
    calls: list[tuple[int, ...]] = []
    attend = paged_module._attend

    def counting(q: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(tuple(q.shape[:2]))
        return attend(q, *args)

    monkeypatch.setattr(paged_module, "_attend", counting)
    monkeypatch.setattr(paged_module, "GATHER_CHUNK_BYTES", 1)
    batch = make_batch(CASES["mixed"], num_heads=8, num_kv_heads=2)
    torch.testing.assert_close(run(batch, 0.4).double(), naive_attention(batch, 0.4), atol=1e-5, rtol=1e-5)
    assert sorted(calls) == [(1, 1)] * 3 + [(1, 4), (1, 6), (1, 13)]


@pytest.mark.parametrize("requests", [CASES["mixed"], CASES["decodes-only"]], ids=["mixed", "decodes"])
def test_slots_never_written_do_not_reach_the_output(requests: list[tuple[int, int]]) -> None:
    # A CPU cache is allocated without touching its pages, so a slot past a request's length may
    # hold any bit pattern: NaN there must not turn a row into NaN through a zero attention weight.
    batch = make_batch(requests, num_heads=8, num_kv_heads=2, seed=5)
    block_size = batch.k_cache.shape[1]
    written = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool)
    for row, length in enumerate(batch.seq_lens.tolist()):
        for position in range(length):
            written[batch.block_table[row, position // block_size], position % block_size] = True
    expected = run(batch, 0.5)
    batch.k_cache[~written] = float("nan")
    batch.v_cache[~written] = float("nan")
    torch.testing.assert_close(run(batch, 0.5), expected)


def test_store_kv_skips_padding_slots() -> None:
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    slots = torch.tensor([5, -1, 11, -1])
    store_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(12, 2, 8), v_cache.view(12, 2, 8)
    torch.testing.assert_close(flat_k[[5, 11]], key[[0, 2]])
    torch.testing.assert_close(flat_v[[5, 11]], value[[0, 2]])
    untouched = [i for i in range(12) if i not in (5, 11)]
    assert flat_k[untouched].eq(0).all() and flat_v[untouched].eq(0).all()


def test_store_kv_casts_to_the_cache_dtype() -> None:
    k_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(1, 1, 8)
    store_kv(key, key, k_cache, v_cache, torch.tensor([6]))
    assert torch.equal(k_cache[1, 2], key[0].to(torch.bfloat16))


def _valid_args() -> dict[str, object]:
    batch = make_batch([(6, 6), (9, 1)])
    return {
        "q": batch.q,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "block_table": batch.block_table,
        "seq_lens": batch.seq_lens,
        "query_start_loc": batch.query_start_loc,
        "scale": 1.0,
    }


BAD_ARGS = {
    "q-2d": ("q", lambda a: a["q"].flatten(1), "q must be"),
    "q-head-dim": ("q", lambda a: a["q"][..., :4], "q must be"),
    "heads-not-multiple": ("q", lambda a: torch.randn(7, 3, 8), "not a multiple"),
    "q-dtype": ("q", lambda a: a["q"].double(), "is torch.float64"),
    "v-cache-shape": ("v_cache", lambda a: a["v_cache"][:-1].contiguous(), "v_cache"),
    "k-cache-3d": ("k_cache", lambda a: a["k_cache"][0], "k_cache must be"),
    "cache-not-contiguous": (
        "k_cache",
        lambda a: torch.zeros(*a["k_cache"].shape[:-1], 16)[..., ::2],
        "contiguous",
    ),
    "block-table-int64": ("block_table", lambda a: a["block_table"].long(), "block_table"),
    "seq-lens-length": ("seq_lens", lambda a: a["seq_lens"][:1], "seq_lens"),
    "seq-lens-int64": ("seq_lens", lambda a: a["seq_lens"].long(), "seq_lens"),
    "query-start-loc-length": ("query_start_loc", lambda a: a["query_start_loc"][:2], "query_start_loc"),
    "query-start-loc-end": (
        "query_start_loc",
        lambda a: torch.tensor([0, 6, 6], dtype=torch.int32),
        "num_tokens",
    ),
    "query-longer-than-context": (
        "seq_lens",
        lambda a: torch.tensor([5, 9], dtype=torch.int32),
        "query length 6",
    ),
    "context-beyond-block-table": (
        "seq_lens",
        lambda a: torch.tensor([6, 100], dtype=torch.int32),
        "capacity",
    ),
    "window-zero": ("sliding_window", lambda a: 0, "sliding_window"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS.values()), ids=list(BAD_ARGS))
def test_bad_arguments_raise(case: tuple) -> None:
    name, make_bad, message = case
    args = _valid_args()
    args[name] = make_bad(args)
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)  # type: ignore[arg-type]


def test_valid_arguments_pass() -> None:
    """The baseline of test_bad_arguments_raise: unmodified, the same arguments are accepted."""
    assert paged_attention(**_valid_args()).shape == (7, 4, 8)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "slots", "message"),
    [
        (torch.randn(3, 2, 4), torch.tensor([0, 1, 2]), "key must be"),
        (torch.randn(3, 2, 8), torch.tensor([0, 1, 2], dtype=torch.int32), "slot_mapping"),
        (torch.randn(3, 2, 8), torch.tensor([0, 1]), "slot_mapping"),
    ],
)
def test_store_kv_bad_arguments_raise(key: torch.Tensor, slots: torch.Tensor, message: str) -> None:
    cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match=message):
        store_kv(key, key, cache, cache.clone(), slots)
