"""Scripted model outputs for every parser family, with the answer each must parse to.

The same text is replayed through both test tokenizers: with markers as special tokens and with
markers spelled in several tokens; the answer must not depend on which.
"""

from __future__ import annotations

from dataclasses import dataclass


def _tricky(marker: str) -> str:
    """Arguments whose strings hold braces, quotes, separators and the family's own marker."""
    return (
        '{"q": "a } b \\" c '
        + marker
        + ' d ; ]", "path": "C:\\\\", "nested": {"list": [1, {"x": "]"}], "e": {}}}'
    )


TRICKY = _tricky("</tool_call> <tool_call>")
UNICODE = '{"city": "Zürich", "note": "日本語 🎉 naïve \\u00e9"}'


@dataclass(frozen=True)
class Case:
    family: str
    name: str
    text: str
    content: str | None
    calls: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return f"{self.family}-{self.name}"


def _hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


CASES = [
    # hermes
    Case(
        "hermes",
        "single",
        _hermes("get_weather", '{"city": "Paris"}'),
        None,
        (("get_weather", '{"city": "Paris"}'),),
    ),
    Case(
        "hermes",
        "parallel",
        _hermes("a", '{"x": 1}') + "\n" + _hermes("b", "{}"),
        None,
        (("a", '{"x": 1}'), ("b", "{}")),
    ),
    Case(
        "hermes",
        "content before and after",
        "Let me look that up.\n\n" + _hermes("a", '{"x": 1}') + "\nDone.",
        "Let me look that up.\nDone.",
        (("a", '{"x": 1}'),),
    ),
    Case("hermes", "no call", "The capital of France is Paris.\n", "The capital of France is Paris.\n"),
    Case("hermes", "almost a marker", "if a <tool and b < c: <tool_cal", "if a <tool and b < c: <tool_cal"),
    Case("hermes", "unicode", _hermes("f", UNICODE), None, (("f", UNICODE),)),
    Case("hermes", "tricky strings", _hermes("f", TRICKY), None, (("f", TRICKY),)),
    Case(
        "hermes",
        "no end marker",
        '<tool_call>{"name": "f", "arguments": {"a": [1]}}',
        None,
        (("f", '{"a": [1]}'),),
    ),
    Case(
        "hermes",
        "escaped key",
        '<tool_call>{"n\\u0061me": "f", "arguments": {}}</tool_call>',
        None,
        (("f", "{}"),),
    ),
    Case("hermes", "no arguments", '<tool_call>{"name": "f"}</tool_call>', None, (("f", "{}"),)),
    Case(
        "hermes",
        "arguments before name",
        '<tool_call>{"arguments": {"a": 1}, "id": 7, "name": "f"}</tool_call>',
        None,
        (("f", '{"a": 1}'),),
    ),
    Case(
        "hermes",
        "string arguments",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"é\\"}"}</tool_call>',
        None,
        (("f", '{"a": "é"}'),),
    ),
    Case(
        "hermes",
        "malformed name",
        'Hi <tool_call>\n{"name": get_weather}\n</tool_call>',
        'Hi\n{"name": get_weather}',
    ),
    Case(
        "hermes",
        "malformed after arguments",
        '<tool_call>{"name": "f", "arguments": {"a": 1} oops</tool_call> ok',
        "oops ok",
        (("f", '{"a": 1}'),),
    ),
    Case("hermes", "cut before the name ends", 'Sure. <tool_call>{"name": "get_w', 'Sure.{"name": "get_w'),
    Case(
        "hermes",
        "cut in the arguments",
        '<tool_call>{"name": "f", "arguments": {"a": "tru',
        None,
        (("f", '{"a": "tru'),),
    ),
    Case(
        "hermes",
        "a good call after a bad one",
        '<tool_call>{"name": 3}</tool_call>' + _hermes("g", "{}"),
        '{"name": 3}',
        (("g", "{}"),),
    ),
    # llama3_json
    Case(
        "llama3_json",
        "single with tag",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        (("get_weather", '{"city": "Paris"}'),),
    ),
    Case(
        "llama3_json",
        "single without tag",
        '  {"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        (("get_weather", '{"city": "Paris"}'),),
    ),
    Case(
        "llama3_json",
        "parallel",
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}};{"name": "c", "parameters": {"y": ";"}}',
        None,
        (("a", '{"x": 1}'), ("b", "{}"), ("c", '{"y": ";"}')),
    ),
    Case(
        "llama3_json",
        "content before the tag",
        'Searching.\n<|python_tag|>{"name": "f", "parameters": {}}',
        "Searching.",
        (("f", "{}"),),
    ),
    Case("llama3_json", "no call", "It is 42. {not a call}", "It is 42. {not a call}"),
    Case("llama3_json", "json that is not a call", '{"city": "Paris"}', '{"city": "Paris"}'),
    Case(
        "llama3_json",
        "unicode",
        '{"name": "f", "parameters": ' + UNICODE + "}",
        None,
        (("f", UNICODE),),
    ),
    Case(
        "llama3_json",
        "tricky strings",
        '{"name": "f", "parameters": ' + _tricky("<|python_tag|>") + "}",
        None,
        (("f", _tricky("<|python_tag|>")),),
    ),
    Case(
        "llama3_json",
        "built-in tool call",
        '<|python_tag|>brave_search.call(query="x")',
        'brave_search.call(query="x")',
    ),
    Case(
        "llama3_json",
        "text after calls",
        '{"name": "f", "parameters": {}}\n\nThat is all.',
        "That is all.",
        (("f", "{}"),),
    ),
    # mistral
    Case(
        "mistral",
        "array single",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        (("get_weather", '{"city": "Paris"}'),),
    ),
    Case(
        "mistral",
        "array parallel",
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
        None,
        (("a", '{"x": 1}'), ("b", "{}")),
    ),
    Case(
        "mistral",
        "name form",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        None,
        (("get_weather", '{"city": "Paris"}'),),
    ),
    Case(
        "mistral",
        "name form parallel with call id",
        '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]a1B2c3D4e[ARGS]{}',
        None,
        (("a", '{"x": 1}'), ("b", "{}")),
    ),
    Case(
        "mistral",
        "content before",
        'I will check. [TOOL_CALLS][{"name": "f", "arguments": {}}]',
        "I will check.",
        (("f", "{}"),),
    ),
    Case("mistral", "no call", "Paris [is] the capital.", "Paris [is] the capital."),
    Case("mistral", "unicode", "[TOOL_CALLS]f[ARGS]" + UNICODE, None, (("f", UNICODE),)),
    Case(
        "mistral",
        "tricky strings",
        '[TOOL_CALLS][{"name": "f", "arguments": ' + _tricky("[TOOL_CALLS] [ARGS]") + "}]",
        None,
        (("f", _tricky("[TOOL_CALLS] [ARGS]")),),
    ),
    Case(
        "mistral",
        "malformed arguments",
        '[TOOL_CALLS][{"name": "f", "arguments": 5}]',
        '[{"name": "f", "arguments": 5}]',
    ),
    Case("mistral", "not a name", "[TOOL_CALLS]hello there", "hello there"),
    # json_array
    Case("json_array", "single", '[{"name": "f", "arguments": {"a": 1}}]', None, (("f", '{"a": 1}'),)),
    Case(
        "json_array",
        "parallel",
        ' [\n  {"name": "f", "arguments": {"a": 1}},\n  {"name": "g", "arguments": '
        + _tricky("<b>")
        + "}\n]\n",
        None,
        (("f", '{"a": 1}'), ("g", _tricky("<b>"))),
    ),
    Case("json_array", "unicode", '[{"name": "f", "arguments": ' + UNICODE + "}]", None, (("f", UNICODE),)),
    Case("json_array", "empty", "[]", ""),
    Case("json_array", "not an array", "I cannot do that.", "I cannot do that."),
    Case(
        "json_array",
        "cut short",
        '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "x',
        None,
        (("f", '{"a": 1}'), ("g", '{"b": "x')),
    ),
]
