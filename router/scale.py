"""Asking for a first replica: the router scales its LLMDeployment from 0 to 1 through the scale
subresource, the way `kubectl scale` would, but never over another writer.

It reads the scale first and writes only when `spec.replicas` is 0, with the `resourceVersion` it
read as a precondition: if the operator (or a person) changed the replicas in between, the API
server answers 409 and the router leaves their decision alone. Its service account needs `get`
and `patch` on `llmdeployments/scale`."""

from __future__ import annotations

import asyncio
import json
import logging
from enum import Enum
from urllib.parse import quote

import aiohttp

from kvasir.router.kube import KubeApi

logger = logging.getLogger(__name__)

SCALE_PATH = "/apis/inference.kvasir.dev/v1alpha1/namespaces/{namespace}/llmdeployments/{name}/scale"
_TIMEOUT = aiohttp.ClientTimeout(total=10)


class Activation(Enum):
    SCALED = "scaled"  # replicas were 0; the router set them to 1
    NOT_AT_ZERO = "not_at_zero"  # replicas already 1 or more: a replica is on its way
    CONFLICT = "conflict"  # someone else changed the scale between the read and the write
    FORBIDDEN = "forbidden"  # the service account may not (no scale to zero for this deployment)
    FAILED = "failed"  # the API could not be asked (logged)


class ScaleFromZero:
    """GET then PATCH of one LLMDeployment's scale subresource."""

    def __init__(self, session: aiohttp.ClientSession, api: KubeApi, name: str) -> None:
        self._session = session
        self._api = api
        self._url = api.url + SCALE_PATH.format(
            namespace=quote(api.namespace, safe=""), name=quote(name, safe="")
        )

    async def activate(self) -> Activation:
        try:
            return await self._activate()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
            logger.warning("asking for a first replica failed: %s: %s", type(exc).__name__, str(exc)[:200])
            return Activation.FAILED

    async def _activate(self) -> Activation:
        headers = self._api.headers()
        async with self._session.get(
            self._url, headers=headers, ssl=self._api.ssl, timeout=_TIMEOUT
        ) as answer:
            if answer.status == 403:
                return Activation.FORBIDDEN
            if answer.status != 200:
                logger.warning("reading the scale: %s %s", answer.status, (await answer.text())[:200])
                return Activation.FAILED
            scale = await answer.json(content_type=None)
        replicas = (scale.get("spec") or {}).get("replicas") or 0
        if not isinstance(replicas, int) or replicas > 0:
            return Activation.NOT_AT_ZERO
        version = scale["metadata"]["resourceVersion"]
        patch = {"metadata": {"resourceVersion": version}, "spec": {"replicas": 1}}
        async with self._session.patch(
            self._url,
            data=json.dumps(patch),
            headers={**headers, "Content-Type": "application/merge-patch+json"},
            ssl=self._api.ssl,
            timeout=_TIMEOUT,
        ) as answer:
            if answer.status == 409:
                return Activation.CONFLICT
            if answer.status == 403:
                return Activation.FORBIDDEN
            if answer.status != 200:
                logger.warning("scaling from zero: %s %s", answer.status, (await answer.text())[:200])
                return Activation.FAILED
        logger.info("no backend was ready: scaled the LLMDeployment from 0 to 1 replica")
        return Activation.SCALED
