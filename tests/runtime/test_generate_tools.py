"""`kvasir generate` lines with the server's structured-output and tool fields: `response_format`,
`structured_outputs`, and for `messages` lines `tools`, `tool_choice`, `parallel_tool_calls`."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvasir.cli import main
from kvasir.runtime.generate_input import parse_line, read_lines

MESSAGES = [{"role": "user", "content": "time?"}]
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}]


def errors_of(*lines: dict[str, Any]) -> list[str]:
    text = "\n".join(json.dumps(line) for line in lines) + "\n"
    _, errors = read_lines(io.BytesIO(text.encode()))
    return [str(error) for error in errors]


def test_lines_take_the_servers_fields() -> None:
    line = parse_line(1, json.dumps({"prompt": "x", "structured_outputs": {"regex": "[ab]+"}}))
    assert line.params.structured_outputs is not None
    assert (line.params.structured_outputs.kind, line.params.structured_outputs.value) == ("regex", "[ab]+")
    schema = {"type": "object"}
    format_ = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    line = parse_line(2, json.dumps({"prompt": "x", "response_format": format_}))
    assert line.params.structured_outputs is not None
    assert line.params.structured_outputs.param == "response_format.json_schema.schema"
    line = parse_line(3, json.dumps({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}))
    assert line.tools is not None and line.tools.forced
    assert line.params.structured_outputs is not None and line.params.structured_outputs.param == "tools"
    line = parse_line(4, json.dumps({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": []}]}))
    assert line.tools is None and line.params.structured_outputs is None


def test_bad_fields_name_their_line_and_field() -> None:
    bad_name = {"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}}
    found = errors_of(
        {"prompt": "x", "tools": TOOLS},
        {"prompt": "x", "response_format": bad_name},
        {"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        {
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        {"messages": MESSAGES, "tools": [TOOLS[0], TOOLS[0]]},
        {
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "structured_outputs": {"regex": "a"},
        },
        {"messages": [{"role": "assistant"}]},
        {"prompt": "x", "structured_outputs": {"json": "[" * 100_000 + "]" * 100_000}},
    )
    assert len(found) == 9
    assert found[0].startswith("line 1: tools only go with 'messages'")
    assert found[1].startswith("line 2: response_format.json_schema.name: ")
    assert found[2].startswith("line 3: structured_outputs: cannot be combined with response_format")
    assert found[3].startswith("line 4: structured_outputs: give exactly one")
    assert found[4].startswith("line 5: tool_choice: ")
    assert found[5].startswith("line 6: tools[1].function.name: ")
    assert found[6].startswith("line 7: tool_choice: ")
    assert found[7].startswith("line 8: 'messages' must be a list of objects")
    assert found[8].startswith("line 9: structured_outputs.json: is nested too deeply")


def test_generate_writes_tool_calls(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
         "max_tokens": 200, "seed": 1},
        {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, "temperature": 0},
        {"prompt": "pick", "structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 8, "temperature": 0},
    ]  # fmt: skip
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    arguments = ["--model", str(tiny_checkpoint("llama")), "--device", "cpu", "--max-model-len", "256"]
    assert main(["generate", *arguments, "--input", str(source), "--output", str(target)]) == 0
    forced, auto, choice = (json.loads(line) for line in target.read_text().splitlines())
    [call] = forced["choices"][0]["tool_calls"]
    assert forced["choices"][0]["finish_reason"] == "stop"
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TIME_PARAMETERS)
    # Read under `auto` too: the tiny model writes no call.
    assert auto["choices"][0]["tool_calls"] == []
    assert "tool_calls" not in choice["choices"][0] and choice["choices"][0]["text"] in ("yes", "no")

    # A bad line is reported as such: its fields first, then (with the tokenizer, before the
    # weights) its grammar.
    source.write_text(json.dumps({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "sometimes"}) + "\n")
    capsys.readouterr()
    assert main(["generate", *arguments, "--input", str(source), "--output", str(target)]) == 2
    assert f"kvasir generate: {source}: line 1: tool_choice: " in capsys.readouterr().err
    bad_regex = {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}
    source.write_text(json.dumps(lines[2]) + "\n" + json.dumps(bad_regex) + "\n")
    assert main(["generate", *arguments, "--input", str(source), "--output", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"kvasir generate: {source}: line 2: structured_outputs.regex: " in err and "line 1" not in err
