"""The prefix cache's key holds the adapter's weight digest and the request's `cache_salt`, kept
apart: the same prompt shares blocks only under the same adapter bytes and the same salt. The KV
events of such blocks carry what vLLM publishes (`lora_id`, `lora_name`, per-block extra keys),
hashed as vLLM hashes them."""

from __future__ import annotations

import hashlib

from kvasir.runtime.core.kv_cache.block_hash import request_extra_key
from kvasir.runtime.core.kv_cache.events import (
    BlockStored,
    KVEventLog,
    cbor_block_payload,
    external_block_hash,
    root_hash,
)
from kvasir.runtime.core.kv_cache.manager import KVCacheManager
from kvasir.runtime.core.request import Request
from kvasir.runtime.engine.kv_events import encode_batch
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.sample.params import SamplingParams

BS = 4
PROMPT = list(range(1, 14))  # three full blocks and one token


def digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


A = LoRARequest("A", 1, "/adapters/A", digest("weights of A"), 8)
B = LoRARequest("B", 2, "/adapters/B", digest("weights of B"), 8)


def request(request_id: str, lora: LoRARequest | None = None, salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=2)
    return Request(request_id, PROMPT, params, max_tokens=2, seed=0, lora=lora, cache_salt=salt)


def cached_after(kv: KVCacheManager | None, first: Request, second: Request) -> int:
    """Run `first` through the cache (its blocks registered, then freed but still cached), and
    return how many tokens of `second` the prefix cache then serves (`kv` None: a fresh cache)."""
    kv = kv or KVCacheManager(num_blocks=32, block_size=BS)
    computed, cached = kv.get_computed_blocks(first)
    assert kv.allocate_slots(first, first.num_tokens - cached, computed, is_new_admission=True)
    kv.free(first)
    return kv.get_computed_blocks(second)[1]


def test_the_same_request_twice_hits() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    assert cached_after(kv, request("1", A), request("2", A)) == 12
    assert cached_after(kv, request("3", None, "s"), request("4", None, "s")) == 12
    kv.check_integrity()


def test_adapters_a_and_b_share_no_blocks_nor_with_the_base() -> None:
    assert cached_after(None, request("1", A), request("2", B)) == 0
    assert cached_after(None, request("3", A), request("4")) == 0
    assert cached_after(None, request("5"), request("6", B)) == 0


def test_new_files_under_the_same_name_miss_the_old_blocks() -> None:
    """A reloaded under its name with other weights: a new digest (and id), so no hit."""
    reloaded = LoRARequest("A", 3, "/adapters/A", digest("new weights of A"), 8)
    assert cached_after(None, request("1", A), request("2", reloaded)) == 0
    # The same bytes under another name and id do share (the key is the weights, not the name).
    same_bytes = LoRARequest("A-copy", 4, "/adapters/A-copy", A.digest, 8)
    assert cached_after(None, request("3", A), request("4", same_bytes)) == 12


def test_an_adapter_named_x_and_a_salt_x_share_nothing() -> None:
    x = LoRARequest("x", 5, "/adapters/x", b"x" * 32, 8)
    assert cached_after(None, request("1", x), request("2", None, "x")) == 0
    assert cached_after(None, request("3", None, "x"), request("4", None, "y")) == 0
    assert cached_after(None, request("5", x, "x"), request("6", x)) == 0
    assert cached_after(None, request("7", x), request("8", x, "x")) == 0
    # Keys that would collide if the parts were simply concatenated stay apart.
    keys = {
        request_extra_key(None, None),
        request_extra_key(x.cache_key, None),
        request_extra_key(None, "x"),
        request_extra_key(None, "lora:" + "x" * 32),
        request_extra_key(x.cache_key, "x"),
        request_extra_key(None, "x" * 32 + "salt:x"),
    }
    assert len(keys) == 6


def test_kv_events_of_adapter_blocks_carry_its_id_name_and_extra_keys() -> None:
    log = KVEventLog(BS, hash_seed="7")
    kv = KVCacheManager(num_blocks=32, block_size=BS, events=log, watermark=0.0)
    first = request("1", A, "s")
    cached_after(kv, first, first)
    (event,) = log.take()
    assert isinstance(event, BlockStored)
    assert (event.lora_id, event.lora_name, event.parent_block_hash) == (1, "A", None)
    # vLLM's extra keys: the adapter's name on every block, the salt on the first one.
    assert event.extra_keys == (("A", "s"), ("A",), ("A",))
    parent, expected = root_hash("7"), []
    for index, keys in enumerate(event.extra_keys):
        parent = external_block_hash(parent, PROMPT[index * BS : (index + 1) * BS], keys)
        expected.append(parent)
    assert list(event.block_hashes) == expected
    # The CBOR of [parent, [tokens], ["A", "s"]]: an array of two text strings last.
    assert cbor_block_payload(1, [2], ["A", "s"]).hex() == "8301810282" + "6141" + "6173"
    # On the wire: lora_id, medium, lora_name, then the per-block extra keys.
    import msgpack

    _, (wire,) = msgpack.unpackb(encode_batch([event], 1.0))
    assert wire[5:] == [1, "GPU", "A", [["A", "s"], ["A"], ["A"]]]


def test_base_blocks_publish_as_before() -> None:
    log = KVEventLog(BS)
    kv = KVCacheManager(num_blocks=32, block_size=BS, events=log, watermark=0.0)
    cached_after(kv, request("1"), request("2"))
    (event,) = log.take()
    assert isinstance(event, BlockStored)
    assert (event.lora_id, event.lora_name, event.extra_keys) == (None, None, None)
    assert event.block_hashes[0] == external_block_hash(root_hash(""), PROMPT[:BS])
    import msgpack

    _, (wire,) = msgpack.unpackb(encode_batch([event], 1.0))
    assert wire[5:] == [None, "GPU", None]
