"""A path with a trailing slash that only names a route without it is redirected there, relatively.

Starlette's own redirect builds an absolute URL from the request's Host header, so whoever sends the
request (or forwards its Host) chooses where the redirect points. This one answers 307 with a
relative `Location` (the path less its trailing slashes, with the query), which the client resolves
against the URL it used; the path is percent-encoded afresh (a header carries no control bytes, and
an encoded slash cannot send the client back here), and it never starts with `//` (a browser reads
that as another host).
"""

from __future__ import annotations

from urllib.parse import quote

from starlette.routing import Match, Router
from starlette.types import ASGIApp, Receive, Scope, Send

# What stays as it is (RFC 3986): in the decoded path, pchar and "/"; in the query as sent, "%" escapes too.
_PATH_SAFE = "/:@!$&'()*+,;=-._~"
_QUERY_SAFE = _PATH_SAFE + "?%"


class TrailingSlashRedirect:
    def __init__(self, app: ASGIApp, router: Router) -> None:
        self.app = app
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        location = self._redirect(scope) if scope["type"] == "http" else None
        if location is None:
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 307, "headers": [(b"location", location)]})
        await send({"type": "http.response.body", "body": b""})

    def _redirect(self, scope: Scope) -> bytes | None:
        path: str = scope["path"]
        if path == "/" or not path.endswith("/") or self._matches(scope):
            return None
        if not self._matches({**scope, "path": path.rstrip("/")}):
            return None
        target = quote("/" + path.strip("/"), safe=_PATH_SAFE)
        if scope.get("query_string"):
            target += "?" + quote(scope["query_string"], safe=_QUERY_SAFE)
        return target.encode("ascii")

    def _matches(self, scope: Scope) -> bool:
        return any(route.matches(scope)[0] is not Match.NONE for route in self.router.routes)
