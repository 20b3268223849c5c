"""The adapter registry on its own (fake worker): ids unique per load, names checked, in-flight
requests counted per adapter, an unload that waits for them (or gives up with a 409 and serves
on), and the worker told to forget an adapter only once its last request is gone."""

from __future__ import annotations

import threading

import pytest

from kvasir.runtime.engine.lora_registry import (
    LoRAConflictError,
    LoRANotFoundError,
    LoRARegistry,
    LoRARegistryError,
)
from kvasir.runtime.lora.errors import LoRAAdapterError
from kvasir.runtime.lora.params import LoRARequest

WAIT = 60.0  # the bound on the waits that must end (a condition wakes them long before)


class FakeWorker:
    def __init__(self) -> None:
        self.added: list[LoRARequest] = []
        self.removed: list[int] = []
        self.fail: str | None = None

    def identify(self, path: str) -> tuple[bytes, int]:
        return path.encode().ljust(32, b"\0")[:32], 8

    def add(self, lora: LoRARequest) -> None:
        if self.fail:
            raise LoRAAdapterError(self.fail)
        self.added.append(lora)


@pytest.fixture
def worker() -> FakeWorker:
    return FakeWorker()


@pytest.fixture
def registry(worker: FakeWorker) -> LoRARegistry:
    return LoRARegistry("base", identify=worker.identify, add=worker.add, remove=worker.removed.append)


def test_ids_are_unique_per_load_and_names_are_checked(registry: LoRARegistry, worker: FakeWorker) -> None:
    a, seconds = registry.load("a", "/r/a")
    assert (a.name, a.adapter_id, a.rank, a.base_model_name) == ("a", 1, 8, "base") and seconds >= 0
    b, _ = registry.load("b", "/r/b")
    assert b.adapter_id == 2
    with pytest.raises(LoRARegistryError, match="already been loaded"):
        registry.load("a", "/r/a")
    with pytest.raises(LoRARegistryError, match="base model's served name"):
        registry.load("base", "/r/x")
    with pytest.raises(LoRARegistryError, match="comma"):
        registry.load("x,y", "/r/x")
    worker.fail = "adapter_config.json: 'r' is 0"
    with pytest.raises(LoRAAdapterError, match="'r' is 0"):
        registry.load("c", "/r/c")
    assert [lora.name for lora in registry.adapters()] == ["a", "b"]
    worker.fail = None
    # Unloaded and loaded again: a new id, never the old one.
    registry.wait_unloaded(registry.begin_unload("a"), 0)
    again, _ = registry.load("a", "/r/a")
    assert again.adapter_id == 4  # id 3 went to the load that failed
    assert worker.removed == [1]


def test_unload_waits_for_requests_in_flight(registry: LoRARegistry, worker: FakeWorker) -> None:
    lora, _ = registry.load("a", "/r/a")
    lease = registry.acquire("a")
    assert lease is not None and lease.lora == lora
    assert registry.in_flight("a") == 1
    entry = registry.begin_unload("a")
    # From now on the adapter takes no new request: its name is not served.
    assert registry.acquire("a") is None
    assert registry.adapters() == []
    with pytest.raises(LoRANotFoundError):
        registry.begin_unload("a")
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(registry.wait_unloaded(entry, WAIT)))
    waiter.start()
    assert worker.removed == []
    lease.release()
    lease.release()  # idempotent
    waiter.join(WAIT)
    assert result == [lora]
    assert worker.removed == [lora.adapter_id]
    assert registry.acquire("a") is None


def test_unload_past_the_bound_is_a_409_and_the_adapter_serves_on(
    registry: LoRARegistry, worker: FakeWorker
) -> None:
    registry.load("a", "/r/a")
    lease = registry.acquire("a")
    assert lease is not None
    entry = registry.begin_unload("a")
    with pytest.raises(LoRAConflictError, match="1 request\\(s\\) in flight"):
        registry.wait_unloaded(entry, 0)
    assert LoRAConflictError.status == 409
    assert [lora.name for lora in registry.adapters()] == ["a"]
    assert registry.acquire("a") is not None
    assert worker.removed == []


def test_replace_in_place_keeps_old_requests_on_the_old_weights(
    registry: LoRARegistry, worker: FakeWorker
) -> None:
    old, _ = registry.load("a", "/r/a")
    lease = registry.acquire("a")
    assert lease is not None
    new, _ = registry.load("a", "/r/a2", replace=True)
    assert new.adapter_id != old.adapter_id and new.digest != old.digest
    assert lease.lora == old  # the request in flight keeps what it started with
    fresh = registry.acquire("a")
    assert fresh is not None and fresh.lora == new
    assert worker.removed == []
    lease.release()
    assert worker.removed == [old.adapter_id]  # forgotten once its last request ended
    fresh.release()
    assert worker.removed == [old.adapter_id]


def test_unknown_names_are_not_adapters(registry: LoRARegistry) -> None:
    assert registry.acquire("nope") is None
    with pytest.raises(LoRANotFoundError, match="cannot be found"):
        registry.begin_unload("nope")
