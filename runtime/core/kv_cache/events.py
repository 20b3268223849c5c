"""KV-cache events: which blocks entered and left the prefix cache, as the records vLLM publishes
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), for a subscriber that tracks every pod's
cache (llm-d's KV-cache indexer). Pure Python; the engine drains the log after each step and
hands it to the publisher.

The published block hash is vLLM's `sha256_cbor_64bit`, not Kvasir's own prefix-cache key: the
last 8 bytes (big-endian) of the SHA-256 of the canonical CBOR of `[parent, token_ids, extra]`,
chained from the root `sha256(cbor(hash_seed))`. `extra` is null for a base request without a
salt; else, as vLLM builds its extra keys, the LoRA adapter's name on every block and the
`cache_salt` on the first (`[name]`, `[name, salt]`, `[salt]`). That is what llm-d computes from a
prompt's tokens (and the adapter named in `lora_name`) to look blocks up, so a subscriber finds
Kvasir's blocks under the keys it expects. Kvasir's own key holds the adapter's weight digest, not
its name (docs/lora.md): the published hash is a routing hint, never what decides a cache hit."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvasir.runtime.lora.params import LoRARequest

_U8, _U16, _U32, _U64 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q")


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR head in its shortest form (RFC 8949 4.2.1, the canonical encoding)."""
    if value < 24:
        return bytes([major << 5 | value])
    if value < 1 << 8:
        return bytes([major << 5 | 24]) + _U8.pack(value)
    if value < 1 << 16:
        return bytes([major << 5 | 25]) + _U16.pack(value)
    if value < 1 << 32:
        return bytes([major << 5 | 26]) + _U32.pack(value)
    return bytes([major << 5 | 27]) + _U64.pack(value)


def _cbor_text(text: str) -> bytes:
    encoded = text.encode()
    return _cbor_head(3, len(encoded)) + encoded


def cbor_block_payload(parent: int, token_ids: Sequence[int], extra: Sequence[str] | None = None) -> bytes:
    """Canonical CBOR of `[parent, [token ids...], extra]`: extra null, or an array of text strings."""
    parts = [b"\x83", _cbor_head(0, parent), _cbor_head(4, len(token_ids))]
    parts.extend(_cbor_head(0, token) for token in token_ids)
    if extra is None:
        parts.append(b"\xf6")
    else:
        parts.append(_cbor_head(4, len(extra)))
        parts.extend(_cbor_text(key) for key in extra)
    return b"".join(parts)


def _low64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[24:], "big")


def root_hash(seed: str) -> int:
    """The parent of every first block: the hash of the seed, a CBOR text string."""
    return _low64(_cbor_text(seed))


def external_block_hash(parent: int, token_ids: Sequence[int], extra: Sequence[str] | None = None) -> int:
    return _low64(cbor_block_payload(parent, token_ids, extra))


def block_extra_keys(index: int, lora_name: str | None, cache_salt: str | None) -> tuple[str, ...] | None:
    """vLLM's extra keys of block `index` of a request: the adapter's name on every block, then the
    salt on the first one; None when there are none."""
    keys = () if lora_name is None else (lora_name,)
    if cache_salt is not None and index == 0:
        keys = (*keys, cache_salt)
    return keys or None


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None  # None: the first of them is a prompt's first block
    token_ids: tuple[int, ...]  # every token of the stored blocks, in order
    block_size: int
    lora_id: int | None = None  # the adapter's id (vLLM: deprecated, kept for old subscribers)
    lora_name: str | None = None  # the adapter's served name: llm-d keys the blocks by it
    # Per block, the extra keys its published hash includes (None: none for any block).
    extra_keys: tuple[tuple[str, ...] | None, ...] | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Events since the last `take()`; keeps the published hash of each cached block."""

    def __init__(self, block_size: int, hash_seed: str = "") -> None:
        self.block_size = block_size
        self.root = root_hash(hash_seed)
        self._published: dict[bytes, int] = {}  # Kvasir's block hash -> the published one
        self._events: list[KVCacheEvent] = []

    def stored(
        self,
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        first: int,
        count: int,
        *,
        lora: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Blocks `first .. first+count-1` of a request (its Kvasir hashes and all its tokens, its
        adapter and salt) entered the cache. Runs of one call become one BlockStored, as vLLM
        sends them."""
        if count <= 0:
            return
        size = self.block_size
        lora_name = None if lora is None else lora.name
        parent = self.root if first == 0 else self._published.get(block_hashes[first - 1])
        if parent is None:  # the parent left the cache meanwhile: chain again from the root
            parent = self.root
            for index in range(first):
                extra = block_extra_keys(index, lora_name, cache_salt)
                parent = external_block_hash(parent, token_ids[index * size : (index + 1) * size], extra)
        parent_out = None if first == 0 else parent
        hashes = []
        extras = []
        for index in range(first, first + count):
            extra = block_extra_keys(index, lora_name, cache_salt)
            parent = external_block_hash(parent, token_ids[index * size : (index + 1) * size], extra)
            self._published[block_hashes[index]] = parent
            hashes.append(parent)
            extras.append(extra)
        tokens = tuple(token_ids[first * size : (first + count) * size])
        extra_keys = tuple(extras) if any(extra is not None for extra in extras) else None
        self._events.append(
            BlockStored(
                tuple(hashes),
                parent_out,
                tokens,
                size,
                lora_id=None if lora is None else lora.adapter_id,
                lora_name=lora_name,
                extra_keys=extra_keys,
            )
        )

    def removed(self, block_hash: bytes) -> None:
        published = self._published.pop(block_hash, None)
        if published is None:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):  # one event for a burst of evictions
            self._events[-1] = BlockRemoved((*last.block_hashes, published))
        else:
            self._events.append(BlockRemoved((published,)))

    def cleared(self) -> None:
        self._published.clear()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
