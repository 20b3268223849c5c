"""Chained content hashes of full KV-cache blocks: the keys of the prefix cache.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal whole
prefixes, not just equal blocks. SHA-256 makes an accidental match (which would hand one prompt
another prompt's KV) practically impossible; Python's `hash()` of a tuple would not be.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

# The parent of every first block. Versioned so a change of encoding can never match old digests.
ROOT_HASH = hashlib.sha256(b"kvasir.prefix-cache.v1").digest()

_COUNT = struct.Struct("<I")


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """The digest of one full block: parent digest, token ids and an optional extra key (e.g. LoRA)."""
    # Fixed-width fields (32-byte parent, counted 8-byte ids) keep the encoding injective.
    payload = parent_hash + _COUNT.pack(len(token_ids)) + array("q", token_ids).tobytes() + extra_key
    return hashlib.sha256(payload).digest()


def request_extra_key(lora_key: bytes | None = None, cache_salt: str | None = None) -> bytes:
    """The extra key of every block of a request: its LoRA adapter's key (`LoRARequest.cache_key`,
    a digest of the weights) and its `cache_salt`, each length-prefixed and domain-tagged, so no
    adapter can equal a salt, and no pair of them another pair. b"" for a plain base request."""
    parts = []
    if lora_key is not None:
        parts.append(lora_key)
    if cache_salt is not None:
        parts.append(b"salt:" + cache_salt.encode("utf-8", "surrogatepass"))
    return b"".join(_COUNT.pack(len(part)) + part for part in parts)


def extend_block_hashes(
    block_hashes: list[bytes], token_ids: Sequence[int], block_size: int, extra_key: bytes = b""
) -> None:
    """Append to `block_hashes` the hashes of the full blocks of `token_ids` it does not cover yet;
    `extra_key` (`request_extra_key`) goes into every one of them."""
    num_full_blocks = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for index in range(len(block_hashes), num_full_blocks):
        start = index * block_size
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_key)
        block_hashes.append(parent)
