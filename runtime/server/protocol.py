"""Request bodies of the OpenAI-compatible endpoints, as pydantic models (they also make /openapi.json).

The models check types only; value ranges are checked once, by `SamplingParams`, which names the
offending field, and what holds for any body (its shape, valid Unicode text) before these models
see it, by `json_body`. Unknown fields are rejected as OpenAI does ("Unrecognized request
argument"), except a few that clients send routinely and that change nothing here (`user`,
`metadata`, ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)

from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams

# What the chat-template call sets itself: a chat_template_kwargs key may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "template", "self", "kwargs", "variables", "chat_template"}
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False
    # vLLM's extension (load generators use it): every chunk carries the usage so far.
    continuous_usage_stats: StrictBool = False


class GenerationBody(_Body):
    """Fields both /v1/completions and /v1/chat/completions take: every engine sampling parameter."""

    model: StrictStr | None = Field(None, description="The served model name; the only model if omitted.")
    n: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    priority: StrictInt | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    stream: StrictBool | None = False  # null is false, as on OpenAI's API
    stream_options: StreamOptions | None = None
    # Accepted and ignored: they describe the caller, not the generation.
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None

    _PASSED_THROUGH = (
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "priority",
    )

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters; each route reads its own max_tokens and logprobs fields."""
        raise NotImplementedError

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; raises InvalidParameterError naming the field."""
        if self.logit_bias:
            raise InvalidParameterError("logit_bias", "is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError("stream_options", "is only allowed when stream is true")
        values: dict[str, Any] = {
            name: getattr(self, name) for name in self._PASSED_THROUGH if getattr(self, name) is not None
        }
        if self.stop is not None:
            values["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids is not None:
            values["stop_token_ids"] = tuple(self.stop_token_ids)
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **values)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(GenerationBody):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidParameterError("prompt", "must not be an empty list")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)

    def sampling_params(self) -> SamplingParams:
        if self.suffix is not None:
            raise InvalidParameterError("suffix", "is not supported by this server")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidParameterError("best_of", "is only supported equal to n")
        if self.echo and self.logprobs is not None:
            raise InvalidParameterError("echo", "cannot be combined with logprobs (no prompt logprobs)")
        return self._sampling_params(self.max_tokens, self.logprobs)


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """A chat message; other fields a client echoes back (tool_calls, refusal, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def content_chars(self) -> int:
        content = self.content
        if isinstance(content, list):
            return sum(len(part.text) for part in content)
        return len(content or "")

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(GenerationBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Extra template variables: names a template can use, and none the call itself passes."""
        for key in value or {}:
            if not key.isidentifier() or key.startswith("_"):
                raise ValueError(f"{key!r} is not a template variable name")
            if key in RESERVED_TEMPLATE_VARIABLES:
                raise ValueError(f"{key!r} is set by the server (use the request's own field)")
        return value

    def sampling_params(self) -> SamplingParams:
        if self.tools:
            raise InvalidParameterError("tools", "tool calling is not supported by this server")
        if self.tool_choice not in (None, "none", "auto"):
            raise InvalidParameterError("tool_choice", "tool calling is not supported by this server")
        if self.response_format is not None and self.response_format.type != "text":
            raise InvalidParameterError("response_format", "only type 'text' is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "needs logprobs to be true")
        # max_completion_tokens is the newer name; when both are given it wins, as in OpenAI's API.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs)
        except InvalidParameterError as error:
            if error.param == "logprobs":  # chat's field for the count is top_logprobs
                raise InvalidParameterError("top_logprobs", error.message) from None
            if error.param == "max_tokens" and self.max_completion_tokens is not None:
                raise InvalidParameterError("max_completion_tokens", error.message) from None
            raise

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.template_dict() for message in self.messages]


class TokenizeRequest(_Body):
    """POST /tokenize: give `prompt` (text) or `messages` (rendered with the chat template)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: StrictStr | None = None
    tokens: list[StrictInt]
