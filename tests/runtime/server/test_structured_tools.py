"""Structured output (`response_format`, `structured_outputs`) and tool calling (`tools`,
`tool_choice`) over HTTP, against a real uvicorn on the tiny model, through the official `openai`
SDK where it has a helper for it.

The tiny model's weights are random: whatever it writes under a grammar is the grammar's doing, so
every schema here is small and bounded (enums, booleans) and the answers fit a few hundred tokens.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from kvasir.runtime.loader.tokenizer import load_tokenizer
from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from kvasir.runtime.server.protocol import ChatCompletionRequest
from tests.runtime.server.harness import MODEL, TIMEOUT, RunningServer, serve, tiny_engine_config

MESSAGES = [{"role": "user", "content": "weather?"}]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
# Room for a whole call array (with the grammar's bounded whitespace) inside the 256-token context.
CALL_TOKENS = 200

# A Hermes-style template (as Qwen2.5's): tools in a system turn, calls and tool results written back.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}"
    "{% if message.role == 'tool' %} [{{ message.tool_call_id }}]{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RunningServer]:
    app = build_app(tiny_engine_config(checkpoint), ServerConfig(tool_call_parser="hermes"))
    with serve(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def tool_template_checkpoint(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a chat template that renders tools and calls."""
    folder = tmp_path_factory.mktemp("tool-template")
    shutil.copytree(checkpoint, folder, dirs_exist_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def tool_server(tool_template_checkpoint: Path) -> Iterator[RunningServer]:
    with serve(build_app(tiny_engine_config(tool_template_checkpoint), ServerConfig())) as running:
        yield running


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=TIMEOUT)


