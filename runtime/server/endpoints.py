"""The small endpoints: models, tokenize/detokenize, LoRA adapter loading (behind the API key), and
the open probes.

/health is liveness: 200 while the process can serve or is still loading, 503 once the model
failed to load or the engine loop died (a restart is the cure). /ready is readiness: 200 only
when the model is loaded, warmed up and the server is not draining.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kvasir.runtime.engine.async_engine import AsyncEngine
from kvasir.runtime.engine.lora_registry import LoRARegistryError
from kvasir.runtime.engine.prompt_check import ContextLengthError
from kvasir.runtime.loader.errors import (
    HubAccessError,
    HubNotFoundError,
    HubUnavailableError,
    ModelLoadError,
)
from kvasir.runtime.lora.errors import LoRAAdapterError
from kvasir.runtime.lora.modules import (
    AdapterPathNotFoundError,
    HubAdapter,
    is_hub_path,
    parse_hub_adapter,
    resolve_adapter_path,
)
from kvasir.runtime.server.errors import APIError
from kvasir.runtime.server.json_body import OffLoopJSONRoute
from kvasir.runtime.server.lifecycle import Phase
from kvasir.runtime.server.protocol import (
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from kvasir.runtime.server.responses import (
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from kvasir.runtime.server.state import ServerState

logger = logging.getLogger(__name__)

api_router = APIRouter(route_class=OffLoopJSONRoute)  # behind the API key
probe_router = APIRouter()  # always open


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvasir
    return state


def _model_card(state: ServerState) -> ModelCard:
    engine = state.loaded_engine()
    return ModelCard(
        id=state.model_name,
        created=state.created,
        root=public_root(state.engine_config.model),
        max_model_len=engine.max_model_len,
    )


def _adapter_cards(state: ServerState) -> list[ModelCard]:
    """A card per LoRA adapter serving now: `parent` is the base model's served name; `root` the
    adapter directory's last part (as the base model's: the server's layout stays its own), or for
    a hub adapter its `org/name[@revision]`."""
    engine = state.loaded_engine()
    return [
        ModelCard(
            id=lora.name,
            created=state.created,
            root=lora.hub_id or public_root(lora.path),
            parent=state.model_name,
            max_model_len=engine.max_model_len,
        )
        for lora in engine.lora_adapters()
    ]


def public_root(model: str) -> str:
    """What `root` says of the model: a Hub id as given, a local path by its last part only (the
    server's directory layout is nobody's business)."""
    if os.path.isabs(model) or model.startswith((".", "~")) or os.path.exists(model):
        return os.path.basename(os.path.normpath(model)) or model
    return model


@api_router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    return ModelList(data=[_model_card(state), *_adapter_cards(state)])


@api_router.get("/v1/models/{model:path}", response_model=ModelCard)
async def retrieve_model(model: str, request: Request) -> ModelCard:
    state = _state(request)
    state.check_model(model)
    for card in _adapter_cards(state):
        if card.id == model:
            return card
    return _model_card(state)


@api_router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Load a LoRA adapter from the allow-listed root (vLLM's API; the answer is plain text)."""
    state = _state(request)
    engine = _lora_engine(state)
    root = state.config.lora_root
    if root is None:
        raise APIError(
            400,
            "Loading adapters at run time is off: start the server with --lora-root DIR.",
            param="lora_path",
        )
    path: str | HubAdapter
    if is_hub_path(body.lora_path):  # downloaded on the loader thread, like a local load's reading
        try:
            path = parse_hub_adapter(body.lora_path, body.revision)
        except ValueError as error:
            raise APIError(400, f"lora_path {error}", param="lora_path") from None
    elif body.revision is not None:
        raise APIError(400, "revision applies only to an hf://org/name lora_path.", param="revision")
    else:
        try:  # realpath and isdir touch the file system: off the event loop
            path = await state.off_loop(lambda: resolve_adapter_path(body.lora_path, root))
        except AdapterPathNotFoundError as error:
            raise APIError(404, str(error), param="lora_path", code="not_found") from None
        except ValueError as error:
            raise APIError(400, str(error), param="lora_path") from None
    try:
        lora, seconds = await engine.load_lora(body.lora_name, path, replace=body.load_inplace)
    except LoRARegistryError as error:
        raise APIError(error.status, str(error), param="lora_name") from None
    except LoRAAdapterError as error:
        raise APIError(
            400, f"The LoRA adapter '{body.lora_name}' cannot be served: {error}", param="lora_path"
        ) from None
    except ModelLoadError as error:
        raise _download_error(error, body.lora_name, body.lora_path) from None
    state.metrics.lora_loaded(seconds)
    return PlainTextResponse(f"Success: LoRA adapter '{lora.name}' added successfully.")


