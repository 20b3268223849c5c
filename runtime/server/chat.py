"""POST /v1/chat/completions: messages rendered with the model's chat template, n assistant replies."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvasir.runtime.engine.outputs import Completion
from kvasir.runtime.server.generation import Generation
from kvasir.runtime.server.generation_route import GenerationRoute, Reply, serve_generation
from kvasir.runtime.server.json_body import OffLoopJSONRoute
from kvasir.runtime.server.logprobs import TokenTexts, chat_logprobs
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

router = APIRouter(route_class=OffLoopJSONRoute)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """Answer the conversation; with `stream`, SSE chunks then `data: [DONE]`."""
    return await serve_generation(request, ChatRoute(body))


def render_chat(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids, rendered with the model's chat template (refused first when the
    messages cannot fit, whatever the template makes of them)."""
    state.check_chat_size(body.messages)
    return state.tokenizer.encode_chat(
        body.template_messages(),
        add_generation_prompt=body.add_generation_prompt,
        **(body.chat_template_kwargs or {}),
    )


class ChatRoute(GenerationRoute[ChatCompletionRequest]):
    """One conversation in, one rendered prompt; errors on it name `messages`."""

    operation = "chat"
    id_prefix = "chatcmpl"
    prompt_param = "messages"  # the rendered conversation is the prompt
    logprobs_param = "top_logprobs"

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.body.max_completion_tokens is not None else "max_tokens"

    def check_prompts(self) -> int:
        return 1

    async def prompts(self, state: ServerState) -> Sequence[list[int]]:
        return [await state.off_loop(lambda: render_chat(state, self.body))]

    def _chunk(self, reply: Reply, choices: list[ChatStreamChoice], *, usage: bool) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=reply.generation.response_id,
            created=reply.created,
            model=reply.model_name,
            choices=choices,
            usage=reply.generation.usage() if usage else None,
        )

    def whole(self, reply: Reply, results: list[list[Completion]]) -> ChatCompletionResponse:
        texts = reply.texts
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
            id=reply.generation.response_id,
            created=reply.created,
            model=reply.model_name,
            choices=choices,
            usage=reply.generation.usage(),
        )

    async def chunks(self, reply: Reply) -> AsyncGenerator[ChatCompletionChunk, None]:
        async for choice in _stream_choices(reply.generation, reply.texts):
            yield self._chunk(reply, [choice], usage=self.body.continuous_usage)

    def last_chunk(self, reply: Reply) -> ChatCompletionChunk | None:
        return self._chunk(reply, [], usage=True) if self.body.include_usage else None


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