def assert_400(response: httpx.Response, param: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    return error


def assert_valid_calls(calls: list[Any], names: set[str]) -> None:
    """Each call names one of `names`, and its arguments are JSON that its tool's schema accepts."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


# ---- requests refused, naming the field ---------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # OpenAI's response_format
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": SCHEMA}}},
         "response_format.json_schema.name"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         "response_format.json_schema.name"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}}},
         "response_format.json_schema.name"),
        ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}},
         "response_format.json_schema.schema"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
        ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
         "response_format.json_schema.name"),
        # vLLM's structured_outputs
        ("chat", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
         "structured_outputs"),
        ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
          "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
        ("completions", {"structured_outputs": {"json": SCHEMA, "regex": "a+"}}, "structured_outputs"),
        ("completions", {"structured_outputs": {}}, "structured_outputs"),
        ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ("completions", {"structured_outputs": {"json_object": False, "regex": ""}}, "structured_outputs.regex"),
        ("completions", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ("chat", {"structured_outputs": {"json": "not json"}}, "structured_outputs.json"),
        # tools
        ("completions", {"tools": TOOLS}, "tools"),
        ("completions", {"tool_choice": "auto"}, "tool_choice"),
        ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ("chat", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "tools[0].function.name"),
        ("chat", {"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         "tools[0].function.parameters"),
        ("chat", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ("chat", {"chat_template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_bad_fields_are_400_naming_them(
    server: RunningServer, path: str, body: dict[str, Any], param: str
) -> None:
    if path == "chat":
        response = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **body})
    else:
        response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **body})
    assert_400(response, param)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("field", "param"),
    [
        # Refused by the engine's grammar compiler (prepare_request), before any answer starts.
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}},
         "structured_outputs.json"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ],
)  # fmt: skip
def test_grammars_the_engine_refuses_are_400_before_any_stream(
    server: RunningServer, field: dict[str, Any], param: str, stream: bool
) -> None:
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": stream, **field})
    assert response.headers["content-type"].startswith("application/json")
    assert_400(response, param)


def test_tool_call_arguments_in_messages_are_bounded(server: RunningServer) -> None:
    def conversation(*arguments: str) -> list[dict[str, Any]]:
        calls = [
            {"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": text}}
            for i, text in enumerate(arguments)
        ]
        return [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls}]

    # Deeper than a body may nest, inside a string: refused before it becomes a dict.
    deep = '{"a": ' + "[" * 100 + "]" * 100 + "}"
    error = assert_400(post(server, "/v1/chat/completions", {"messages": conversation(deep)}), "messages")
    assert error["code"] == "request_too_complex"
    # More objects in all the calls together than a body may hold, each call within the bound.
    many = '{"a": [' + ",".join(["{}"] * 6000) + "]}"
    error = assert_400(
        post(server, "/v1/chat/completions", {"messages": conversation(many, many, many)}), "messages"
    )
    assert error["code"] == "request_too_complex"
    # A schema sent as text is bounded the same way before it is parsed.
    schema = '{"type": "array", "items": ' * 2000 + "{}" + "}" * 2000
    body = {"prompt": "x", "structured_outputs": {"json": schema}}
    error = assert_400(post(server, "/v1/completions", body), "structured_outputs.json")
    assert error["code"] == "request_too_complex"
    # Arguments count as the message's text: too long for the context before any rendering.
    long = json.dumps({"a": "x" * 200_000})
    error = assert_400(post(server, "/v1/chat/completions", {"messages": conversation(long)}), "messages")
    assert error["code"] == "context_length_exceeded"
    # So do the tools' declarations.
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 200_000}}]
    error = assert_400(post(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": tools}), "tools")
    assert error["code"] == "context_length_exceeded"


# ---- structured output --------------------------------------------------------------------------


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo"]
    sunny: bool


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Forecast, max_completion_tokens=CALL_TOKENS, seed=1
    )
    [choice] = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    assert Forecast.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_structured_outputs_on_completions(client: openai.OpenAI) -> None:
    choices = ["alpha", "beta", "gamma"]
    result = client.completions.create(
        model=MODEL,
        prompt="pick one",
        max_tokens=16,
        n=3,
        seed=2,
        # A response_format of type text constrains nothing: it goes with structured_outputs.
        extra_body={"structured_outputs": {"choice": choices}, "response_format": {"type": "text"}},
    )
    assert {c.finish_reason for c in result.choices} == {"stop"}
    assert all(c.text in choices for c in result.choices)

    result = client.completions.create(
        model=MODEL,
        prompt="digits",
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[ab]"}},
    )
    [choice] = result.choices
    assert choice.finish_reason == "stop" and len(choice.text) == 5 and choice.text[3:] in ("-a", "-b")
    assert choice.text[:3].isdigit()

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    result = client.completions.create(
        model=MODEL,
        prompt="json",
        max_tokens=64,
        temperature=0,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}
        },
    )
    jsonschema.validate(json.loads(result.choices[0].text), schema)


def test_json_object_starts_an_object(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, response_format={"type": "json_object"}
    )
    content = result.choices[0].message.content or ""
    assert content.lstrip().startswith("{")


# ---- tool calls ---------------------------------------------------------------------------------


def test_required_tool_choice_returns_valid_calls(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_completion_tokens=CALL_TOKENS,
        seed=3,
    )
    [choice] = result.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_named_tool_choice_calls_that_tool(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,  # one call: a random model would go on adding calls to the array
        max_completion_tokens=CALL_TOKENS,
        n=2,
        seed=4,
    )
    assert len(result.choices) == 2
    for choice in result.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls is not None
        assert_valid_calls(choice.message.tool_calls, {"get_time"})


def test_streamed_calls_accumulate_to_the_same_calls(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_completion_tokens": CALL_TOKENS,
        "seed": 5,
    }
    whole = client.chat.completions.create(**request)
    with client.chat.completions.stream(**request) as stream:
        streamed = stream.get_final_completion()
    [whole_choice], [streamed_choice] = whole.choices, streamed.choices
    assert whole_choice.finish_reason == streamed_choice.finish_reason == "tool_calls"
    assert whole_choice.message.tool_calls is not None and streamed_choice.message.tool_calls is not None

    def calls(message_calls: list[Any]) -> list[tuple[str, str]]:
        return [(call.function.name, call.function.arguments) for call in message_calls]

    assert calls(streamed_choice.message.tool_calls) == calls(whole_choice.message.tool_calls)
    assert_valid_calls(streamed_choice.message.tool_calls, {"get_weather", "get_time"})
    assert not streamed_choice.message.content


def sse_chunks(server: RunningServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=TIMEOUT
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def test_streamed_call_deltas_have_openai_shape(server: RunningServer) -> None:
    chunks = sse_chunks(
        server,
        {
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
            "max_tokens": CALL_TOKENS,
            "seed": 6,
            "stream": True,
        },
    )
    deltas = [
        call
        for chunk in chunks
        for choice in chunk["choices"]
        for call in choice["delta"].get("tool_calls") or []
    ]
    opening, *rest = deltas
    # Opened once: id, type and name, empty arguments; then argument fragments only.
    assert opening["index"] == 0 and opening["id"].startswith("call_") and opening["type"] == "function"
    assert opening["function"] == {"name": "get_weather", "arguments": ""}
    assert rest and all(
        set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"} for delta in rest
    )
    arguments = json.loads("".join(delta["function"]["arguments"] for delta in rest))
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    reasons = [
        choice["finish_reason"] for chunk in chunks for choice in chunk["choices"] if choice["finish_reason"]
    ]
    assert reasons == ["tool_calls"]


def test_auto_reads_the_models_calls(server: RunningServer) -> None:
    """Under `auto` the family's parser reads what the model writes (here forced by a choice)."""
    written = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    body = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 120,
        "structured_outputs": {"choice": [written]},
    }
    answer = post(server, "/v1/chat/completions", body).json()
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}
    chunks = sse_chunks(server, {**body, "stream": True})
    streamed = "".join(
        call["function"]["arguments"]
        for chunk in chunks
        for choice in chunk["choices"]
        for call in choice["delta"].get("tool_calls") or []
    )
    assert streamed == '{"zone": "CET"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_calls_auto_and_none_answer_text(client: openai.OpenAI) -> None:
    """Free text is content, as without tools (the tiny template ignores them: the same prompt)."""
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    for tool_choice in ("auto", "none"):
        result = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            tools=TOOLS,
            tool_choice=tool_choice,  # type: ignore[arg-type]
        )
        [choice] = result.choices
        assert choice.message.tool_calls is None
        assert choice.message.content == plain.choices[0].message.content
        assert choice.finish_reason == plain.choices[0].finish_reason != "tool_calls"


