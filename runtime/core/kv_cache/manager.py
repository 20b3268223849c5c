"""Per-request block tables over the block pool: prefix-cache lookup, slot allocation, freeing.

The scheduler asks two questions per request and step: which leading blocks of its tokens are
already cached (`get_computed_blocks`, on admission) and whether the blocks for this step's
tokens can be had (`allocate_slots`, all-or-nothing). Pure Python: never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvasir.runtime.core.kv_cache.block_hash import extend_block_hashes
from kvasir.runtime.core.kv_cache.block_pool import Block, BlockPool, IntegrityError
from kvasir.runtime.core.kv_cache.events import KVEventLog
from kvasir.runtime.core.request import Request


@dataclass(slots=True)
class _BlockTable:
    """The blocks one request holds, in token order, and how many of them are registered."""

    blocks: list[Block] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # mirrors `blocks`; copied out every step
    # Leading full blocks already offered to the prefix cache (hits, or registered at allocation).
    num_cached: int = 0


class KVCacheManager:
    """Maps requests to KV blocks; the scheduler's only view of the cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        events: KVEventLog | None = None,
    ) -> None:
        """`events`: where blocks entering and leaving the prefix cache are logged (KV events)."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.events = events
        self.pool = BlockPool(num_blocks, enable_prefix_caching, on_evict=events.removed if events else None)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Blocks a new admission must leave free, so running requests can still grow next step.
        self.watermark_blocks = int(watermark * num_blocks)
        self._tables: dict[str, _BlockTable] = {}
        # Prefix-cache effectiveness in tokens, counted once per admission (exported as counters).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1."""
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest run of cached blocks that prefixes the request's tokens, and its token count.

        At least one token is always left to compute: the last token must run to yield logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_key)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[Block] = (),
        is_new_admission: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make the request hold blocks for its computed tokens, `computed_blocks` and this step's.

        `num_lookahead_tokens` more slots follow the known tokens: speculative decoding's draft
        tokens, verified this step, and the positions a drafter writes while proposing the next
        ones. They are never offered to the prefix cache (their tokens are not known yet), and a
        rejected draft's slot is simply overwritten by the token that later takes its position.

        All or nothing: returns False and changes nothing if the pool is short. A new admission
        must also leave the watermark free while other requests hold blocks.
        """
        block_size = self.block_size
        table = self._tables.get(request.request_id)
        num_held = len(table.blocks) if table is not None else 0
        if (computed_blocks or is_new_admission) and num_held:
            raise ValueError(f"{request.request_id}: admitted while still holding {num_held} blocks")
        num_computed = request.num_computed_tokens + len(computed_blocks) * block_size
        num_tokens = num_computed + num_new_tokens
        if num_new_tokens < 0 or num_tokens > len(request.all_token_ids):
            raise ValueError(
                f"{request.request_id}: cannot schedule tokens [{num_computed}, {num_tokens}) "
                f"of a request with {request.num_tokens} tokens"
            )
        if num_lookahead_tokens < 0:
            raise ValueError(
                f"{request.request_id}: num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}"
            )
        num_slots = num_tokens + num_lookahead_tokens
        num_new_blocks = max(0, -(-num_slots // block_size) - num_held - len(computed_blocks))
        if num_new_blocks or computed_blocks:  # most decode steps fit the last block: no check
            # A hit on a block nobody holds takes it out of the free queue: it costs a block too.
            num_revived = sum(1 for block in computed_blocks if block.ref_count == 0)
            # The watermark protects running requests' growth; with none running there is nothing
            # to protect, and reserving anyway could keep a request that fits waiting forever.
            reserve = self.watermark_blocks if is_new_admission and self._tables else 0
            if num_new_blocks + num_revived > self.pool.num_free_blocks - reserve:
                return False

        if table is None:
            table = self._tables[request.request_id] = _BlockTable()
        if computed_blocks:
            # Touch before allocating: allocation pops free blocks and could evict these hits.
            self.pool.touch(computed_blocks)
            table.blocks.extend(computed_blocks)
            table.block_ids.extend(block.block_id for block in computed_blocks)
            table.num_cached = len(computed_blocks)
        if num_new_blocks:
            new_blocks = self.pool.allocate(num_new_blocks)
            table.blocks.extend(new_blocks)
            table.block_ids.extend(block.block_id for block in new_blocks)
        if self.enable_prefix_caching:
            if num_tokens // block_size > table.num_cached:
                self._cache_full_blocks(request, table, num_tokens // block_size)
            if is_new_admission:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed_blocks) * block_size
        return True

    def _cache_full_blocks(self, request: Request, table: _BlockTable, num_full_blocks: int) -> None:
        # Registered now, before the model runs: the step writes their KV before any attention
        # reads it, so a request admitted later in this same step (an n > 1 sibling) can share them.
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_key)
        run_start = table.num_cached  # the current run of newly cached blocks, for the event log
        for index in range(table.num_cached, num_full_blocks):
            if not self.pool.cache_full_block(table.blocks[index], request.block_hashes[index]):
                self._log_stored(request, run_start, index)
                run_start = index + 1
        self._log_stored(request, run_start, num_full_blocks)
        table.num_cached = num_full_blocks

    def _log_stored(self, request: Request, start: int, end: int) -> None:
        if self.events is not None and end > start:
            self.events.stored(
                request.block_hashes,
                request.all_token_ids,
                start,
                end - start,
                lora=request.lora,
                cache_salt=request.cache_salt,
            )

    def free(self, request: Request) -> None:
        """Release the request's blocks (finished, aborted or preempted); unknown requests are a no-op."""
        table = self._tables.pop(request.request_id, None)
        if table is not None:
            # Last block first, so the request's tail is evicted before its (more shareable) prefix.
            self.pool.free(reversed(table.blocks))

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (physical block ids in token order)."""
        table = self._tables.get(request_id)
        return list(table.block_ids) if table is not None else []

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes; returns how many blocks were uncached."""
        if self.events is not None:
            self.events.cleared()
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Raise IntegrityError unless the pool is consistent and ref counts equal the holders."""
        self.pool.check_integrity()
        holders = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            if [block.block_id for block in table.blocks] != table.block_ids:
                raise IntegrityError(f"{request_id}: block ids out of sync with its blocks")
            if len(set(table.block_ids)) != len(table.block_ids):
                raise IntegrityError(f"{request_id}: holds a block twice")
            if table.num_cached > len(table.blocks):
                raise IntegrityError(f"{request_id}: {table.num_cached} cached of {len(table.blocks)}")
            for block in table.blocks:
                if block is not self.pool.blocks[block.block_id]:
                    raise IntegrityError(f"{request_id}: holds a foreign {block}")
                if block.ref_count <= 0:
                    raise IntegrityError(f"{request_id}: holds unreferenced {block}")
                holders[block.block_id] += 1
        for block in self.pool.blocks:
            if block.ref_count != holders[block.block_id]:
                raise IntegrityError(f"{block} is held by {holders[block.block_id]} requests")
