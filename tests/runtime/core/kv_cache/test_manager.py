"""KVCacheManager: block tables, prefix-cache hits and sharing, all-or-nothing allocation, sizing."""

from __future__ import annotations

import pytest

from kvasir.runtime.config import ModelConfig
from kvasir.runtime.core.kv_cache.block_pool import IntegrityError
from kvasir.runtime.core.kv_cache.manager import KVCacheManager
from kvasir.runtime.core.request import Request
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.worker.kv_budget import bytes_per_block, num_blocks_for_budget, num_blocks_for_tokens

BS = 4


def make_request(request_id: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, seed=0)


def admit(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> int:
    """Admit like the scheduler does; returns the number of prefix-cached tokens."""
    computed, num_cached = kv.get_computed_blocks(request)
    if num_tokens is None:
        num_tokens = request.num_tokens - num_cached
    assert kv.allocate_slots(request, num_tokens, computed, is_new_admission=True)
    request.num_computed_tokens = num_cached + num_tokens
    return num_cached


def test_allocation_covers_the_scheduled_tokens() -> None:
    kv = KVCacheManager(8, BS)
    request = make_request("a", list(range(10)))
    assert admit(kv, request) == 0
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5 and kv.usage == pytest.approx(3 / 8)
    # Decoding: token 11 still fits block 2, token 13 needs a fourth block.
    request.append_output_token(100, now=0.0)
    assert kv.allocate_slots(request, 1)
    assert kv.block_ids("a") == [0, 1, 2]
    request.num_computed_tokens += 1
    request.append_output_token(101, now=0.0)
    request.num_computed_tokens += 1
    request.append_output_token(102, now=0.0)
    assert kv.allocate_slots(request, 1)
    assert kv.block_ids("a") == [0, 1, 2, 3]
    kv.check_integrity()
    kv.free(request)
    assert kv.num_free_blocks == 8 and kv.block_ids("a") == []
    kv.check_integrity()


def test_block_ids_is_a_copy() -> None:
    kv = KVCacheManager(4, BS)
    admit(kv, make_request("a", [1, 2, 3]))
    kv.block_ids("a").append(99)
    assert kv.block_ids("a") == [0]


def test_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(4, BS, watermark=0.0)
    admit(kv, make_request("a", list(range(8))))
    big = make_request("b", list(range(100, 112)))
    assert not kv.allocate_slots(big, 12, is_new_admission=True)
    assert kv.num_free_blocks == 2 and kv.block_ids("b") == []
    assert kv.allocate_slots(big, 8, is_new_admission=True)
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_cannot_schedule_unknown_tokens() -> None:
    kv = KVCacheManager(4, BS)
    with pytest.raises(ValueError, match="cannot schedule tokens"):
        kv.allocate_slots(make_request("a", [1, 2, 3]), 4)


def test_watermark_reserves_blocks_for_running_requests_only() -> None:
    kv = KVCacheManager(10, BS, watermark=0.2)  # 2 blocks reserved
    first = make_request("a", list(range(40)))
    # With nobody holding blocks there is nothing to protect: the whole pool is usable.
    assert kv.allocate_slots(first, 32, is_new_admission=True)
    assert kv.num_free_blocks == 2
    second = make_request("b", list(range(100, 104)))
    assert not kv.allocate_slots(second, 4, is_new_admission=True)
    # A running request may grow into the watermark.
    first.num_computed_tokens = 32
    assert kv.allocate_slots(first, 8)
    kv.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(10))
    a, b = make_request("a", prompt), make_request("b", prompt)
    assert admit(kv, a) == 0
    # Registered at allocation: b, admitted in the same step, already shares a's full blocks.
    assert admit(kv, b) == 8
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.block_ids("b")[2] != kv.block_ids("a")[2]
    shared = kv.pool.blocks[kv.block_ids("a")[0]]
    assert shared.ref_count == 2
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
    kv.check_integrity()
    kv.free(a)
    assert shared.ref_count == 1
    kv.free(b)
    assert kv.num_free_blocks == 16
    kv.check_integrity()


def test_hit_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(8))  # exactly two blocks
    a, b = make_request("a", prompt), make_request("b", prompt)
    admit(kv, a)
    computed, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 4 and len(computed) == 1  # (8 - 1) // 4 blocks at most
    assert kv.allocate_slots(b, 4, computed, is_new_admission=True)
    # b computes its own copy of the second block; the cached copy stays a's.
    assert kv.block_ids("b")[1] != kv.block_ids("a")[1]
    assert kv.pool.blocks[kv.block_ids("b")[1]].block_hash is None
    kv.check_integrity()


