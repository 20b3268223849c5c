"""Create-or-patch of one child with a fixed name: writes only when the live object differs."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from enum import Enum
from typing import Any

from kvasir.operator.kube import ApiError, KubeClient, resource_path
from kvasir.operator.manifests import kind_of


class Outcome(str, Enum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"


def contains(live: Any, desired: Any) -> bool:
    """Whether `live` already has every field of `desired` (extra live fields are server defaults)."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return False
        return all(key in live and contains(live[key], value) for key, value in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return False
        return all(contains(a, b) for a, b in zip(live, desired, strict=True))
    if isinstance(desired, bool) or isinstance(live, bool):
        return live is desired
    if isinstance(desired, (int, float)) and isinstance(live, (int, float)):
        return float(live) == float(desired)
    return bool(live == desired)


def object_path(manifest: Mapping[str, Any], subresource: str | None = None) -> str:
    kind = kind_of(dict(manifest))
    meta = manifest["metadata"]
    return resource_path(kind.group, kind.version, kind.plural, meta["namespace"], meta["name"], subresource)


def collection_path(manifest: Mapping[str, Any]) -> str:
    kind = kind_of(dict(manifest))
    return resource_path(kind.group, kind.version, kind.plural, manifest["metadata"]["namespace"])


async def apply_once(client: KubeClient, desired: Mapping[str, Any]) -> Outcome:
    """GET, then create (missing), server-side apply (drifted) or nothing (up to date)."""
    live = await client.get(object_path(desired))
    if live is None:
        try:
            await client.create(collection_path(desired), desired)
            return Outcome.CREATED
        except ApiError as exc:
            if exc.status != 409:
                raise
            # Created concurrently (another handler, or our own earlier attempt that timed out).
            live = await client.get(object_path(desired))
            if live is None:
                raise
    if contains(live, desired):
        return Outcome.UNCHANGED
    await client.apply(object_path(desired), desired)
    return Outcome.PATCHED


async def apply(
    client: KubeClient, desired: Mapping[str, Any], *, attempts: int = 5, backoff: float = 0.1
) -> Outcome:
    """`apply_once`, retrying conflicts, throttling and server faults with exponential backoff."""
    for attempt in range(attempts):
        try:
            return await apply_once(client, desired)
        except ApiError as exc:
            if not exc.transient or attempt == attempts - 1:
                raise
            await asyncio.sleep(min(backoff * 2**attempt, 5.0))
    raise AssertionError("unreachable: the loop returns or raises")
