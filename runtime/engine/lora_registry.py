"""The served LoRA adapters: name -> LoRARequest, each load's id, and the requests in flight per
adapter. Thread-safe; the event loop only ever calls the quick methods (`acquire`, `release`,
`begin_unload`), loads and waits run on threads of their own.

- Ids are unique per load (a counter): an adapter loaded again, or replaced in place, is a new id,
  so nothing kept for the old weights (a slot, a host copy) is taken for the new ones.
- A request holds a `LoRALease` from the moment its `model` is resolved until its answer ends; the
  lease count per adapter is what an unload waits for.
- Unloading stops new requests at once (they get 404), waits up to a bound for the leases held,
  then removes the adapter; past the bound it gives up with a 409 and the adapter serves again.
- An adapter replaced in place (`load_inplace`) or unloaded is removed from the worker when its
  last lease goes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvasir.runtime.lora.modules import HubAdapter, check_adapter_name
from kvasir.runtime.lora.params import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistryError(ValueError):
    """A load or unload the registry refuses; `status` is the HTTP status it maps to."""

    status = 400


class LoRANotFoundError(LoRARegistryError):
    status = 404


class LoRAConflictError(LoRARegistryError):
    status = 409


@dataclass(eq=False)
class _Entry:
    lora: LoRARequest
    in_flight: int = 0
    unloading: bool = False
    retired: bool = False  # replaced or unloaded: removed from the worker once in_flight is 0
    idle: threading.Condition = field(default_factory=threading.Condition)


class LoRALease:
    """One request's hold on its adapter; `release()` is idempotent."""

    def __init__(self, registry: LoRARegistry, entry: _Entry) -> None:
        self._registry = registry
        self._entry = entry
        self._released = False

    @property
    def lora(self) -> LoRARequest:
        return self._entry.lora

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._registry._release(self._entry)


class LoRARegistry:
    """Loaded adapters by name. `download(hub_adapter) -> folder` fetches a hub adapter's files,
    `identify(path) -> (digest, rank)` reads an adapter's identity, `add(lora)` loads it into the
    worker (all three on the caller's thread, never the engine's), and `remove(adapter_id)`
    forgets it there (it must not block)."""

    def __init__(
        self,
        base_model_name: str,
        *,
        identify: Callable[[str], tuple[bytes, int]],
        add: Callable[[LoRARequest], None],
        remove: Callable[[int], None],
        download: Callable[[HubAdapter], str] | None = None,
    ) -> None:
        self.base_model_name = base_model_name
        self._download = download
        self._identify = identify
        self._add = add
        self._remove = remove
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # in load order
        self._loading: set[str] = set()
        self._ids = itertools.count(1)

    def adapters(self) -> list[LoRARequest]:
        """The adapters serving now (not those being unloaded), in load order."""
        with self._lock:
            return [entry.lora for entry in self._entries.values() if not entry.unloading]

    def in_flight(self, name: str) -> int:
        with self._lock:
            entry = self._entries.get(name)
            return 0 if entry is None else entry.in_flight

    def acquire(self, name: str) -> LoRALease | None:
        """A lease on the adapter serving as `name`, or None (no such adapter, or being unloaded)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.unloading:
                return None
            entry.in_flight += 1
            return LoRALease(self, entry)

    # ---- loading (on a thread of the caller's) --------------------------------------------------

    def load(self, name: str, path: str | HubAdapter, *, replace: bool = False) -> tuple[LoRARequest, float]:
        """Read, check and register an adapter (a local directory, or a hub adapter downloaded
        first); returns it and the seconds the load took. Blocks for the download and the files'
        reading: never call it on the event loop or the engine's thread. `replace`: an adapter
        already serving as `name` is replaced (vLLM's `load_inplace`). A failed download raises
        the loader's hub errors (ModelLoadError and its kinds)."""
        try:
            check_adapter_name(name, self.base_model_name)
        except ValueError as error:
            raise LoRARegistryError(str(error)) from None
        with self._lock:
            if name in self._loading:
                raise LoRAConflictError(f"The LoRA adapter '{name}' is being loaded already.")
            if name in self._entries and not replace:
                raise LoRARegistryError(f"The LoRA adapter '{name}' has already been loaded.")
            if name in self._entries and self._entries[name].unloading:
                raise LoRAConflictError(f"The LoRA adapter '{name}' is being unloaded.")
            self._loading.add(name)
            adapter_id = next(self._ids)
        started = time.monotonic()
        try:
            hub_id = None
            if isinstance(path, HubAdapter):
                if self._download is None:
                    raise LoRARegistryError("This server cannot download adapters from the hub.")
                hub_id, path = path.public_id, self._download(path)
            digest, rank = self._identify(path)
            lora = LoRARequest(name, adapter_id, path, digest, rank, self.base_model_name, hub_id)
            self._add(lora)
            seconds = time.monotonic() - started
            with self._lock:
                old = self._entries.pop(name, None)
                self._entries[name] = _Entry(lora)
                if old is not None:
                    self._retire(old)
        finally:
            with self._lock:
                self._loading.discard(name)
        logger.info("loaded LoRA adapter %r (id %d, rank %d) in %.3fs", name, adapter_id, rank, seconds)
        return lora, seconds

    # ---- unloading --------------------------------------------------------------------------

    def begin_unload(self, name: str) -> _Entry:
        """Stop new requests for `name` (they see no such adapter from now on); 404 if none serves."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.unloading:
                raise LoRANotFoundError(f"The LoRA adapter '{name}' cannot be found.")
            entry.unloading = True
            return entry

    def wait_unloaded(self, entry: _Entry, timeout: float) -> LoRARequest:
        """Wait (a thread's, never the loop's) up to `timeout` seconds for the adapter's requests
        to end, then remove it; past the bound, serve it again and raise LoRAConflictError."""
        with entry.idle:
            done = entry.idle.wait_for(lambda: entry.in_flight == 0, timeout)
        with self._lock:
            if not done and entry.in_flight:
                entry.unloading = False
                raise LoRAConflictError(
                    f"The LoRA adapter '{entry.lora.name}' still has {entry.in_flight} request(s) in "
                    f"flight after {timeout:g}s; it was not unloaded and serves on."
                )
            if self._entries.get(entry.lora.name) is entry:
                del self._entries[entry.lora.name]
            self._retire(entry)
        logger.info("unloaded LoRA adapter %r (id %d)", entry.lora.name, entry.lora.adapter_id)
        return entry.lora

    # ---- internals (under the lock) -------------------------------------------------------------

    def _retire(self, entry: _Entry) -> None:
        entry.retired = True
        if entry.in_flight == 0:
            self._remove(entry.lora.adapter_id)

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.in_flight -= 1
            idle = entry.in_flight == 0
            if idle and entry.retired:
                self._remove(entry.lora.adapter_id)
        if idle:
            with entry.idle:
                entry.idle.notify_all()
