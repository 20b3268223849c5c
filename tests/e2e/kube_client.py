"""A small asynchronous JSON client of the Kubernetes API (aiohttp), for the node agent: requests,
and watch streams read line by line."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from tests.e2e.kubeconfig import Access

REQUEST_TIMEOUT = 30.0
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    """The API server answered with a status outside 2xx; `status` is the HTTP code."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {body[:1000]}")
        self.status = status
        self.body = body


class KubeClient:
    """JSON in, JSON out, ApiError on any non-2xx answer; use as an async context manager."""

    def __init__(self, access: Access) -> None:
        self._access = access
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeClient:
        self._session = aiohttp.ClientSession(
            base_url=self._access.server,
            headers=self._access.headers(),
            connector=aiohttp.TCPConnector(ssl=self._access.ssl_context()),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("KubeClient used outside `async with`")
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
        async with self.session.request(
            method, path, data=data, params=params, headers=headers, timeout=timeout
        ) as response:
            text = await response.text()
            if response.status >= 300:
                raise ApiError(method, path, response.status, text)
            return json.loads(text) if text else None

    async def watch(self, path: str, params: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request (`watch=1` is added), until the server ends the stream."""
        server_timeout = float(params.get("timeoutSeconds", "300"))
        # No total limit: a watch is long by design; a silent connection is cut after its own timeout.
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=REQUEST_TIMEOUT, sock_read=server_timeout + 30
        )
        async with self.session.get(path, params={**params, "watch": "1"}, timeout=timeout) as response:
            if response.status >= 300:
                raise ApiError("WATCH", path, response.status, await response.text())
            # Objects can exceed aiohttp's line limit, so lines are split here.
            pending = b""
            async for chunk in response.content.iter_any():
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
