"""The host tier of LoRA adapters: checked weights in host memory, at most `capacity` of them, the
least recently used dropped first; read from disk off the engine thread.

Thread-safe: `add` runs in the caller's thread (the server's loader thread, never the engine's)
and `prefetch` in a background thread; `get` runs on the step's thread. An adapter dropped from
this tier stays registered (its `LoRARequest` keeps its path): asked for again, it is read again,
in the background if `prefetch` saw it coming, else by `get` on the step's thread (a stall of one
read; it is logged).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from kvasir.runtime.loader.lora_adapter import LoRAAdapter
from kvasir.runtime.lora.errors import LoRAAdapterError
from kvasir.runtime.lora.params import LoRARequest

logger = logging.getLogger(__name__)

Reader = Callable[[LoRARequest], LoRAAdapter]


class LoRAHostCache:
    """Registered adapters (id -> LoRARequest) and the weights of up to `capacity` of them."""

    def __init__(self, capacity: int, read: Reader) -> None:
        if capacity < 1:
            raise ValueError(f"the host tier needs room for at least one adapter, got {capacity}")
        self.capacity = capacity
        self._read = read
        self._lock = threading.Lock()
        self._registered: dict[int, LoRARequest] = {}
        self._resident: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self._loading: dict[int, Future[LoRAAdapter]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.reads_total = 0  # files read (the first load and every reload)

    def add(self, lora: LoRARequest) -> None:
        """Read and check `lora`'s files in this thread, then keep them (evicting the least recently
        used beyond capacity). Raises LoRAAdapterError; an adapter that fails is not registered."""
        adapter = self._timed_read(lora)
        if adapter.rank != lora.rank:
            raise LoRAAdapterError(
                f"adapter_config.json: 'r' is {adapter.rank}, the request says {lora.rank}"
            )
        with self._lock:
            self._registered[lora.adapter_id] = lora
            self._keep(lora.adapter_id, adapter)

    def remove(self, adapter_id: int) -> None:
        """Forget the adapter and its weights; an unknown id is a no-op."""
        with self._lock:
            self._registered.pop(adapter_id, None)
            self._resident.pop(adapter_id, None)

    def is_resident(self, adapter_id: int) -> bool:
        with self._lock:
            return adapter_id in self._resident

    def resident_ids(self) -> list[int]:
        """Adapter ids in host memory, least recently used first."""
        with self._lock:
            return list(self._resident)

    def prefetch(self, loras: Iterable[LoRARequest]) -> None:
        """Start reading, in a background thread, each of `loras` that is not in host memory."""
        with self._lock:
            for lora in loras:
                if lora.adapter_id in self._resident or lora.adapter_id in self._loading:
                    continue
                self._registered.setdefault(lora.adapter_id, lora)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvasir-lora-read")
                self._loading[lora.adapter_id] = self._pool.submit(self._load_into_tier, lora)

    def get(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter's weights, marked most recently used: from memory, from a read already under
        way, or read now in this thread (logged: the step waits for it)."""
        with self._lock:
            adapter = self._resident.get(lora.adapter_id)
            if adapter is not None:
                self._resident.move_to_end(lora.adapter_id)
                return adapter
            future = self._loading.get(lora.adapter_id)
        if future is not None:
            return future.result()
        logger.warning("LoRA adapter %r is not in host memory: reading it on the step's thread", lora.name)
        return self._load_into_tier(lora)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _load_into_tier(self, lora: LoRARequest) -> LoRAAdapter:
        try:
            adapter = self._timed_read(lora)
            with self._lock:
                if lora.adapter_id in self._registered:  # not removed while it was being read
                    self._keep(lora.adapter_id, adapter)
            return adapter
        finally:
            with self._lock:
                self._loading.pop(lora.adapter_id, None)

    def _timed_read(self, lora: LoRARequest) -> LoRAAdapter:
        started = time.perf_counter()
        adapter = self._read(lora)
        with self._lock:
            self.reads_total += 1
        logger.info(
            "read LoRA adapter %r (rank %d) in %.3fs", lora.name, adapter.rank, time.perf_counter() - started
        )
        return adapter

    def _keep(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        """Keep the weights as most recently used, dropping the least recently used over capacity
        (called with the lock held)."""
        self._resident[adapter_id] = adapter
        self._resident.move_to_end(adapter_id)
        while len(self._resident) > self.capacity:
            dropped, _ = self._resident.popitem(last=False)
            logger.info("LoRA adapter id %d dropped from host memory (least recently used)", dropped)