def test_hit_stops_at_the_first_differing_block() -> None:
    kv = KVCacheManager(16, BS)
    admit(kv, make_request("a", list(range(12))))
    b = make_request("b", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])
    computed, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 4 and [block.block_id for block in computed] == kv.block_ids("a")[:1]


def test_same_block_under_a_different_parent_does_not_match() -> None:
    kv = KVCacheManager(16, BS)
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Block 1 has the same tokens as a's block 1, but block 0 differs: no hit at all.
    b = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert kv.get_computed_blocks(b) == ([], 0)


def test_chunk_registers_only_blocks_it_fills() -> None:
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(12)))
    admit(kv, a, num_tokens=6)  # first chunk: block 0 full, block 1 half
    b = make_request("b", list(range(12)))
    assert kv.get_computed_blocks(b)[1] == 4
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 6)  # second chunk fills blocks 1 and 2
    assert kv.get_computed_blocks(b)[1] == 8  # capped: one token left to compute
    kv.check_integrity()


def test_freed_prefix_is_reused_until_evicted_last_block_first() -> None:
    kv = KVCacheManager(4, BS, watermark=0.0)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    a_blocks = kv.block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == 4
    # a's blocks stay cached while free; a follow-up with the same prefix revives them.
    b = make_request("b", [*range(12), 50])
    computed, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 12 and [block.block_id for block in computed] == a_blocks
    # Reviving 3 free blocks and allocating 1 more needs 4 free blocks: exactly enough.
    assert kv.allocate_slots(b, 1, computed, is_new_admission=True)
    assert kv.num_free_blocks == 0
    kv.free(b)
    # A newcomer evicts b's tail first (the block with token 50, then a's last block).
    c = make_request("c", list(range(200, 208)))
    admit(kv, c)
    assert kv.block_ids("c") == [3, a_blocks[2]]
    assert kv.get_computed_blocks(make_request("d", [*range(12), 1]))[1] == 8
    kv.check_integrity()


def test_reviving_free_blocks_counts_against_the_free_pool() -> None:
    kv = KVCacheManager(3, BS, watermark=0.0)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    holder = make_request("h", [70])
    admit(kv, holder)  # takes the never-used block 2
    b = make_request("b", [*range(8), 1, 2, 3, 4, 5])
    computed, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    # Reviving 2 blocks + 2 new blocks > 2 free blocks: refused, nothing touched.
    assert not kv.allocate_slots(b, 5, computed, is_new_admission=True)
    assert all(block.ref_count == 0 for block in computed)
    assert kv.num_free_blocks == 2
    kv.check_integrity()


def test_prefix_caching_off() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    admit(kv, make_request("a", list(range(9))))
    b = make_request("b", list(range(9)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert b.block_hashes == []
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    kv.check_integrity()


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    kv.check_integrity()


def test_check_integrity_compares_ref_counts_with_holders() -> None:
    kv = KVCacheManager(8, BS)
    admit(kv, make_request("a", list(range(9))))
    kv.check_integrity()
    kv.pool.blocks[kv.block_ids("a")[0]].ref_count += 1
    with pytest.raises(IntegrityError, match="held by 1 requests"):
        kv.check_integrity()


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, 0)
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(8, 16, watermark=1.0)
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    with pytest.raises(ValueError, match="still holding"):
        kv.allocate_slots(a, 0, is_new_admission=True)


# ---- sizing --------------------------------------------------------------------------------


def test_num_blocks_for_budget() -> None:
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )
    # 2 (K, V) x 2 layers x 2 heads x 16 dims x 2 bytes x 16 tokens = 4096 bytes per block.
    assert bytes_per_block(config.kv_elements_per_token, 2, 16) == 4096
    assert num_blocks_for_budget(config.kv_elements_per_token, 2, 16, 10 * 4096 + 4095) == 10
    with pytest.raises(ValueError, match="holds no block of 4096 bytes"):
        num_blocks_for_budget(config.kv_elements_per_token, 2, 16, 4095)
    with pytest.raises(ValueError, match="dtype_size"):
        bytes_per_block(128, 0, 16)
    assert num_blocks_for_tokens(33, 16) == 3 and num_blocks_for_tokens(32, 16) == 2
