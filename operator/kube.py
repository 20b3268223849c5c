"""A small async Kubernetes API client (aiohttp) built from kopf's ConnectionInfo: the only module
that talks to the API server for the reconciler; every other module is pure."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from kvasir.operator import naming

if TYPE_CHECKING:
    import kopf

MERGE_PATCH = "application/merge-patch+json"
# Statuses worth retrying: conflicts (someone else wrote first), throttling, and server-side faults.
TRANSIENT_STATUSES = frozenset({409, 429, 500, 502, 503, 504})


WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


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


class NotLeader(ApiError):
    """A write refused before it was sent: this replica may no longer act as the leader."""

    def __init__(self) -> None:
        super().__init__(0, "NotLeader", "leadership is not (or no longer) held; the write was not sent")

    @property
    def transient(self) -> bool:
        return False


class KubeClient:
    """Async JSON requests to one API server; `connect` (re)binds it to fresh credentials.

    `may_write`, when given, fences every mutating request: it is asked right before the request
    is sent, so a leader whose lease ran out stops writing at once, whatever is in flight above."""

    def __init__(
        self,
        request_timeout: float = 30.0,
        *,
        user_agent: str = naming.MANAGER,
        may_write: Callable[[], bool] | None = None,
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._server = ""
        self._session: aiohttp.ClientSession | None = None
        self._user_agent = user_agent
        self.may_write = may_write

    async def connect(self, info: kopf.ConnectionInfo) -> None:
        """Use these credentials from now on (called from kopf's login handler, also on re-login)."""
        old = self._session
        self._server = info.server.rstrip("/")
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers={**info.as_http_headers(), "User-Agent": self._user_agent},
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
        if method in WRITE_METHODS and self.may_write is not None and not self.may_write():
            raise NotLeader()
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

    async def replace(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT the whole object; its metadata.resourceVersion makes it fail with 409 if stale."""
        return await self.request("PUT", path, body, params={"fieldManager": naming.MANAGER})

    async def delete(self, path: str, uid: str | None = None) -> None:
        """Delete one object (in the background); with `uid`, only that incarnation of it."""
        options: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": "Background",
        }
        if uid:
            options["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", path, options)
        except ApiError as exc:
            if exc.status != 404:
                raise

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
