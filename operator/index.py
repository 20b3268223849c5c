"""The LLMDeployments this operator knows, kept by a kopf event handler, and the operator-wide
periodic loop over them (one task for all objects instead of a kopf timer per object, because
kopf puts a finalizer on every object that has a timer)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class ParentIndex:
    """(namespace, name) of every LLMDeployment seen and not yet deleted, and whether it autoscales."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str], bool] = {}

    def add(self, namespace: str, name: str, *, autoscaled: bool = False) -> None:
        self._keys[(namespace, name)] = autoscaled

    def discard(self, namespace: str, name: str) -> None:
        self._keys.pop((namespace, name), None)

    def clear(self) -> None:
        self._keys.clear()

    def snapshot(self, *, autoscaled_only: bool = False) -> list[tuple[str, str]]:
        return sorted(key for key, autoscaled in self._keys.items() if autoscaled or not autoscaled_only)

    def __len__(self) -> int:
        return len(self._keys)


async def every(
    interval: float, index: ParentIndex, visit: Callable[[str, str], Awaitable[object]], what: str
) -> None:
    """Call `visit(namespace, name)` for every indexed object once per `interval`, forever.

    Objects are visited one after another, so one pass never floods the API server; a failure is
    logged and never ends the loop."""
    while True:
        await asyncio.sleep(interval)
        for namespace, name in index.snapshot():
            try:
                await visit(namespace, name)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("%s of %s/%s failed", what, namespace, name)
