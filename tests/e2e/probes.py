"""Container probes as a kubelet runs them, against a pod's loopback address: httpGet (2xx/3xx is
success) and tcpSocket; exec and gRPC probes count as passing (there is no container to exec in)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp

MAX_PERIOD = 1.0  # seconds: probes run at most this far apart, to keep the tests fast


def period(probe: dict[str, Any] | None) -> float:
    """How often to run `probe`: its periodSeconds (default 10), capped at MAX_PERIOD."""
    return min(float((probe or {}).get("periodSeconds") or 10), MAX_PERIOD)


def resolve_port(port: int | str, container: dict[str, Any]) -> int | None:
    """A probe's port: a number, or the name of one of the container's ports (None if no such port)."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.get("ports") or []:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    return None


async def passes(
    session: aiohttp.ClientSession, probe: dict[str, Any], container: dict[str, Any], ip: str
) -> bool:
    """Run `probe` once; True if it succeeds."""
    timeout = min(float(probe.get("timeoutSeconds") or 1), MAX_PERIOD)
    action = probe.get("httpGet") or probe.get("tcpSocket")
    if action is None:
        return True
    port = resolve_port(action.get("port", 0), container)
    if port is None:
        return False
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
        if "httpGet" in probe:
            scheme = str(action.get("scheme", "HTTP")).lower()
            headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
            url = f"{scheme}://{ip}:{port}{action.get('path', '/')}"
            async with session.get(
                url,
                headers=headers,
                ssl=False,
                timeout=aiohttp.ClientTimeout(total=timeout),
                allow_redirects=False,
            ) as response:
                return 200 <= response.status < 400
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
        writer.close()
        return True
    return False
