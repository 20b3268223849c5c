"""The optional API key: `Authorization: Bearer KEY` on the API routes; the probes stay open.

The key is checked before anything about the request is: a client without it learns nothing from
the server's validation (`OffLoopJSONRoute` checks it before it parses a body, and the route's
dependency checks it again for FastAPI's own parameters)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvasir.runtime.server.errors import APIError

# auto_error=False: a missing header is our 401 in the OpenAI shape, not FastAPI's 403.
bearer = HTTPBearer(
    auto_error=False, description="The server's API key (--api-key / KVASIR_API_KEY), if set."
)


async def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    """401 unless the server has no key or the request carries it (compared in constant time)."""
    check_api_key(request, credentials)


async def authenticate(request: Request) -> None:
    """`require_api_key` outside FastAPI's dependency resolution (before the body is parsed)."""
    check_api_key(request, await bearer(request))


def check_api_key(request: Request, credentials: HTTPAuthorizationCredentials | None) -> None:
    expected: str | None = request.app.state.kvasir.config.api_key
    if expected is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise APIError(
            401,
            "Missing API key (Authorization: Bearer ...)" if not given else "Incorrect API key provided.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
