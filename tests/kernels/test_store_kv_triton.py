"""The Triton `store_kv` against the torch reference: scattered slots, padding slots, strided inputs."""

from __future__ import annotations

import pytest
import torch

from kvasir.kernels.reference import attention as reference
from kvasir.kernels.triton_ops.store_kv import store_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def caches(dtype: torch.dtype, num_blocks: int = 6, block_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (num_blocks, block_size, 2, 16)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_reference_with_padding_slots(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    # A fused qkv projection's output: K and V are strided views, not contiguous tensors.
    qkv = torch.randn(9, 3 * 2 * 16, generator=g).to(dtype)
    key = qkv[:, 32:64].view(9, 2, 16)
    value = qkv[:, 64:].view(9, 2, 16)
    slots = torch.tensor([3, 17, -1, 0, 23, 8, -1, 9, 4], dtype=torch.int64)
    expected_k, expected_v = caches(dtype)
    reference.store_kv(key, value, expected_k, expected_v, slots)
    k_cache, v_cache = (c.to(DEVICE) for c in caches(dtype))
    store_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    torch.testing.assert_close(k_cache.cpu(), expected_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.cpu(), expected_v, atol=0, rtol=0)


def test_padding_slots_write_nothing() -> None:
    k_cache, v_cache = (c.to(DEVICE) for c in caches(torch.float32))
    before = k_cache.clone(), v_cache.clone()
    key = torch.ones(3, 2, 16, device=DEVICE)
    store_kv(key, key, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_no_tokens_is_a_no_op() -> None:
    k_cache, v_cache = caches(torch.float32)
    empty = torch.zeros(0, 2, 16)
    store_kv(empty, empty, k_cache, v_cache, torch.zeros(0, dtype=torch.int64))


@pytest.mark.parametrize(
    ("key_shape", "slot_dtype", "message"),
    [((3, 4, 16), torch.int64, "key must be"), ((3, 2, 16), torch.int32, "slot_mapping must be int64")],
)
def test_rejects_bad_arguments(key_shape: tuple[int, ...], slot_dtype: torch.dtype, message: str) -> None:
    k_cache, v_cache = caches(torch.float32)
    key = torch.zeros(key_shape)
    with pytest.raises(ValueError, match=message):
        store_kv(key, key, k_cache, v_cache, torch.zeros(3, dtype=slot_dtype))


def test_rejects_integer_caches() -> None:
    k_cache = torch.zeros(2, 4, 2, 16, dtype=torch.int8)
    key = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="KV cache must be float32, float16, bfloat16 or float8_e4m3fn"):
        store_kv(key, key, k_cache, k_cache.clone(), torch.zeros(1, dtype=torch.int64))
