"""Leader election on a coordination.k8s.io Lease, so two operator replicas never both act.

The same protocol as client-go's leaderelection: a holder renews `renewTime` every `renew_seconds`;
a candidate takes over only after it has seen the same record unchanged for a whole lease
duration, measured on its own monotonic clock (so clock skew between nodes does not matter).
Writes carry the observed resourceVersion, so of two candidates racing for a free lease the API
server lets exactly one win (the other gets 409)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvasir.operator.kube import ApiError, KubeClient, resource_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    identity: str
    name: str = "kvasir-operator"
    lease_seconds: float = 15.0
    renew_seconds: float = 5.0
    retry_seconds: float = 2.0


def _micro_time() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Acquire, hold and release one Lease; `lost` is set when leadership ends for any reason."""

    def __init__(self, client: KubeClient, config: LeaseConfig) -> None:
        self.client = client
        self.config = config
        self.lost = asyncio.Event()
        self.leading = False
        self._observed: tuple[Any, float] | None = None  # (holder record, monotonic time first seen)

    @property
    def _path(self) -> str:
        return resource_path("coordination.k8s.io", "v1", "leases", self.config.namespace, self.config.name)

    def _spec(self, transitions: int, acquire_time: str | None) -> dict[str, Any]:
        now = _micro_time()
        return {
            "holderIdentity": self.config.identity,
            # The API field is an integer; sub-second durations (tests) round up to one second.
            "leaseDurationSeconds": max(1, round(self.config.lease_seconds)),
            "acquireTime": acquire_time or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def _expired(self, lease: dict[str, Any]) -> bool:
        spec = lease.get("spec") or {}
        if not spec.get("holderIdentity"):
            return True  # released
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        now = time.monotonic()
        if self._observed is None or self._observed[0] != record:
            self._observed = (record, now)
            return False
        return now - self._observed[1] > self.config.lease_seconds

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True if this replica holds the lease afterwards."""
        lease = await self.client.get(self._path)
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.config.name, "namespace": self.config.namespace},
                "spec": self._spec(0, None),
            }
            collection = resource_path("coordination.k8s.io", "v1", "leases", self.config.namespace)
            try:
                await self.client.create(collection, body)
            except ApiError as exc:
                if exc.status == 409:
                    return False  # another candidate created it first
                raise
            return True
        spec = lease.get("spec") or {}
        transitions = int(spec.get("leaseTransitions") or 0)
        if spec.get("holderIdentity") == self.config.identity:
            patch_spec = self._spec(transitions, spec.get("acquireTime"))
        elif self._expired(lease):
            patch_spec = self._spec(transitions + 1, None)
        else:
            return False
        version = lease.get("metadata", {}).get("resourceVersion")
        patch: dict[str, Any] = {"spec": patch_spec}
        if version:
            patch["metadata"] = {"resourceVersion": version}  # optimistic concurrency
        try:
            await self.client.merge_patch(self._path, patch)
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def acquire(self) -> None:
        """Wait until this replica leads (polling every retry_seconds)."""
        while True:
            try:
                if await self.try_acquire_or_renew():
                    self.leading = True
                    self.lost.clear()
                    logger.info("became the leader (%s)", self.config.identity)
                    return
            except ApiError as exc:
                logger.warning("leader election: %s", exc)
            await asyncio.sleep(self.config.retry_seconds)

    async def hold(self) -> None:
        """Renew until a renewal has failed for a whole lease duration; then set `lost` and return."""
        last_renewed = time.monotonic()
        while self.leading:
            await asyncio.sleep(self.config.renew_seconds)
            try:
                if await self.try_acquire_or_renew():
                    last_renewed = time.monotonic()
                    continue
                logger.error("leader lease taken by another replica")
                break
            except ApiError as exc:
                logger.warning("leader lease renewal failed: %s", exc)
            # Give up strictly before others may take over: they wait a full duration after our last renewal.
            if time.monotonic() - last_renewed > self.config.lease_seconds - self.config.renew_seconds:
                logger.error("leader lease not renewed in time")
                break
        self.leading = False
        self.lost.set()

    async def release(self) -> None:
        """Give the lease up at once (graceful shutdown), so a standby replica takes over quickly."""
        if not self.leading:
            return
        self.leading = False
        self.lost.set()
        try:
            await self.client.merge_patch(self._path, {"spec": {"holderIdentity": None, "renewTime": None}})
        except ApiError as exc:
            logger.warning("leader lease not released: %s", exc)
