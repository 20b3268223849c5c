"""Publishing KV-cache events on ZeroMQ in vLLM's wire format (see `--kv-events-config`).

Each message is three frames: the topic, an 8-byte big-endian sequence number, and a msgpack
payload `[timestamp, [event, ...]]` where an event is a tagged array, as vLLM's msgspec structs
encode them: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`. Sending happens on
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
                    None,
                    MEDIUM,
                ]
            )
        elif isinstance(event, BlockRemoved):
            encoded.append(["BlockRemoved", list(event.block_hashes), MEDIUM])
        elif isinstance(event, AllBlocksCleared):
            encoded.append(["AllBlocksCleared"])
    payload: bytes = msgpack.packb([timestamp, encoded], use_bin_type=True)
    return payload


class KVEventPublisher:
    """A ZeroMQ PUB socket fed from a queue by its own thread; `publish()` never blocks."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq  # an optional dependency: pip install 'kvasir[kv-events]'

        self._topic = config.topic.encode()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 1000)
        host = config.endpoint.split("://", 1)[1]
        if host.startswith(("*", "[::]", "0.0.0.0")):
            self._socket.bind(config.endpoint)
        else:
            self._socket.connect(config.endpoint)
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