@api_router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Stop serving an adapter: new requests for it get 404 at once; its requests in flight get
    --lora-unload-timeout seconds to end, past which the unload is refused (409) and it serves on."""
    state = _state(request)
    engine = _lora_engine(state)
    try:
        lora = await engine.unload_lora(body.lora_name, state.config.lora_unload_timeout)
    except LoRARegistryError as error:
        code = "not_found" if error.status == 404 else None
        raise APIError(error.status, str(error), param="lora_name", code=code) from None
    state.metrics.lora_unloaded(lora.name)
    return PlainTextResponse(f"Success: LoRA adapter '{lora.name}' removed successfully.")


def _download_error(error: ModelLoadError, name: str, source: str) -> APIError:
    """The answer to a failed hub download: 404 no such repository or revision, 403 gated, 503 the
    hub unreachable or offline mode on (and not cached), 502 anything else. The client's message
    names the source as given; the loader's own (with the server's cache directory) is logged."""
    logger.warning("LoRA adapter %r: %s", name, error)
    where = f"The LoRA adapter '{name}' ({source!r})"
    if isinstance(error, HubNotFoundError):
        message = (
            f"{where} was not found on the Hugging Face hub: no such repository or revision, "
            "or it is private and the server's token (HF_TOKEN) cannot read it."
        )
        return APIError(404, message, param="lora_path", code="not_found")
    if isinstance(error, HubAccessError):
        message = (
            f"{where} is gated on the Hugging Face hub: accept its licence for the server's token (HF_TOKEN)."
        )
        return APIError(403, message, param="lora_path")
    if isinstance(error, HubUnavailableError):
        reason = (
            "offline mode is on (HF_HUB_OFFLINE=1)"
            if error.offline
            else "the Hugging Face hub cannot be reached"
        )
        return APIError(503, f"{where} cannot be downloaded: {reason}, and it is not in the download cache.")
    return APIError(
        502, f"{where}: the download from the Hugging Face hub failed (the server's log says why)."
    )


def _lora_engine(state: ServerState) -> AsyncEngine:
    """The engine, once LoRA is known to be on: 400 without --enable-lora, 503 loading or draining."""
    if not state.engine_config.enable_lora:
        raise APIError(400, "LoRA adapters are off: start the server with --enable-lora.", param="lora_name")
    state.lifecycle.check_open(count=False)
    return state.loaded_engine()


@api_router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """Token ids of `prompt`, or of `messages` rendered with the chat template."""
    state = _state(request)
    state.check_model(body.model)
    state.lifecycle.check_open(count=False)  # draining: send it to a replica that stays
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "Give exactly one of prompt or messages.", param="prompt")
    tokenizer = state.tokenizer
    prompt, messages = body.prompt, body.messages
    max_model_len = state.loaded_engine().max_model_len

    def encode() -> list[int]:
        if messages is not None:
            state.check_chat_size(messages)
            return tokenizer.encode_chat(
                [m.template_dict() for m in messages], add_generation_prompt=body.add_generation_prompt
            )
        state.check_prompt_chars(len(prompt or ""))
        return tokenizer.encode(prompt or "", add_special_tokens=body.add_special_tokens)

    tokens = await state.off_loop(encode)
    if len(tokens) > max_model_len:  # what no request could use is not worth sending back either
        raise ContextLengthError(
            "messages" if messages is not None else "prompt",
            f"This model's maximum context length is {max_model_len} tokens; this text has {len(tokens)}.",
        )
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=max_model_len)


@api_router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = _state(request)
    state.check_model(body.model)
    state.lifecycle.check_open(count=False)
    vocab_size = state.loaded_engine().vocab_size
    tokens, tokenizer = body.tokens, state.tokenizer

    def decode() -> str:  # up to a million ids (json_shape.MAX_VALUES): not on the event loop
        for token in tokens:
            if not 0 <= token < vocab_size:
                raise APIError(
                    400, f"token id {token} is outside the vocabulary [0, {vocab_size})", param="tokens"
                )
        return tokenizer.decode(tokens)

    return DetokenizeResponse(prompt=await state.off_loop(decode))


@probe_router.get("/health", response_model=HealthResponse)
async def health(request: Request) -> JSONResponse:
    state = _state(request)
    engine_dead = state.engine is not None and not state.engine.is_running
    if state.lifecycle.phase is Phase.FAILED or engine_dead:
        return JSONResponse({"status": "unhealthy"}, status_code=503)
    return JSONResponse({"status": "ok"})


@probe_router.get("/ready", response_model=HealthResponse)
async def ready(request: Request) -> JSONResponse:
    state = _state(request)
    phase = state.lifecycle.phase
    if phase is Phase.READY and state.engine is not None and not state.engine.is_running:
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    return JSONResponse({"status": phase.value}, status_code=200 if phase is Phase.READY else 503)


@probe_router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition format."""
    state = _state(request)
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


def kvasir_version() -> str:
    try:
        return version("kvasir")
    except PackageNotFoundError:
        return "unknown"


@probe_router.get("/version", response_model=VersionResponse)
async def server_version() -> VersionResponse:
    return VersionResponse(version=kvasir_version())
