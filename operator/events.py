"""Kubernetes Events on LLMDeployments (what `kubectl describe llmd` lists), posted with the
operator's own client, so they work from every loop (kopf's handlers, the resync, the autoscaler)
and never depend on kopf's context."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from kvasir.operator import naming
from kvasir.operator.kube import ApiError, KubeClient, resource_path

logger = logging.getLogger(__name__)

# The API server refuses an Event message over 1 KiB.
MAX_MESSAGE = 1024


def build_event(
    parent: Mapping[str, Any], event_type: str, reason: str, message: str, component: str
) -> dict[str, Any]:
    """A core/v1 Event about `parent` (an LLMDeployment as read from the API)."""
    meta = parent["metadata"]
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": parent.get("apiVersion", naming.API_VERSION),
            "kind": naming.KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        },
        "type": event_type,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "source": {"component": component},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "reportingComponent": naming.MANAGER,
    }


class EventRecorder:
    """Posts Events; a refused Event is logged, never raised (it must not fail a reconcile)."""

    def __init__(self, client: KubeClient, component: str = naming.MANAGER) -> None:
        self.client = client
        self.component = component

    async def post(self, parent: Mapping[str, Any], event_type: str, reason: str, message: str) -> None:
        event = build_event(parent, event_type, reason, message, self.component)
        namespace = parent["metadata"]["namespace"]
        try:
            await self.client.create(resource_path("", "v1", "events", namespace), event)
        except ApiError as exc:
            logger.warning(
                "event %s on %s/%s not posted: %s", reason, namespace, event["involvedObject"]["name"], exc
            )

    async def warning(self, parent: Mapping[str, Any], reason: str, message: str) -> None:
        await self.post(parent, "Warning", reason, message)

    async def normal(self, parent: Mapping[str, Any], reason: str, message: str) -> None:
        await self.post(parent, "Normal", reason, message)
