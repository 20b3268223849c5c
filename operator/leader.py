"""Leader election on a coordination.k8s.io Lease, so two operator replicas never both act.

The same protocol as client-go's leaderelection: a holder tries to renew `renewTime` every
`retry_seconds`; a candidate takes over only after it has seen the same record unchanged for a
whole lease duration, measured on its own monotonic clock (so clock skew between nodes does not
matter). Writes carry the observed resourceVersion, so of two candidates racing for a free lease
the API server lets exactly one win (the other gets 409).

Two leaders never act at once: the holder stops acting `renew_deadline_seconds` after the moment
it *sent* its last successful renewal (each attempt is cut off at that deadline, however slow the
API), and a candidate takes over no sooner than a lease duration after it *saw* that renewal, which
came later. `may_act()` is the fence the operator's writes check, so nothing is written after the
deadline even while the kopf loop is still shutting down."""

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
    lease_seconds: float = 15.0  # client-go's LeaseDuration
    renew_deadline_seconds: float = 10.0  # client-go's RenewDeadline: strictly less than the lease
    retry_seconds: float = 2.0  # client-go's RetryPeriod: between two attempts

    def __post_init__(self) -> None:
        if not 0 < self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError(
                "leader election needs retry < renew deadline < lease duration, got "
                f"{self.retry_seconds} / {self.renew_deadline_seconds} / {self.lease_seconds} s"
            )


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
        self._renewed_at = 0.0  # monotonic time the last successful renewal was sent

    def may_act(self) -> bool:
        """True while this replica leads and its renew deadline has not passed."""
        elapsed = time.monotonic() - self._renewed_at
        return self.leading and elapsed < self.config.renew_deadline_seconds

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

    async def _attempt(self, deadline: float) -> bool:
        """One try_acquire_or_renew, abandoned at `deadline` (monotonic); True if it succeeded and
        was sent early enough that the lease still gives us a full renew deadline."""
        sent = time.monotonic()
        remaining = deadline - sent
        if remaining <= 0:
            return False
        try:
            ok = await asyncio.wait_for(self.try_acquire_or_renew(), timeout=remaining)
        except asyncio.TimeoutError:
            logger.warning("leader election: no answer from the API server within %.1fs", remaining)
            return False
        if ok:
            self._renewed_at = sent
        return ok

    async def acquire(self) -> None:
        """Wait until this replica leads (polling every retry_seconds)."""
        while True:
            try:
                if await self._attempt(time.monotonic() + self.config.renew_deadline_seconds):
                    self.leading = True
                    self.lost.clear()
                    logger.info("became the leader (%s)", self.config.identity)
                    return
            except ApiError as exc:
                logger.warning("leader election: %s", exc)
            await asyncio.sleep(self.config.retry_seconds)

    async def hold(self) -> None:
        """Renew every retry period until the renew deadline passes without a renewal (or another
        replica holds the lease); then stop leading, set `lost` and return."""
        while self.leading:
            await asyncio.sleep(self.config.retry_seconds)
            deadline = self._renewed_at + self.config.renew_deadline_seconds
            try:
                if await self._attempt(deadline):
                    continue
                if time.monotonic() < deadline:
                    logger.error("leader lease taken by another replica")
                    break
            except ApiError as exc:
                logger.warning("leader lease renewal failed: %s", exc)
            if time.monotonic() >= deadline:
                logger.error("leader lease not renewed within the renew deadline")
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
