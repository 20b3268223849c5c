"""KV-cache events from a real engine to a real ZeroMQ subscriber, decoded as llm-d's indexer
decodes them: topic, sequence, msgpack batch of tagged array events, hashes it can recompute."""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import pytest
import zmq

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.core.kv_cache.events import external_block_hash, root_hash
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.kv_events_config import parse_kv_events_config
from kvasir.runtime.sample.params import SamplingParams
from tests.tiny_checkpoints import make_tiny_checkpoint

BLOCK = 16


def test_the_config_names_a_bad_key_or_value() -> None:
    config = parse_kv_events_config('{"endpoint": "tcp://10.0.0.1:5557", "topic": "kv@pod@m"}')
    assert config.active and config.publisher == "zmq" and config.hash_seed == ""
    assert not parse_kv_events_config({"publisher": "null"}).active
    with pytest.raises(ValueError, match="unknown key 'replay'"):
        parse_kv_events_config('{"replay": 1}')
    with pytest.raises(ValueError, match=r"kv_events_config\.endpoint"):
        parse_kv_events_config('{"endpoint": "localhost"}')
    with pytest.raises(ValueError, match="not JSON"):
        parse_kv_events_config("{")


def test_an_engine_publishes_the_blocks_it_caches(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "llama", "llama")
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.RCVTIMEO, 500)
    port = subscriber.bind_to_random_port("tcp://127.0.0.1")
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@")
    events_config = parse_kv_events_config(
        {"endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv@10.0.0.7@tiny", "hash_seed": "7"}
    )
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint),
            device="cpu",
            max_model_len=128,
            block_size=BLOCK,
            kv_events_config=events_config,
        )
    )
    try:
        frames = None
        for attempt in range(20):  # a PUB socket drops what it sends before the connection is up
            prompt = [(attempt * 37 + i) % 200 + 3 for i in range(40)]
            engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
            try:
                frames = subscriber.recv_multipart()
                break
            except zmq.Again:
                continue
        assert frames is not None, "no KV event reached the subscriber"
    finally:
        engine.close()
        subscriber.close()
        context.term()
    topic, sequence, payload = frames
    assert topic == b"kv@10.0.0.7@tiny"
    assert struct.unpack(">Q", sequence)[0] >= 0
    timestamp, events = msgpack.unpackb(payload)
    assert isinstance(timestamp, float)
    stored = next(e for e in events if e[0] == "BlockStored")
    tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name = stored
    assert tag == "BlockStored"
    assert (block_size, lora_id, medium, lora_name, parent) == (BLOCK, None, "GPU", None, None)
    # The prompt's two full blocks (40 tokens), keyed as llm-d computes them from the tokens.
    assert tokens == prompt[: 2 * BLOCK]
    expected = external_block_hash(root_hash("7"), prompt[:BLOCK])
    assert hashes == [expected, external_block_hash(expected, prompt[BLOCK : 2 * BLOCK])]


def test_the_default_endpoint_binds_loopback_only() -> None:
    """Every prompt's token ids go out on this socket, unauthenticated: without an endpoint it is
    bound on 127.0.0.1, and reaching other hosts takes a wildcard (or an indexer's address)."""
    config = parse_kv_events_config("{}")
    assert (config.endpoint, config.binds) == ("tcp://127.0.0.1:5557", True)
    assert parse_kv_events_config('{"endpoint": "tcp://*:5557"}').binds
    assert parse_kv_events_config('{"endpoint": "tcp://0.0.0.0:5557"}').binds
    # Any other address connects to a subscriber that binds (llm-d's indexer), unless told to bind.
    assert not parse_kv_events_config('{"endpoint": "tcp://127.0.0.1:6000"}').binds
    assert parse_kv_events_config('{"endpoint": "tcp://127.0.0.1:6000", "bind": true}').binds
    assert not parse_kv_events_config('{"bind": false}').binds


def test_the_default_publisher_is_reachable_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvasir.runtime.engine import kv_events

    context = zmq.Context()
    probe = context.socket(zmq.PUB)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    context.term()
    monkeypatch.setattr("kvasir.runtime.kv_events_config.DEFAULT_ENDPOINT", f"tcp://127.0.0.1:{port}")
    publisher = kv_events.KVEventPublisher(parse_kv_events_config({}))
    try:
        endpoint = publisher._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert endpoint == f"tcp://127.0.0.1:{port}"
    finally:
        publisher.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"endpoint": "udp://x:1"}', "unknown scheme 'udp://'"),
        ('{"endpoint": "inproc://kv"}', "unknown scheme 'inproc://'"),
        ('{"endpoint": "tcp://host"}', "needs a port from 1 to 65535"),
        ('{"hwm": 4294967296}', "hwm must be an integer from 0 to 2147483647"),
        ('{"hwm": -1}', "hwm must be an integer from 0 to 2147483647"),
        ('{"bind": "yes"}', "bind must be true or false"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_unusable_settings_are_value_errors(config: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_kv_events_config(config)


def test_an_address_in_use_is_a_value_error_naming_the_flag() -> None:
    from kvasir.runtime.engine.kv_events import KVEventPublisher, check_endpoint

    context = zmq.Context()
    holder = context.socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = parse_kv_events_config({"endpoint": f"tcp://127.0.0.1:{port}", "bind": True})
        expected = f"--kv-events-config: cannot bind tcp://127.0.0.1:{port}: Address already in use"
        with pytest.raises(ValueError) as checked:
            check_endpoint(config)
        assert str(checked.value) == expected
        with pytest.raises(ValueError) as published:
            KVEventPublisher(config)
        assert str(published.value) == expected
    finally:
        holder.close(linger=0)
        context.term()
    check_endpoint(config)  # free again: the check leaves nothing bound behind
    check_endpoint(config)
