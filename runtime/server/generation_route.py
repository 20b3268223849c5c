"""The one path both generation routes take, /v1/completions and /v1/chat/completions.

    check the model and the parameters -> the engine, once (503 while loading or draining)
    -> admission prechecked, once (400 never fits, 429 full), before the expensive work
    -> what the route adds to the parameters (chat: its tools checked, their grammar)
    -> the prompts (chat: rendered with the template) -> validated and tokenized off the loop
    -> a non-streamed answer's size bounded -> admitted (holding capacity until the answer ends)
    -> SSE chunks then `data: [DONE]`, or one JSON body

Everything that can fail comes before admission. Admission itself still checks, since the awaits
since the precheck let other requests in; the precheck is what answers a full server at once
instead of after rendering and tokenizing. A route supplies what differs: its prompts, the field
names its errors use, and the shape of its chunks and body.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvasir.runtime.engine.llm_engine import PreparedRequest
from kvasir.runtime.engine.lora_registry import LoRALease
from kvasir.runtime.engine.outputs import Completion
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from kvasir.runtime.server.generation import Generation
from kvasir.runtime.server.held_answer import check_held_answer
from kvasir.runtime.server.logprobs import TokenTexts
from kvasir.runtime.server.logs import request_log
from kvasir.runtime.server.protocol import GenerationBody
from kvasir.runtime.server.state import ServerState
from kvasir.runtime.server.streaming import respond
from kvasir.runtime.server.tracing import request_attributes

BodyT = TypeVar("BodyT", bound=GenerationBody)


@dataclass(frozen=True)
class Reply:
    """What every chunk and body of one answer carries."""

    generation: Generation
    texts: TokenTexts  # per-token text, for logprobs
    params: SamplingParams
    model_name: str
    created: int  # the answer's Unix time, the same in every chunk


class GenerationRoute(ABC, Generic[BodyT]):
    """What a generation route adds to the shared path; one instance per request."""

    operation: ClassVar[str]  # the span's operation name
    id_prefix: ClassVar[str]  # of the response id, e.g. "cmpl"
    prompt_param: ClassVar[str] = "prompt"  # the field a 400 on the prompt names
    logprobs_param: ClassVar[str] = "logprobs"

    def __init__(self, body: BodyT) -> None:
        self.body = body

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    async def model_params(self, state: ServerState, params: SamplingParams) -> SamplingParams:
        """The parameters once the model is known, with what the route adds (chat: its tools, checked
        off the loop, their grammar, and what the model's tool-call format asks); as given by default."""
        return params

    @abstractmethod
    def check_prompts(self) -> int:
        """Check the prompts' shape (400) before the engine is asked for; returns how many (each gets n choices)."""

    @abstractmethod
    async def prompts(self, state: ServerState) -> Sequence[str | list[int]]:
        """The prompts to tokenize (text) or check (token ids); refused with a 400 when they cannot fit."""

    async def prepared(self, state: ServerState, prepared: list[PreparedRequest]) -> None:
        """Work on the prepared prompts before admission (the completions route's echo); none by default."""

    @abstractmethod
    def whole(self, reply: Reply, results: list[list[Completion]]) -> BaseModel:
        """The non-streamed body from each prompt's finished choices."""

    @abstractmethod
    def chunks(self, reply: Reply) -> AsyncGenerator[BaseModel, None]:
        """The streamed chunks, from `reply.generation.outputs()`."""

    @abstractmethod
    def last_chunk(self, reply: Reply) -> BaseModel | None:
        """The chunk after the last choice's end (the usage chunk), or None."""


async def serve_generation(request: Request, route: GenerationRoute[BodyT]) -> Response:
    """Answer one generation request along the shared path (see the module's docstring)."""
    arrival = time.monotonic()
    state: ServerState = request.app.state.kvasir
    body = route.body
    lease = state.lease_model(body.model)  # the adapter, held until the answer ends (None: base)
    try:
        generation, params, texts = await _admitted(request, route, state, arrival, lease)
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    model_name = state.model_name if lease is None else lease.lora.name
    reply = Reply(generation, texts, params, model_name, int(time.time()))
    return await respond(
        request,
        generation,
        stream=bool(body.stream),
        chunks=lambda: route.chunks(reply),
        last_chunk=lambda: route.last_chunk(reply),
        whole=lambda results: route.whole(reply, results),
    )


async def _admitted(
    request: Request,
    route: GenerationRoute[BodyT],
    state: ServerState,
    arrival: float,
    lease: LoRALease | None,
) -> tuple[Generation, SamplingParams, TokenTexts]:
    """Everything up to admission (checks, prompts, tokenizing): the admitted generation, its
    parameters and the per-token texts."""
    body = route.body
    params = body.sampling_params()
    num_prompts = route.check_prompts()
    engine = state.require_engine()
    state.lifecycle.precheck(num_prompts * params.n)  # a full server says 429 before the prompts' work
    params = await route.model_params(state, params)
    prompts = await route.prompts(state)
    texts = state.token_texts  # before admission, which holds capacity until the answer ends
    response_id = f"{route.id_prefix}-{uuid.uuid4().hex}"
    try:
        prepared = await state.prepare(
            engine,
            response_id,
            prompts,
            params,
            arrival=arrival,
            lora=None if lease is None else lease.lora,
            cache_salt=body.cache_salt,
        )
    except InvalidParameterError as error:
        if error.param == "prompt" and route.prompt_param != "prompt":
            raise InvalidParameterError(route.prompt_param, error.message) from None
        raise
    if not body.stream:
        check_held_answer(
            prepared, max_tokens_param=route.max_tokens_param, logprobs_param=route.logprobs_param
        )
    await route.prepared(state, prepared)
    generation = state.admit(
        engine,
        response_id,
        route.operation,
        prepared,
        headers=request.headers,
        log=request_log(request.scope),
        span_attributes=request_attributes(params),
        lora_lease=lease,
    )
    return generation, params, texts
