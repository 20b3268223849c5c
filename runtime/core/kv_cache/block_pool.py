"""The physical KV-cache blocks: reference counts, an LRU free queue and the prefix-cache hash map.

A block whose last holder lets go keeps its hash and joins the TAIL of the free queue, so its KV
stays reusable by a later prompt with the same prefix until allocation reaches it at the HEAD.
A freed block with no hash holds nothing reusable: it joins the HEAD, to be handed out before any
never-used block. On a CPU the cache is left unwritten until used (its pages become resident as
tokens fill them), so reusing such blocks keeps the resident cache near what requests hold at once
instead of letting allocation walk through every block; the prefix cache loses nothing by it.
The free queue therefore holds, head to tail: freed uncached blocks (the most recent first),
never-used blocks, then evictable cached ones in LRU order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator


class IntegrityError(Exception):
    """Block accounting is inconsistent (a bug in the caller or in this module, never user input)."""


class Block:
    """One physical block of `block_size` token slots; the free-queue links live on the block."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix cache
        # Neighbours in the free queue; both None exactly when the block is not in it.
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}…"
        return f"Block({self.block_id}, ref={self.ref_count}{cached})"


class FreeBlockQueue:
    """Intrusive doubly linked list of blocks: O(1) popleft, append and removal from the middle.

    A deque cannot remove from the middle in O(1), which a prefix hit on a free cached block needs.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        # Sentinels at both ends remove every empty-list special case from the link updates.
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> Block:
        """Remove and return the least recently freed block."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("popleft from an empty free block queue")
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        """Add a block at the tail (the most recently freed end, the last to be allocated)."""
        last = self._tail.prev_free
        assert last is not None  # the sentinel links are never None; tells the type checker
        self._link(block, last, self._tail)

    def appendleft(self, block: Block) -> None:
        """Add a block at the head (the next to be allocated)."""
        first = self._head.next_free
        assert first is not None  # the sentinel links are never None; tells the type checker
        self._link(block, self._head, first)

    def _link(self, block: Block, prev: Block, nxt: Block) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise IntegrityError(f"{block} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def remove(self, block: Block) -> None:
        """Unlink a block from wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise IntegrityError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[Block]:
        """Blocks from head to tail; stops after len+1 steps so a corrupted cycle cannot hang."""
        block = self._head.next_free
        for _ in range(self._len + 1):
            if block is None or block is self._tail:
                return
            yield block
            block = block.next_free

    def check_links(self) -> list[Block]:
        """The blocks head to tail; raises IntegrityError if links or length are inconsistent."""
        blocks: list[Block] = []
        prev = self._head
        for block in self:
            if block.prev_free is not prev:
                raise IntegrityError(f"{block}.prev_free is {block.prev_free}, expected {prev}")
            blocks.append(block)
            prev = block
        if prev.next_free is not self._tail or self._tail.prev_free is not prev:
            raise IntegrityError(f"the free queue does not end at its tail after {len(blocks)} blocks")
        if len(blocks) != self._len:
            raise IntegrityError(f"the free queue links {len(blocks)} blocks but counts {self._len}")
        return blocks


class BlockPool:
    """All blocks of the KV cache; hands them out, takes them back and keeps the prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        on_evict: Callable[[bytes], None] | None = None,
    ) -> None:
        """`on_evict(hash)` is told of each cached block whose hash allocation drops (KV events)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[bytes, Block] = {}
        self._on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds: never used, or cached and evictable."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (evictable cached blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` blocks from the LRU end, evicting their cached hashes; ref_count = 1."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self.free_queue)} are free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self._on_evict is not None:
                    self._on_evict(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; the unreferenced cached ones join the queue tail in
        this order, the uncached ones its head (reused first: see the module's docstring).

        Pass a request's blocks last-first: its tail blocks are the least likely to be shared,
        so they should be evicted before its prefix.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise IntegrityError(f"{block} freed more times than it was allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (a prefix hit), taking free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        """The block holding the KV of this hash's prefix, or None."""
        return self._cached.get(block_hash)

    def cache_full_block(self, block: Block, block_hash: bytes) -> bool:
        """Register a full, held block under its hash; False if caching is off or the hash is taken."""
        if not self.enable_prefix_caching:
            return False
        if block.ref_count <= 0:
            raise IntegrityError(f"only a held block can be cached, got {block}")
        if block.block_hash is not None:
            raise IntegrityError(f"{block} is already cached")
        # Two requests can compute the same block independently (e.g. the block a prefix hit must
        # leave uncomputed); the first copy stays the cached one, the other is just a private block.
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after a weight update); returns how many were dropped."""
        for block in self._cached.values():
            block.block_hash = None
        dropped = len(self._cached)
        self._cached.clear()
        return dropped

    def check_integrity(self) -> None:
        """Raise IntegrityError unless ref counts, the free queue and the hash map agree."""
        queued = self.free_queue.check_links()
        queued_ids = {block.block_id for block in queued}
        if len(queued_ids) != len(queued):
            raise IntegrityError("a block appears in the free queue more than once")
        for block in queued:
            if block is not self.blocks[block.block_id]:
                raise IntegrityError(f"the free queue holds a foreign {block}")
        for block in self.blocks:
            if block.ref_count < 0:
                raise IntegrityError(f"{block} has a negative ref count")
            in_queue = block.block_id in queued_ids
            if block.ref_count == 0 and not in_queue:
                raise IntegrityError(f"{block} is unreferenced but not in the free queue")
            if block.ref_count > 0 and in_queue:
                raise IntegrityError(f"{block} is referenced but in the free queue")
            if not in_queue and (block.prev_free is not None or block.next_free is not None):
                raise IntegrityError(f"{block} is out of the free queue but still linked")
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise IntegrityError(f"{block} carries a hash the prefix cache maps elsewhere")
        if not self.enable_prefix_caching and self._cached:
            raise IntegrityError("prefix caching is off but blocks are cached")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise IntegrityError(f"the prefix cache maps a hash to {block}, which carries another")
            if block is not self.blocks[block.block_id]:
                raise IntegrityError(f"the prefix cache maps a hash to a foreign {block}")
