"""KV-cache events: the CBOR encoding against RFC 8949's examples, the published hash chain, and
the events a KVCacheManager logs as blocks are cached, evicted and cleared."""

from __future__ import annotations

import hashlib

import pytest

from kvasir.runtime.core.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
    _cbor_head,
    cbor_block_payload,
    external_block_hash,
    root_hash,
)
from kvasir.runtime.core.kv_cache.manager import KVCacheManager
from kvasir.runtime.core.request import Request
from kvasir.runtime.sample.params import SamplingParams

BS = 4


@pytest.mark.parametrize(
    ("major", "value", "expected"),
    [  # RFC 8949, Appendix A
        (0, 0, "00"),
        (0, 23, "17"),
        (0, 24, "1818"),
        (0, 100, "1864"),
        (0, 1000, "1903e8"),
        (0, 1000000, "1a000f4240"),
        (0, 1000000000000, "1b000000e8d4a51000"),
        (0, 18446744073709551615, "1bffffffffffffffff"),
        (4, 3, "83"),
        (3, 0, "60"),
    ],
)
def test_cbor_heads_are_the_rfcs(major: int, value: int, expected: str) -> None:
    assert _cbor_head(major, value).hex() == expected


def test_the_block_payload_is_canonical_cbor() -> None:
    # [1, [2, 3], null]: RFC 8949 Appendix A's [1, [2, 3], [4, 5]] with null (f6) last.
    assert cbor_block_payload(1, [2, 3]).hex() == "8301820203f6"
    assert cbor_block_payload(2**40, [1000]).hex() == "831b000001000000000081" + "1903e8" + "f6"


def test_the_hash_is_the_low_64_bits_of_sha256() -> None:
    assert root_hash("") == int.from_bytes(hashlib.sha256(b"\x60").digest()[24:], "big")
    digest = hashlib.sha256(bytes.fromhex("8301820203f6")).digest()
    assert external_block_hash(1, [2, 3]) == int.from_bytes(digest[-8:], "big")


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=4), max_tokens=4, seed=0)


def _admit(kv: KVCacheManager, request: Request) -> None:
    computed, cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - cached, computed, is_new_admission=True)
    request.num_computed_tokens = request.num_tokens


def _chain(seed: str, tokens: list[int]) -> list[int]:
    parent, out = root_hash(seed), []
    for start in range(0, len(tokens) - len(tokens) % BS, BS):
        parent = external_block_hash(parent, tokens[start : start + BS])
        out.append(parent)
    return out


def test_caching_evicting_and_clearing_are_logged() -> None:
    log = KVEventLog(BS, hash_seed="42")
    kv = KVCacheManager(num_blocks=6, block_size=BS, events=log, watermark=0.0)
    first = _request("a", list(range(10)))  # two full blocks and a partial one
    _admit(kv, first)
    assert log.take() == [BlockStored(tuple(_chain("42", list(range(10)))), None, tuple(range(8)), BS)]
    # A second prompt sharing the first block: a hit, then one new block stored after it.
    second = _request("b", [0, 1, 2, 3, 9, 9, 9, 9, 5])
    _admit(kv, second)
    chain = _chain("42", [0, 1, 2, 3, 9, 9, 9, 9])
    assert log.take() == [BlockStored((chain[1],), chain[0], (9, 9, 9, 9), BS)]
    kv.free(first)
    kv.free(second)
    # Free queue (LRU first): never used 5, then a's tail 2 and its block 1, b's tail 4, b's block
    # 3 and the shared block 0. Four new blocks take 5, 2, 1 and 4: only a's block 1 was cached.
    third = _request("c", list(range(100, 116)))
    _admit(kv, third)
    first_chain = _chain("42", list(range(10)))
    assert log.take() == [
        BlockRemoved((first_chain[1],)),
        BlockStored(tuple(_chain("42", list(range(100, 116)))), None, tuple(range(100, 116)), BS),
    ]
    kv.free(third)
    kv.reset_prefix_cache()
    assert log.take() == [AllBlocksCleared()]
    kv.check_integrity()


def test_without_a_log_nothing_changes() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    _admit(kv, _request("a", list(range(10))))
    assert kv.events is None
