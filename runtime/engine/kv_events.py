"""Publishing KV-cache events on ZeroMQ in vLLM's wire format (see `--kv-events-config`).

Each message is three frames: the topic, an 8-byte big-endian sequence number, and a msgpack
payload `[timestamp, [event, ...]]` where an event is a tagged array, as vLLM's msgspec structs
encode them: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name]` (then `extra_keys`, one entry per block, when a block has any: an adapter's
name, a `cache_salt`), `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`. Sending happens on
a thread of its own, so a slow or absent subscriber never holds up an engine step (the queue is
bounded; past it, the oldest batches are dropped and counted). vLLM's replay socket is not
offered: a subscriber that missed a sequence number starts over from the next AllBlocksCleared or
from what it sees next."""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from typing import Any

from kvasir.runtime.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvasir.runtime.kv_events_config import KVEventsConfig

logger = logging.getLogger(__name__)

MEDIUM = "GPU"  # vLLM's name for the accelerator's own cache tier
_MAX_QUEUED_BATCHES = 10_000
_SEQ = struct.Struct(">Q")


def encode_batch(events: list[KVCacheEvent], timestamp: float) -> bytes:
    """One batch as vLLM's msgpack `KVEventBatch` (array-like, tagged events)."""
    import msgpack

    encoded: list[list[Any]] = []
    for event in events:
        if isinstance(event, BlockStored):
            encoded.append(
                [
                    "BlockStored",
                    list(event.block_hashes),
                    event.parent_block_hash,
                    list(event.token_ids),
                    event.block_size,
                    event.lora_id,
                    MEDIUM,
                    event.lora_name,
                ]
            )
            if event.extra_keys is not None:  # msgspec omits a trailing default; so does this
                encoded[-1].append([None if keys is None else list(keys) for keys in event.extra_keys])
        elif isinstance(event, BlockRemoved):
            encoded.append(["BlockRemoved", list(event.block_hashes), MEDIUM])
        elif isinstance(event, AllBlocksCleared):
            encoded.append(["AllBlocksCleared"])
    payload: bytes = msgpack.packb([timestamp, encoded], use_bin_type=True)
    return payload


def _zmq() -> Any:
    """pyzmq, or ValueError saying how to get it (msgpack is checked with it)."""
    try:
        import msgpack  # noqa: F401
        import zmq
    except ImportError as exc:
        raise ValueError(
            f"--kv-events-config needs pyzmq and msgpack ({exc.name} is missing): pip install 'kvasir[kv-events]'"
        ) from None
    return zmq


def open_socket(context: Any, config: KVEventsConfig) -> Any:
    """A PUB socket bound or connected to the config's endpoint; ValueError naming the flag when
    ZeroMQ refuses the address (in use, no such interface, not permitted)."""
    zmq = _zmq()
    socket = context.socket(zmq.PUB)
    try:
        socket.setsockopt(zmq.SNDHWM, config.hwm)
        socket.setsockopt(zmq.LINGER, 1000)
        if config.binds:
            socket.bind(config.endpoint)
        else:
            socket.connect(config.endpoint)
    except zmq.ZMQError as exc:
        socket.close(linger=0)
        how = "bind" if config.binds else "connect to"
        raise ValueError(
            f"--kv-events-config: cannot {how} {config.endpoint}: {zmq.strerror(exc.errno)}"
        ) from None
    return socket


def check_endpoint(config: KVEventsConfig) -> None:
    """Open and close the config's socket once, so that an address in use (or otherwise refused)
    is a one-line error before the server starts, not a traceback once the model has loaded.
    A context of its own, terminated, so the port is free again on return."""
    if not config.active:
        return
    context = _zmq().Context()
    try:
        open_socket(context, config).close(linger=0)
    finally:
        context.term()


class KVEventPublisher:
    """A ZeroMQ PUB socket fed from a queue by its own thread; `publish()` never blocks."""

    def __init__(self, config: KVEventsConfig) -> None:
        zmq = _zmq()
        self._topic = config.topic.encode()
        self._context: Any = zmq.Context.instance()
        self._socket = open_socket(self._context, config)
        self.dropped = 0
        self._sequence = 0
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(_MAX_QUEUED_BATCHES)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV-cache events on %s (topic %r)", config.endpoint, config.topic)

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            timestamp, events = item
            payload = encode_batch(events, timestamp)
            self._socket.send_multipart([self._topic, _SEQ.pack(self._sequence), payload])
            self._sequence += 1
        self._socket.close()

    def close(self) -> None:
        """Send what is queued, then close the socket."""
        self._queue.put(None)
        self._thread.join(5)
