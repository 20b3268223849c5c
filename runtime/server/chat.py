"""POST /v1/chat/completions: messages rendered with the model's chat template, n assistant replies."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvasir.runtime.engine.outputs import Completion
from kvasir.runtime.sample.params import InvalidParameterError
from kvasir.runtime.server.generation import Generation
from kvasir.runtime.server.held_answer import check_held_answer
from kvasir.runtime.server.json_body import OffLoopJSONRoute
from kvasir.runtime.server.logprobs import TokenTexts, chat_logprobs
from kvasir.runtime.server.logs import request_log
from kvasir.runtime.server.protocol import ChatCompletionRequest
from kvasir.runtime.server.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatStreamChoice,
)
from kvasir.runtime.server.state import ServerState
from kvasir.runtime.server.streaming import respond
from kvasir.runtime.server.tracing import request_attributes

router = APIRouter(route_class=OffLoopJSONRoute)


def render_chat(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids, rendered with the model's chat template (refused first when the
    messages cannot fit, whatever the template makes of them)."""
    state.check_chat_size(body.messages)
    return state.tokenizer.encode_chat(
        body.template_messages(),
        add_generation_prompt=body.add_generation_prompt,
        **(body.chat_template_kwargs or {}),
    )


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """Answer the conversation; with `stream`, SSE chunks then `data: [DONE]`."""
    arrival = time.monotonic()
    state: ServerState = request.app.state.kvasir
    state.check_model(body.model)
    params = body.sampling_params()
    state.require_engine()
    state.lifecycle.precheck(params.n)  # a full server says 429 before rendering and tokenizing
    token_ids = await state.off_loop(lambda: render_chat(state, body))
    texts = state.token_texts  # before admission, which holds capacity until the answer ends
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        prepared = await state.prepare(response_id, [token_ids], params, arrival=arrival)
    except InvalidParameterError as error:
        if error.param == "prompt":  # the rendered conversation is the prompt
            raise InvalidParameterError("messages", error.message) from None
        raise
    if not body.stream:
        newer = body.max_completion_tokens is not None
        check_held_answer(
            prepared,
            max_tokens_param="max_completion_tokens" if newer else "max_tokens",
            logprobs_param="top_logprobs",
        )
    generation = state.admit(
        response_id,
        "chat",
        prepared,
        headers=request.headers,
        log=request_log(request.scope),
        span_attributes=request_attributes(params),
    )
    created = int(time.time())

    def chunk(choices: list[ChatStreamChoice], *, usage: bool) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=generation.response_id,
            created=created,
            model=state.model_name,
            choices=choices,
            usage=generation.usage() if usage else None,
        )

    def whole(results: list[list[Completion]]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=choice.index,
                message=ChatResponseMessage(content=choice.text),
                logprobs=chat_logprobs(choice.logprobs, texts) if choice.logprobs is not None else None,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for choice in results[0]
        ]
        return ChatCompletionResponse(
            id=generation.response_id,
            created=created,
            model=state.model_name,
            choices=choices,
            usage=generation.usage(),
        )

    async def chunks() -> AsyncGenerator[ChatCompletionChunk, None]:
        async for choice in _stream_choices(generation, texts):
            yield chunk([choice], usage=body.continuous_usage)

    return await respond(
        request,
        generation,
        stream=bool(body.stream),
        chunks=chunks,
        last_chunk=lambda: chunk([], usage=True) if body.include_usage else None,
        whole=whole,
    )


async def _stream_choices(
    generation: Generation, texts: TokenTexts
) -> AsyncGenerator[ChatStreamChoice, None]:
    """Each choice's deltas as they come, each choice opened by a delta with only the role (as OpenAI)."""
    for index in range(generation.n):
        yield ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content=""))
    async with aclosing(generation.outputs()) as outputs:
        async for _, output in outputs:
            for delta in output.outputs:
                logprobs = chat_logprobs(delta.logprobs, texts) if delta.logprobs is not None else None
                if not delta.text and logprobs is None and delta.finish_reason is None:
                    continue  # the token's text is held back (a possible stop string, a split character)
                yield ChatStreamChoice(
                    index=delta.index,
                    delta=ChatDelta(content=delta.text or None),
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
