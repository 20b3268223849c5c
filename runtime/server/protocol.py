"""Request bodies of the OpenAI-compatible endpoints, as pydantic models (they also make /openapi.json).

The models check types only; value ranges are checked once, by `SamplingParams`, which names the
offending field, and what holds for any body (its shape, valid Unicode text) before these models
see it, by `json_body`. Unknown fields are rejected as OpenAI does ("Unrecognized request
argument"), except a few that clients send routinely and that change nothing here (`user`,
`metadata`, ...).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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
from kvasir.runtime.server.errors import APIError
from kvasir.runtime.server.json_shape import check_json_shape
from kvasir.runtime.server.tool_calls import template_arguments
from kvasir.runtime.structured.params import StructuredOutputs, parse_structured_outputs

# What the chat-template call sets itself: a chat_template_kwargs key may not replace them (`tools`
# is the request's own field, checked and bounded there).
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "template", "self", "kwargs", "variables", "chat_template", "tools"}
)
# OpenAI's rule for a response format's (and a function's) name.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False
    # vLLM's extension (load generators use it): every chunk carries the usage so far.
    continuous_usage_stats: StrictBool = False


class JSONSchemaFormat(_Body):
    """`response_format.json_schema`: OpenAI's named schema the output must follow."""

    name: StrictStr = Field(..., pattern=NAME_PATTERN)
    description: StrictStr | None = None
    # `schema` would shadow BaseModel's method; the JSON key is `schema` all the same.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None  # the schema is enforced either way


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputs | None:
        """The grammar this format asks for; None for free text."""
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise InvalidParameterError(
                    "response_format.json_schema", "is only allowed with type 'json_schema'"
                )
            return None if self.type == "text" else StructuredOutputs.json_object("response_format")
        if self.json_schema is None:
            raise InvalidParameterError("response_format.json_schema", "is required with type 'json_schema'")
        if self.json_schema.schema_ is None:  # OpenAI's schema is optional: then any JSON object
            return StructuredOutputs.json_object("response_format.json_schema")
        return StructuredOutputs.json_schema(self.json_schema.schema_, "response_format.json_schema.schema")


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
    # A grammar for the output: OpenAI's response_format, or vLLM's structured_outputs (one of
    # json, regex, choice, grammar, json_object); not both (a response_format of type text aside).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's prefix-cache salt: cached blocks are shared only among requests with the same salt.
    cache_salt: StrictStr | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Prefix-cache hits only among requests with the same salt (vLLM's cache_salt).",
    )
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

    @field_validator("structured_outputs")
    @classmethod
    def _schema_text(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """A schema given as text is parsed: bounded as the body is, first."""
        if value is not None and isinstance(value.get("json"), str):
            check_json_text([value["json"]], "structured_outputs.json", "the schema")
        return value

    def structured(self) -> StructuredOutputs | None:
        """The grammar the output must follow (response_format or structured_outputs), or None."""
        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format.type != "text":
                raise InvalidParameterError(
                    "structured_outputs", "cannot be combined with response_format: give one of them"
                )
            return parse_structured_outputs(self.structured_outputs, "structured_outputs")
        return self.response_format.structured_outputs() if self.response_format is not None else None

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredOutputs | None = None,
    ) -> SamplingParams:
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
        return SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured, **values
        )

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
        return self._sampling_params(self.max_tokens, self.logprobs, self.structured())


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class MessageFunctionCall(BaseModel):
    """A call an assistant message made, as an agent loop sends it back."""

    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    arguments: StrictStr | dict[str, Any]  # OpenAI's is a JSON string; some clients send the object


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall

    def chars(self) -> int:
        """The characters a template writes for this call, at least its id, name and arguments."""
        arguments = self.function.arguments
        size = len(arguments) if isinstance(arguments, str) else len(json.dumps(arguments))
        return len(self.id or "") + len(self.function.name) + size

    def template_dict(self, arguments: Any) -> dict[str, Any]:
        """The call as Hugging Face templates read it, with `arguments` already converted."""
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }
        if self.id is not None:
            call["id"] = self.id
        return call


class ChatMessage(BaseModel):
    """A chat message; other fields a client echoes back (refusal, annotations, ...) are ignored.

    An assistant message may carry the `tool_calls` it made (its content then may be null), and a
    `tool` message the `tool_call_id` it answers: both reach the chat template."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """A part of another type (image_url, input_audio, file) is refused saying why, rather
        than with the validator's "Input should be a valid string"."""
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"{kind[:40]!r} content parts are not supported: this server serves "
                        "text-only models (send text parts, or a string)"
                    )
        return value

    def content_chars(self) -> int:
        """The characters of what the template renders from this message: content, calls, ids."""
        content = self.content
        chars = sum(len(part.text) for part in content) if isinstance(content, list) else len(content or "")
        chars += sum(call.chars() for call in self.tool_calls or ())
        return chars + len(self.tool_call_id or "")

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content parts joined into one string; a call's
        arguments as a dict when they are a JSON object (as templates such as Llama 3.1's and
        Qwen's read them, and as vLLM passes them), else as sent."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [
                call.template_dict(template_arguments(call.function.arguments)) for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def check_json_text(texts: Sequence[str], param: str, what: str) -> None:
    """JSON sent inside strings (a call's arguments, a schema as text), all of it together, within
    the body's own shape bounds (json_shape) before anything parses it: it would build as many
    objects as the body itself, and nest as deep as json.loads overflows. 400 naming `param`."""
    if not texts:
        return
    try:
        check_json_shape(b"[" + b",".join(text.encode("utf-8", "surrogatepass") for text in texts) + b"]")
    except APIError as error:
        raise APIError(
            400,
            f"Invalid value for {param}: {what} " + error.message.removeprefix("The request body "),
            param=param,
            code="request_too_complex",
        ) from None


def _bounded_arguments(messages: Sequence[ChatMessage] | None) -> None:
    """The calls' arguments strings become dicts for the template (when they hold a JSON object)."""
    arguments = [
        call.function.arguments
        for message in messages or ()
        for call in message.tool_calls or ()
        if isinstance(call.function.arguments, str) and call.function.arguments.lstrip().startswith("{")
    ]
    check_json_text(arguments, "messages", "the tool calls' arguments")


class ChatCompletionRequest(GenerationBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    # Checked, with fields named, by kvasir.runtime.tools (see tool_calls.py).
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

    @field_validator("messages")
    @classmethod
    def _arguments_shape(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        _bounded_arguments(value)
        return value

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters from the body's own fields (the tools are the chat route's)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "needs logprobs to be true")
        # max_completion_tokens is the newer name; when both are given it wins, as in OpenAI's API.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs, self.structured())
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

    @field_validator("messages")
    @classmethod
    def _arguments_shape(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        _bounded_arguments(value)
        return value


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: StrictStr | None = None
    tokens: list[StrictInt]


class LoadLoRAAdapterRequest(_Body):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    lora_name: StrictStr = Field(..., min_length=1, max_length=256)
    lora_path: StrictStr = Field(..., min_length=1, max_length=4096)
    # Replace an adapter already serving under this name (requests in flight finish on the old one).
    load_inplace: StrictBool = False
    # Kvasir's: the branch, tag or commit of an hf://org/name lora_path (unset: the default branch).
    revision: StrictStr | None = Field(None, min_length=1, max_length=255)


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's `POST /v1/unload_lora_adapter` body (`lora_int_id` accepted and ignored: names rule)."""

    lora_name: StrictStr = Field(..., min_length=1, max_length=256)
    lora_int_id: StrictInt | None = None
