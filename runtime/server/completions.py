"""POST /v1/completions: a prompt (text, several texts, token ids) in, n choices per prompt out.

Choice indices run over prompts: prompt p's choice i is index p * n + i, as OpenAI and vLLM do.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvasir.runtime.engine.llm_engine import PreparedRequest
from kvasir.runtime.engine.outputs import Completion
from kvasir.runtime.server.generation import Generation
from kvasir.runtime.server.held_answer import check_held_answer
from kvasir.runtime.server.json_body import OffLoopJSONRoute
from kvasir.runtime.server.logprobs import TokenTexts, completion_logprobs
from kvasir.runtime.server.logs import request_log
from kvasir.runtime.server.protocol import CompletionRequest
from kvasir.runtime.server.responses import CompletionChoice, CompletionResponse
from kvasir.runtime.server.state import ServerState
from kvasir.runtime.server.streaming import respond
from kvasir.runtime.server.tracing import request_attributes

router = APIRouter(route_class=OffLoopJSONRoute)


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """Complete each prompt; with `stream`, SSE chunks then `data: [DONE]`."""
    arrival = time.monotonic()
    state: ServerState = request.app.state.kvasir
    state.check_model(body.model)
    params = body.sampling_params()
    prompts = body.prompts()
    state.require_engine()
    # Everything that can fail comes before admission, which holds capacity until the answer ends.
    texts = state.token_texts
    response_id = f"cmpl-{uuid.uuid4().hex}"
    prepared = await state.prepare(response_id, prompts, params, arrival=arrival)
    if not body.stream:
        check_held_answer(prepared, max_tokens_param="max_tokens", logprobs_param="logprobs")
    echoes = None
    if body.echo:  # decoded from the prepared ids: checked against the vocabulary by now
        echoes = await state.off_loop(
            lambda: [_prompt_text(state, p, r) for p, r in zip(prompts, prepared, strict=True)]
        )
    generation = state.admit(
        response_id,
        "text_completion",
        prepared,
        headers=request.headers,
        log=request_log(request.scope),
        span_attributes=request_attributes(params),
    )
    created = int(time.time())

    def response(choices: list[CompletionChoice], *, usage: bool) -> CompletionResponse:
        return CompletionResponse(
            id=generation.response_id,
            created=created,
            model=state.model_name,
            choices=choices,
            usage=generation.usage() if usage else None,
        )

    def whole(results: list[list[Completion]]) -> CompletionResponse:
        choices = []
        for prompt_index, prompt_choices in enumerate(results):
            prefix = echoes[prompt_index] if echoes else ""
            for choice in prompt_choices:
                logprobs = None
                if choice.logprobs is not None:
                    logprobs, _ = completion_logprobs(choice.logprobs, texts, len(prefix))
                choices.append(
                    CompletionChoice(
                        index=prompt_index * params.n + choice.index,
                        text=prefix + choice.text,
                        logprobs=logprobs,
                        finish_reason=choice.finish_reason,
                        stop_reason=choice.stop_reason,
                    )
                )
        return response(choices, usage=True)

    async def chunks() -> AsyncGenerator[CompletionResponse, None]:
        async for choice in _stream_choices(generation, texts, echoes):
            yield response([choice], usage=body.continuous_usage)

    return await respond(
        request,
        generation,
        stream=bool(body.stream),
        chunks=chunks,
        last_chunk=lambda: response([], usage=True) if body.include_usage else None,
        whole=whole,
    )


def _prompt_text(state: ServerState, prompt: str | list[int], prepared: PreparedRequest) -> str:
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(prepared.prompt_token_ids)


async def _stream_choices(
    generation: Generation, texts: TokenTexts, echoes: list[str] | None
) -> AsyncGenerator[CompletionChoice, None]:
    """Each choice's deltas as they come (the echoed prompts first)."""
    n = generation.n
    offsets: dict[int, int] = {}  # choice index -> text offset of its next token (logprobs)
    if echoes is not None:
        for prompt_index, echo in enumerate(echoes):
            for i in range(n):
                offsets[prompt_index * n + i] = len(echo)
                yield CompletionChoice(index=prompt_index * n + i, text=echo)
    async with aclosing(generation.outputs()) as outputs:
        async for prompt_index, output in outputs:
            for delta in output.outputs:
                index = prompt_index * n + delta.index
                logprobs = None
                if delta.logprobs is not None:
                    logprobs, offsets[index] = completion_logprobs(
                        delta.logprobs, texts, offsets.get(index, 0)
                    )
                if not delta.text and logprobs is None and delta.finish_reason is None:
                    continue  # the token's text is held back (a possible stop string, a split character)
                yield CompletionChoice(
                    index=index,
                    text=delta.text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
