"""POST /v1/chat/completions: messages rendered with the model's chat template, n assistant replies."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvasir.runtime.engine.outputs import Completion
from kvasir.runtime.loader.tokenizer import Tokenizer
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from kvasir.runtime.server.chat_size import text_chars
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
from kvasir.runtime.server.tool_calls import (
    StreamedChoice,
    ToolPlan,
    constrained_tool_schemas,
    finish_reason,
    new_parser,
    parse_choice,
    plan_tools,
    stream_choices,
    strict_auto_grammar,
)

router = APIRouter(route_class=OffLoopJSONRoute)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """Answer the conversation; with `stream`, SSE chunks then `data: [DONE]`."""
    return await serve_generation(request, ChatRoute(body))


def render_chat(state: ServerState, body: ChatCompletionRequest, tools: ToolPlan | None = None) -> list[int]:
    """The prompt's token ids, rendered with the model's chat template (refused first when the
    messages cannot fit, whatever the template makes of them); the tools as `tools`."""
    state.check_chat_size(body.messages)
    variables: dict[str, Any] = dict(body.chat_template_kwargs or {})
    if tools is not None:  # rendered with the messages: their text and the tools' count together
        chars = sum(message.content_chars() for message in body.messages)
        state.check_prompt_chars(chars + text_chars(tools.template_tools), "tools")
        variables["tools"] = tools.template_tools
    return state.tokenizer.encode_chat(
        body.template_messages(), add_generation_prompt=body.add_generation_prompt, **variables
    )


class ChatRoute(GenerationRoute[ChatCompletionRequest]):
    """One conversation in, one rendered prompt; errors on it name `messages`."""

    operation = "chat"
    id_prefix = "chatcmpl"
    prompt_param = "messages"  # the rendered conversation is the prompt
    logprobs_param = "top_logprobs"

    def __init__(self, body: ChatCompletionRequest) -> None:
        super().__init__(body)
        self.tools: ToolPlan | None = None
        self.parser: str | None = None  # what reads the calls from each choice's tokens; None: nothing
        self._tokenizer: Tokenizer | None = None

    @property
    def _skip_special_tokens(self) -> bool:
        return self.body.skip_special_tokens is not False

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.body.max_completion_tokens is not None else "max_tokens"

    async def model_params(self, state: ServerState, params: SamplingParams) -> SamplingParams:
        """The tools checked (their schemas too: off the loop), the calls' grammar for `required` or
        a named tool, and the parser that reads the calls (`--tool-call-parser`, or the template's)."""
        body = self.body
        self.tools = tools = await state.off_loop(
            lambda: plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        )
        if tools is None:
            return params
        self._tokenizer = state.tokenizer
        self.parser = tools.parser_name(state.config.tool_call_parser, self._tokenizer.chat_template)
        grammar = tools.structured_outputs
        if grammar is not None and params.structured_outputs is not None:  # one grammar per request
            raise InvalidParameterError(
                "tool_choice",
                "'required' or a named tool cannot be combined with response_format or structured_outputs",
            )
        if (
            grammar is None
            and self.parser is not None
            and params.structured_outputs is None
            and any(tool.strict for tool in tools.tools)
        ):
            grammar = strict_auto_grammar(tools, self.parser, self._tokenizer)
        if grammar is None:
            return params
        engine = state.loaded_engine()
        tool_schemas = constrained_tool_schemas(tools, grammar)

        def check_tool_schemas() -> None:
            for spec in tool_schemas:
                engine.check_grammar(spec)

        await state.off_loop(check_tool_schemas)
        return dataclasses.replace(params, structured_outputs=grammar)

    def check_prompts(self) -> int:
        return 1

    async def prompts(self, state: ServerState) -> Sequence[list[int]]:
        return [await state.off_loop(lambda: render_chat(state, self.body, self.tools))]

    def _chunk(self, reply: Reply, choices: list[ChatStreamChoice], *, usage: bool) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=reply.generation.response_id,
            created=reply.created,
            model=reply.model_name,
            choices=choices,
            usage=reply.generation.usage() if usage else None,
        )

    def _message(self, choice: Completion) -> tuple[ChatResponseMessage, str | None]:
        """A finished choice's message and finish reason: its text, or what the parser read."""
        if self.parser is None or self._tokenizer is None:
            return ChatResponseMessage(content=choice.text), choice.finish_reason
        parsed = parse_choice(self.parser, self._tokenizer, choice, self._skip_special_tokens)
        message = ChatResponseMessage(content=parsed.content, tool_calls=parsed.tool_calls or None)
        return message, finish_reason(choice.finish_reason, bool(parsed.tool_calls))

    def whole(self, reply: Reply, results: list[list[Completion]]) -> ChatCompletionResponse:
        texts = reply.texts
        choices = []
        for choice in results[0]:
            message, reason = self._message(choice)
            choices.append(
                ChatChoice(
                    index=choice.index,
                    message=message,
                    logprobs=chat_logprobs(choice.logprobs, texts) if choice.logprobs is not None else None,
                    finish_reason=reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=reply.generation.response_id,
            created=reply.created,
            model=reply.model_name,
            choices=choices,
            usage=reply.generation.usage(),
        )

    async def chunks(self, reply: Reply) -> AsyncGenerator[ChatCompletionChunk, None]:
        parsers = None
        if self.parser is not None and self._tokenizer is not None:
            skip, stops = self._skip_special_tokens, bool(reply.params.stop)
            parsers = {
                i: StreamedChoice(new_parser(self.parser, self._tokenizer, skip), stops)
                for i in range(reply.generation.n)
            }
        async for choice in _stream_choices(reply.generation, reply.texts, parsers):
            yield self._chunk(reply, [choice], usage=self.body.continuous_usage)

    def last_chunk(self, reply: Reply) -> ChatCompletionChunk | None:
        return self._chunk(reply, [], usage=True) if self.body.include_usage else None


async def _stream_choices(
    generation: Generation, texts: TokenTexts, parsers: dict[int, StreamedChoice] | None
) -> AsyncGenerator[ChatStreamChoice, None]:
    """Each choice's deltas as they come, each choice opened by a delta with only the role (as OpenAI);
    with `parsers` (tools), each choice's tokens are read by its parser into content and call deltas."""
    for index in range(generation.n):
        yield ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content=""))
    async with aclosing(generation.outputs()) as outputs:
        async for _, output in outputs:
            for delta in output.outputs:
                logprobs = chat_logprobs(delta.logprobs, texts) if delta.logprobs is not None else None
                if parsers is not None:
                    for choice in stream_choices(parsers[delta.index], delta, logprobs):
                        yield choice
                    continue
                if not delta.text and logprobs is None and delta.finish_reason is None:
                    continue  # the token's text is held back (a possible stop string, a split character)
                yield ChatStreamChoice(
                    index=delta.index,
                    delta=ChatDelta(content=delta.text or None),
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