def test_a_stop_string_ends_the_content_as_without_tools(client: openai.OpenAI) -> None:
    """The parser reads token ids; the stop string is found in the engine's text, which ends the
    content, streamed or not (the token that completes a stop string may carry more text)."""
    request: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    text = client.chat.completions.create(**request).choices[0].message.content or ""
    request["stop"] = [text[5:8]]  # ends the answer inside its sixth character's token, or after
    plain = client.chat.completions.create(**request).choices[0]
    assert plain.finish_reason == "stop" and len(plain.message.content or "") == 5
    with_tools = client.chat.completions.create(**request, tools=TOOLS).choices[0]  # type: ignore[arg-type]
    assert (with_tools.message.content, with_tools.finish_reason) == (plain.message.content, "stop")
    with client.chat.completions.stream(**request, tools=TOOLS) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert (streamed.message.content, streamed.finish_reason) == (plain.message.content, "stop")


# ---- what the chat template gets ----------------------------------------------------------------


def test_tools_and_calls_reach_the_template(
    tool_server: RunningServer, tool_template_checkpoint: Path
) -> None:
    # The tiny context holds a small declaration (rendered as JSON, about a token a character).
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    response = post(
        tool_server, "/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 1}
    )
    assert response.status_code == 200, response.text
    # What the template was given: the tools as Hugging Face passes them, the arguments as a dict.
    expected = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": {"zone": "UTC"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    tokenizer = load_tokenizer(tool_template_checkpoint)
    text = tokenizer.apply_chat_template(expected, tools=tools)
    assert '"arguments": {"zone": "UTC"}' in text and '"name": "get_time"' in text and "[call_1]" in text
    assert response.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))


def test_messages_keep_what_agent_loops_send_back() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}},
                    {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{not json"}},
                    {"id": "c", "type": "function", "function": {"name": "h", "arguments": {"k": 1}}},
                ]},
                {"role": "tool", "tool_call_id": "a", "name": "f", "content": "3"},
            ]
        }
    )  # fmt: skip
    assistant, tool = body.template_messages()
    # Only a JSON object becomes a dict; anything else reaches the template as sent.
    assert [call["function"]["arguments"] for call in assistant["tool_calls"]] == [
        "[1, 2]",
        "{not json",
        {"k": 1},
    ]
    assert tool == {"role": "tool", "content": "3", "name": "f", "tool_call_id": "a"}


def test_auto_picks_the_templates_parser(tool_server: RunningServer) -> None:
    """`--tool-call-parser auto` (the default) reads calls in the format the template writes."""
    written = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    body = {
        "messages": MESSAGES,
        "tools": tools,
        "max_tokens": 100,
        "structured_outputs": {"choice": [written]},
    }
    answer = post(tool_server, "/v1/chat/completions", body).json()
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["get_time"]


UNIQUE_TAGS = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "tagger"}}, "auto"]
)
def test_a_tool_schema_the_engine_cannot_enforce_is_400_pointing_inside_that_tool(
    server: RunningServer, tool_choice: Any
) -> None:
    tagger = {"type": "function", "function": {"name": "tagger", "parameters": UNIQUE_TAGS, "strict": True}}
    body = {"messages": MESSAGES, "max_tokens": 4, "tools": [TOOLS[0], tagger], "tool_choice": tool_choice}
    error = assert_400(post(server, "/v1/chat/completions", body), "tools[1].function.parameters")
    assert "'uniqueItems' at /properties/tags" in error["message"]


def test_a_strict_tool_under_auto_is_enforced_by_a_lazy_grammar(server: RunningServer) -> None:
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    body = {"messages": MESSAGES, "max_tokens": 8, "tools": strict, "tool_choice": "auto", "seed": 1}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'kind="tool_calls"' in metrics


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_a_non_text_content_part_is_refused_saying_why(server: RunningServer, kind: str) -> None:
    part = {"type": kind, kind: {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    response = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert f"'{kind}' content parts are not supported" in response.json()["error"]["message"]
    assert "text-only" in response.json()["error"]["message"]
