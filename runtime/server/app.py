"""The FastAPI application: routes, error handlers, access log, and the lifespan that owns the engine.

Nothing heavy happens at import or in `build_app`: the lifespan starts loading the engine (on a
daemon thread, see `state.py`) and shuts it down when the server stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.async_engine import AsyncEngine
from kvasir.runtime.server import chat, completions, endpoints
from kvasir.runtime.server.auth import require_api_key
from kvasir.runtime.server.body_limit import BodySizeLimitMiddleware
from kvasir.runtime.server.config import ServerConfig
from kvasir.runtime.server.errors import install_error_handlers
from kvasir.runtime.server.logs import AccessLogMiddleware
from kvasir.runtime.server.responses import ErrorResponse
from kvasir.runtime.server.state import EngineFactory, ServerState
from kvasir.runtime.server.tracing import provider_from_env
from kvasir.runtime.server.trailing_slash import TrailingSlashRedirect

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request; `param` names the field"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    429: {"model": ErrorResponse, "description": "Queue full; see the Retry-After header"},
    503: {"model": ErrorResponse, "description": "Loading or draining; see the Retry-After header"},
}


def build_app(
    engine_config: EngineConfig,
    config: ServerConfig | None = None,
    *,
    engine_factory: EngineFactory | None = None,
    tracer_provider: TracerProvider | None = None,
    on_fatal: Any = None,
) -> FastAPI:
    """The app serving `engine_config`'s model. `engine_factory` (default: build an LLMEngine) runs on
    a loading thread; `tracer_provider` overrides the OTEL_* setup; `on_fatal()` is called when the
    model cannot be loaded (the runner then exits non-zero)."""
    config = config or ServerConfig()
    if engine_factory is None:

        def engine_factory() -> AsyncEngine:
            from kvasir.runtime.engine.llm_engine import LLMEngine

            return AsyncEngine(LLMEngine(engine_config))

    owned_provider = provider_from_env() if tracer_provider is None else None
    state = ServerState(
        engine_config,
        config,
        engine_factory,
        tracer_provider=tracer_provider or owned_provider,
        on_fatal=on_fatal or (lambda: None),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.load())
        try:
            yield
        finally:
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
            await state.close()
            if owned_provider is not None:
                owned_provider.shutdown()  # flushes the spans still batched

    app = FastAPI(
        title="Kvasir",
        summary="OpenAI-compatible LLM inference",
        version=endpoints.kvasir_version(),
        lifespan=lifespan,
        redoc_url=None,
        redirect_slashes=False,  # TrailingSlashRedirect does it without trusting the Host header
    )
    app.state.kvasir = state
    install_error_handlers(app)
    secured = {"dependencies": [Depends(require_api_key)], "responses": _ERROR_RESPONSES}
    app.include_router(completions.router, **secured)  # type: ignore[arg-type]
    app.include_router(chat.router, **secured)  # type: ignore[arg-type]
    app.include_router(endpoints.api_router, **secured)  # type: ignore[arg-type]
    app.include_router(endpoints.probe_router)
    app.add_middleware(TrailingSlashRedirect, router=app.router)
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=config.max_request_bytes,
        max_buffered_bytes=config.max_buffered_request_bytes,
        retry_after=config.retry_after,
    )
    app.add_middleware(AccessLogMiddleware)  # outermost: refused bodies are logged too
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without its 422 answers: validation errors are 400 in the OpenAI shape here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
