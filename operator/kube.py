"""A small async Kubernetes API client (aiohttp) built from kopf's ConnectionInfo: the only module
that talks to the API server for the reconciler; every other module is pure."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from kvasir.operator import naming

if TYPE_CHECKING:
    import kopf

MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
# Statuses worth retrying: conflicts (someone else wrote first), throttling, and server-side faults.
TRANSIENT_STATUSES = frozenset({409, 429, 500, 502, 503, 504})


class ApiError(Exception):
    """A non-2xx answer (or a transport failure, status 0) from the Kubernetes API."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def transient(self) -> bool:
        return self.status == 0 or self.status in TRANSIENT_STATUSES


def resource_path(
    group: str,
    version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a collection, an object or an object's subresource."""
    path = f"/apis/{group}/{version}" if group else f"/api/{version}"
    if namespace is not None:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name is not None:
        path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
    return path


class KubeClient:
    """Async JSON requests to one API server; `connect` (re)binds it to fresh credentials."""

    def __init__(self, request_timeout: float = 30.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._server = ""
        self._session: aiohttp.ClientSession | None = None

    async def connect(self, info: kopf.ConnectionInfo) -> None:
        """Use these credentials from now on (called from kopf's login handler, also on re-login)."""
        old = self._session
        self._server = info.server.rstrip("/")
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers={**info.as_http_headers(), "User-Agent": naming.MANAGER},
            timeout=self._timeout,
        )
        if old is not None:
            await old.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """One request; the decoded JSON answer, or ApiError."""
        if self._session is None:
            raise ApiError(0, "NotConnected", "the client has no credentials yet")
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        try:
            async with self._session.request(
                method, self._server + path, data=data, headers=headers, params=params
            ) as response:
                text = await response.text()
                payload = _decode(text)
                if response.status >= 400:
                    raise ApiError(
                        response.status,
                        str(payload.get("reason") or response.reason or "Error"),
                        str(payload.get("message") or text[:500]),
                    )
                return payload
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ApiError(0, type(exc).__name__, str(exc) or "request failed") from exc

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object at `path`, or None when it does not exist."""
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body, params={"fieldManager": naming.MANAGER})

    async def apply(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply of the whole desired object; the operator owns every field it sends."""
        params = {"fieldManager": naming.MANAGER, "force": "true"}
        return await self.request("PATCH", path, body, content_type=APPLY_PATCH, params=params)

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, body, content_type=MERGE_PATCH)

    async def has_resource(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves this resource (discovery; needs no RBAC)."""
        found = await self.get(f"/apis/{group}/{version}" if group else f"/api/{version}")
        return any(res.get("name") == plural for res in (found or {}).get("resources") or [])


def _decode(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
