"""BlockPool and FreeBlockQueue: allocation, LRU eviction of cached blocks, integrity checks."""

from __future__ import annotations

import pytest

from kvasir.runtime.core.kv_cache.block_hash import ROOT_HASH, extend_block_hashes, hash_block_tokens
from kvasir.runtime.core.kv_cache.block_pool import Block, BlockPool, FreeBlockQueue, IntegrityError


def ids(blocks: list[Block]) -> list[int]:
    return [block.block_id for block in blocks]


def digest(n: int) -> bytes:
    return hash_block_tokens(ROOT_HASH, [n])


# ---- FreeBlockQueue ------------------------------------------------------------------------


def test_free_queue_popleft_append_and_remove_from_the_middle() -> None:
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(list(queue)) == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert ids(list(queue)) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    queue.append(blocks[2])
    assert ids(queue.check_links()) == [1, 3, 4, 0, 2]
    assert len(queue) == 5
    assert blocks[0].next_free is blocks[2] and blocks[2].prev_free is blocks[0]


def test_free_queue_empty_and_misuse() -> None:
    block = Block(0)
    queue = FreeBlockQueue([block])
    assert queue.popleft() is block
    assert block.prev_free is None and block.next_free is None
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(IntegrityError, match="not in the free queue"):
        queue.remove(block)
    queue.append(block)
    with pytest.raises(IntegrityError, match="already in the free queue"):
        queue.append(block)


def test_free_queue_detects_broken_links() -> None:
    blocks = [Block(i) for i in range(3)]
    queue = FreeBlockQueue(blocks)
    blocks[2].prev_free = blocks[0]
    with pytest.raises(IntegrityError, match="prev_free"):
        queue.check_links()


# ---- BlockPool -----------------------------------------------------------------------------


def test_allocate_takes_from_the_head_and_free_returns_cached_blocks_to_the_tail() -> None:
    pool = BlockPool(4)
    first = pool.allocate(2)
    assert ids(first) == [0, 1]
    assert all(block.ref_count == 1 for block in first)
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(0.5)
    for n, block in enumerate(first):
        pool.cache_full_block(block, digest(n))
    pool.free(reversed(first))
    assert ids(list(pool.free_queue)) == [2, 3, 1, 0]
    assert pool.usage == 0.0
    pool.check_integrity()


def test_freed_uncached_blocks_are_reused_before_never_used_and_cached_ones() -> None:
    # On a CPU an unwritten block is not resident yet: reusing a freed block that holds nothing
    # reusable keeps the resident cache at what requests hold at once, and evicts no prefix.
    pool = BlockPool(5)
    cached, private, partial = pool.allocate(3)
    pool.cache_full_block(cached, digest(0))
    pool.free([partial, private, cached])  # last-first, as a finished request frees
    assert ids(list(pool.free_queue)) == [1, 2, 3, 4, 0]
    again = pool.allocate(3)
    assert ids(again) == [1, 2, 3]
    assert pool.get_cached_block(digest(0)) is cached
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2
    pool.check_integrity()


def test_invalid_pool_size() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_double_free_is_an_integrity_error() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(IntegrityError, match="freed more times"):
        pool.free([block])


def test_freed_cached_block_keeps_its_hash_until_evicted_in_lru_order() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for n, block in enumerate((a, b, c)):
        assert pool.cache_full_block(block, digest(n))
    pool.free([b, a, c])  # free order is eviction order
    assert pool.num_free_blocks == 3
    assert pool.get_cached_block(digest(0)) is a  # still reusable while free
    pool.check_integrity()

    (first,) = pool.allocate(1)
    assert first is b and b.block_hash is None
    assert pool.get_cached_block(digest(1)) is None
    assert pool.get_cached_block(digest(0)) is a and pool.get_cached_block(digest(2)) is c
    (second,) = pool.allocate(1)
    assert second is a and pool.get_cached_block(digest(0)) is None
    pool.check_integrity()


def test_touch_revives_a_free_cached_block_and_shares_a_held_one() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_full_block(a, digest(0))
    pool.free([a])
    assert a.ref_count == 0 and pool.num_free_blocks == 2
    pool.touch([a])  # a prefix hit on a free block takes it out of the queue
    assert a.ref_count == 1 and pool.num_free_blocks == 1
    pool.touch([a, b])  # a hit on held blocks only adds references
    assert a.ref_count == 2 and b.ref_count == 2
    pool.check_integrity()
    # The revived block is no longer an eviction candidate.
    (c,) = pool.allocate(1)
    assert c.block_id == 2 and pool.get_cached_block(digest(0)) is a
    pool.free([a, a, b, b, c])
    assert pool.num_free_blocks == 3
    pool.check_integrity()


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_full_block(a, digest(0))
    assert not pool.cache_full_block(b, digest(0))
    assert b.block_hash is None and pool.get_cached_block(digest(0)) is a
    with pytest.raises(IntegrityError, match="already cached"):
        pool.cache_full_block(a, digest(1))
    pool.check_integrity()


def test_prefix_caching_off_caches_nothing() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_full_block(a, digest(0))
    assert pool.get_cached_block(digest(0)) is None
    pool.check_integrity()


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_full_block(a, digest(0))
    pool.cache_full_block(b, digest(1))
    pool.free([a])
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(digest(0)) is None and a.block_hash is None and b.block_hash is None
    pool.check_integrity()


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda pool: setattr(pool.blocks[3], "ref_count", -1), id="negative-ref"),
        pytest.param(lambda pool: setattr(pool.blocks[0], "ref_count", 1), id="held-but-queued"),
        pytest.param(lambda pool: setattr(pool.blocks[2], "ref_count", 0), id="unheld-not-queued"),
        pytest.param(lambda pool: setattr(pool.blocks[2], "block_hash", digest(9)), id="orphan-hash"),
        pytest.param(lambda pool: setattr(pool.blocks[3], "block_hash", digest(1)), id="hash-twice"),
        pytest.param(lambda pool: setattr(pool.free_queue, "_len", 1), id="queue-length"),
    ],
)
def test_check_integrity_catches_corruption(corrupt) -> None:
    pool = BlockPool(4)
    held = pool.allocate(2)  # blocks 0, 1 held; 2, 3 free
    pool.cache_full_block(held[0], digest(0))
    pool.cache_full_block(held[1], digest(1))
    pool.free([held[0]])  # 0 is free and cached
    held += pool.allocate(1)  # takes block 2: 0 free+cached, 1 held+cached, 2 held, 3 free
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(IntegrityError):
        pool.check_integrity()


# ---- block hashes --------------------------------------------------------------------------


def test_block_hash_chains_the_parent() -> None:
    block = [5, 6, 7, 8]
    first = hash_block_tokens(ROOT_HASH, block)
    assert first == hash_block_tokens(ROOT_HASH, list(block))
    # Same tokens under a different parent (another prompt's prefix) must not match.
    assert hash_block_tokens(first, block) != first
    assert hash_block_tokens(hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]), block) != hash_block_tokens(
        hash_block_tokens(ROOT_HASH, [1, 2, 3, 9]), block
    )
    assert hash_block_tokens(ROOT_HASH, block, b"lora-a") != hash_block_tokens(ROOT_HASH, block, b"lora-b")
    assert len(first) == 32


def test_extend_block_hashes_is_incremental_and_covers_only_full_blocks() -> None:
    tokens = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 4)
    assert len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hash_block_tokens(ROOT_HASH, [0, 1, 2, 3]), [4, 5, 6, 7])
    kept = list(hashes)
    extend_block_hashes(hashes, [*tokens, 10, 11], 4)
    assert hashes[:2] == kept and len(hashes) == 3
