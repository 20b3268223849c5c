"""Create-or-update of one child with a fixed name, and deletion of children no longer wanted.

GET the live object; POST it when missing; when an owned part differs, PUT the live object with
the owned parts replaced (`ownership.merge_into_live`) and the live resourceVersion, so that a
concurrent writer makes us retry on fresh state instead of being overwritten."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from enum import Enum
from typing import Any

from kvasir.operator.children.manifests import ChildKind, kind_of
from kvasir.operator.children.ownership import (
    merge_into_live,
    owned_spec_digest,
    record_for,
    up_to_date,
    with_record,
)
from kvasir.operator.kube import ApiError, KubeClient, resource_path


class Outcome(str, Enum):
    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"
    DELETED = "deleted"


class NotOwned(Exception):
    """A child's name is taken by an object this LLMDeployment does not control."""


def object_path(manifest: Mapping[str, Any], subresource: str | None = None) -> str:
    kind = kind_of(dict(manifest))
    meta = manifest["metadata"]
    return resource_path(kind.group, kind.version, kind.plural, meta["namespace"], meta["name"], subresource)


def collection_path(manifest: Mapping[str, Any]) -> str:
    kind = kind_of(dict(manifest))
    return resource_path(kind.group, kind.version, kind.plural, manifest["metadata"]["namespace"])


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


class Applier:
    """Writes children; remembers how the server answered its own writes (see `up_to_date`)."""

    def __init__(self, client: KubeClient, *, attempts: int = 5, backoff: float = 0.1) -> None:
        self.client = client
        self.attempts = attempts
        self.backoff = backoff
        # (path) -> (desired hash, owned-spec hash of the server's answer to our last write)
        self._settled: dict[str, tuple[str, str]] = {}

    async def apply(self, desired: Mapping[str, Any]) -> Outcome:
        """`apply_once`, retrying conflicts, throttling and server faults with exponential backoff."""
        for attempt in range(self.attempts):
            try:
                return await self.apply_once(desired)
            except ApiError as exc:
                if not exc.transient or attempt == self.attempts - 1:
                    raise
                await asyncio.sleep(min(self.backoff * 2**attempt, 5.0))
        raise AssertionError("unreachable: the loop returns or raises")

    async def apply_once(self, desired: Mapping[str, Any]) -> Outcome:
        path = object_path(desired)
        live = await self.client.get(path)
        if live is None:
            try:
                answer = await self.client.create(collection_path(desired), with_record(desired))
            except ApiError as exc:
                if exc.status != 409:
                    raise
                raise ApiError(409, "AlreadyExists", "created concurrently; retrying on fresh state") from exc
            self._remember(path, desired, answer)
            return Outcome.CREATED
        self._check_owner(live, desired)
        if (live.get("metadata") or {}).get("deletionTimestamp"):
            # Being deleted (by a user or the garbage collector): its DELETED event brings us back.
            return Outcome.UNCHANGED
        settled = self._settled.get(path)
        settled_spec = settled[1] if settled and settled[0] == record_for(desired).digest else None
        if up_to_date(live, desired, settled_spec):
            return Outcome.UNCHANGED
        answer = await self.client.replace(path, merge_into_live(live, desired))
        self._remember(path, desired, answer)
        return Outcome.UPDATED

    def _remember(self, path: str, desired: Mapping[str, Any], answer: Mapping[str, Any]) -> None:
        if answer.get("spec") is not None:
            self._settled[path] = (record_for(desired).digest, owned_spec_digest(answer))

    @staticmethod
    def _check_owner(live: Mapping[str, Any], desired: Mapping[str, Any]) -> None:
        have, want = controller_uid(live), controller_uid(desired)
        if want is not None and have != want:
            meta = live.get("metadata") or {}
            owner = "no controller" if have is None else f"another controller (uid {have})"
            raise NotOwned(
                f"{live.get('kind', 'object')} {meta.get('namespace')}/{meta.get('name')} already exists "
                f"and has {owner}; delete or rename it so that the operator can manage it"
            )

    async def delete_unwanted(self, kind: ChildKind, namespace: str, name: str, owner_uid: str) -> Outcome:
        """Delete the child of this kind and name if this parent controls it."""
        path = resource_path(kind.group, kind.version, kind.plural, namespace, name)
        live = await self.client.get(path)
        if live is None or controller_uid(live) != owner_uid:
            return Outcome.UNCHANGED
        if (live.get("metadata") or {}).get("deletionTimestamp"):
            return Outcome.UNCHANGED
        await self.client.delete(path, uid=(live.get("metadata") or {}).get("uid"))
        self._settled.pop(path, None)
        return Outcome.DELETED
