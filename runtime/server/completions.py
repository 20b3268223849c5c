"""POST /v1/completions: a prompt (text, several texts, token ids) in, n choices per prompt out.

Choice indices run over prompts: prompt p's choice i is index p * n + i, as OpenAI and vLLM do.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvasir.runtime.engine.llm_engine import PreparedRequest
from kvasir.runtime.engine.outputs import Completion
from kvasir.runtime.server.generation import Generation
from kvasir.runtime.server.generation_route import GenerationRoute, Reply, serve_generation
from kvasir.runtime.server.json_body import OffLoopJSONRoute
from kvasir.runtime.server.logprobs import TokenTexts, completion_logprobs
from kvasir.runtime.server.protocol import CompletionRequest
from kvasir.runtime.server.responses import CompletionChoice, CompletionResponse
from kvasir.runtime.server.state import ServerState

router = APIRouter(route_class=OffLoopJSONRoute)


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """Complete each prompt; with `stream`, SSE chunks then `data: [DONE]`."""
    return await serve_generation(request, CompletionRoute(body))


class CompletionRoute(GenerationRoute[CompletionRequest]):
    """Prompts as given; with `echo`, each prompt's text leads its choices."""

    operation = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, body: CompletionRequest) -> None:
        super().__init__(body)
        self._prompts: list[str | list[int]] | None = None
        self._echoes: list[str] | None = None

    def check_prompts(self) -> int:
        self._prompts = self.body.prompts()  # 400 on a malformed prompt, before anything else
        return len(self._prompts)

    async def prompts(self, state: ServerState) -> Sequence[str | list[int]]:
        assert self._prompts is not None, "check_prompts() runs first"
        return self._prompts

    async def prepared(self, state: ServerState, prepared: list[PreparedRequest]) -> None:
        if not self.body.echo:
            return
        prompts = self._prompts or []
        # Decoded from the prepared ids: checked against the vocabulary by now.
        self._echoes = await state.off_loop(
            lambda: [_prompt_text(state, p, r) for p, r in zip(prompts, prepared, strict=True)]
        )

    def _response(self, reply: Reply, choices: list[CompletionChoice], *, usage: bool) -> CompletionResponse:
        return CompletionResponse(
            id=reply.generation.response_id,
            created=reply.created,
            model=reply.model_name,
            choices=choices,
            usage=reply.generation.usage() if usage else None,
        )

    def whole(self, reply: Reply, results: list[list[Completion]]) -> CompletionResponse:
        echoes, n = self._echoes, reply.params.n
        choices = []
        for prompt_index, prompt_choices in enumerate(results):
            prefix = echoes[prompt_index] if echoes else ""
            for choice in prompt_choices:
                logprobs = None
                if choice.logprobs is not None:
                    logprobs, _ = completion_logprobs(choice.logprobs, reply.texts, len(prefix))
                choices.append(
                    CompletionChoice(
                        index=prompt_index * n + choice.index,
                        text=prefix + choice.text,
                        logprobs=logprobs,
                        finish_reason=choice.finish_reason,
                        stop_reason=choice.stop_reason,
                    )
                )
        return self._response(reply, choices, usage=True)

    async def chunks(self, reply: Reply) -> AsyncGenerator[CompletionResponse, None]:
        async for choice in _stream_choices(reply.generation, reply.texts, self._echoes):
            yield self._response(reply, [choice], usage=self.body.continuous_usage)

    def last_chunk(self, reply: Reply) -> CompletionResponse | None:
        return self._response(reply, [], usage=True) if self.body.include_usage else None


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
