"""The FP8 (e4m3, per-tensor scale) KV cache: store and attention, Triton against the torch reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvasir.kernels.kv_quant import FP8_DTYPE, FP8_MAX, quantize_fp8
from kvasir.kernels.reference import attention as reference
from kvasir.kernels.triton_ops import attention as triton_attention
from kvasir.kernels.triton_ops.decode_attention import decode_attention
from kvasir.kernels.triton_ops.store_kv import store_kv as triton_store_kv
from tests.kernels.paged_batches import CASES, PagedBatch, make_batch, naive_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K_SCALE, V_SCALE = 0.05, 0.02


def fp8_batch(
    requests: list[tuple[int, int]], dtype: torch.dtype = torch.float32, seed: int = 0
) -> PagedBatch:
    """`make_batch`, with its caches quantized to fp8 and the dense K/V replaced by what they hold."""
    batch = make_batch(
        requests, num_heads=8, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype, seed=seed
    )

    def roundtrip(x: torch.Tensor, scale: float) -> torch.Tensor:
        return quantize_fp8(x, scale).float() * scale

    return dataclasses.replace(
        batch,
        k_cache=quantize_fp8(batch.k_cache, K_SCALE),
        v_cache=quantize_fp8(batch.v_cache, V_SCALE),
        dense_k=[roundtrip(k, K_SCALE) for k in batch.dense_k],
        dense_v=[roundtrip(v, V_SCALE) for v in batch.dense_v],
    )


def test_quantize_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([0.0, 1.0, -3.0, 1e6, -1e6])
    q = quantize_fp8(x, 0.5)
    assert q.dtype == FP8_DTYPE
    assert q.float().tolist() == [0.0, 2.0, -6.0, FP8_MAX, -FP8_MAX]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_writes_the_quantized_values_and_skips_padding(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    key = (torch.randn(5, 2, 16, generator=g) * 10).to(dtype)
    value = (torch.randn(5, 2, 16, generator=g) * 10).to(dtype)
    slots = torch.tensor([6, -1, 0, 13, 2], dtype=torch.int64)
    shape = (4, 4, 2, 16)
    expected_k = torch.zeros(shape, dtype=FP8_DTYPE)
    expected_v = torch.zeros(shape, dtype=FP8_DTYPE)
    reference.store_kv(key, value, expected_k, expected_v, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    flat = expected_k.view(-1, 2, 16)
    assert torch.equal(flat[6].view(torch.uint8), quantize_fp8(key[0], K_SCALE).view(torch.uint8))
    assert not flat[1].float().any()  # the -1 token was not written anywhere else
    k_cache = torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE)
    v_cache = torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE)
    triton_store_kv(
        key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE), k_scale=K_SCALE, v_scale=V_SCALE
    )
    for ours, theirs in ((k_cache.cpu(), expected_k), (v_cache.cpu(), expected_v)):
        if DEVICE.type == "cuda":  # the hardware conversion: the same bytes
            assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
        else:
            assert_interpreter_rounding(ours.float(), theirs.float())


def assert_interpreter_rounding(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Triton's interpreter converts to e4m3 slightly differently from torch (and the GPU): a
    halfway case may round the other way (the neighbouring value), and a mantissa that rounds up
    is not carried into the exponent, so a value just below 2^e comes out as 2^(e-1). Anything
    else is a bug in the kernel."""
    codes = ours.to(FP8_DTYPE).view(torch.uint8).int() - theirs.to(FP8_DTYPE).view(torch.uint8).int()
    neighbour = codes.abs() <= 1
    power_of_two = theirs.abs() == torch.exp2(torch.log2(theirs.abs()).round())
    no_carry = power_of_two & (ours == theirs / 2)
    assert (neighbour | no_carry).all()
    assert (ours == theirs).float().mean() > 0.9


@pytest.mark.parametrize(
    "requests",
    [CASES["mixed"], CASES["prompts-only"], CASES["decodes-only"]],
    ids=["mixed", "prompts", "decodes"],
)
def test_attention_over_an_fp8_cache_matches_reference_and_definition(
    requests: list[tuple[int, int]],
) -> None:
    batch = fp8_batch(requests)
    args = (
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        0.25,
    )
    ref = reference.paged_attention(*args, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(ref.double(), naive_attention(batch, 0.25), atol=2e-5, rtol=2e-5)
    out = triton_attention.paged_attention(
        *(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in args), k_scale=K_SCALE, v_scale=V_SCALE
    )
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_split_k_decode_over_an_fp8_cache(num_splits: int) -> None:
    batch = fp8_batch([(40, 1), (7, 1), (23, 1)], seed=5)
    out = torch.empty_like(batch.q, device=DEVICE)
    decode_attention(
        out, batch.q.to(DEVICE), batch.k_cache.to(DEVICE), batch.v_cache.to(DEVICE), batch.block_table.to(DEVICE),
        batch.seq_lens.to(DEVICE), batch.query_start_loc.to(DEVICE), 0.25, None, num_splits,
        k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu().double(), naive_attention(batch, 0.25), atol=2e-5, rtol=2e-5)


def test_bf16_queries_over_an_fp8_cache() -> None:
    batch = fp8_batch(CASES["mixed"], dtype=torch.bfloat16, seed=9)
    args = (
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        0.25,
    )
    out = triton_attention.paged_attention(
        *(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in args), k_scale=K_SCALE, v_scale=V_SCALE
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().double(), naive_attention(batch, 0.25), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    ("cache_dtype", "k_scale", "message"),
    [(torch.float32, 2.0, "apply only to an fp8 KV cache"), (FP8_DTYPE, -1.0, "k_scale must be a positive")],
)
def test_scales_are_checked(cache_dtype: torch.dtype, k_scale: float, message: str) -> None:
    cache = torch.zeros(2, 4, 2, 16, dtype=cache_dtype)
    key = torch.zeros(1, 2, 16)
    slots = torch.zeros(1, dtype=torch.int64)
    for store in (reference.store_kv, triton_store_kv):
        with pytest.raises(ValueError, match=message):
            store(key, key, cache, cache.clone(), slots, k_scale=k_scale)
