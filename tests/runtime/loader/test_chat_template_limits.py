"""Chat templates render within bounds: steps, characters written, and the size of each value.

Each hostile template below is far past a bound (10**10 loop iterations, strings of 10**8
characters and more), so only the bound can stop it: the render ends in a ChatTemplateLimitError
naming the limit it hit. Sizes stay near 10**8 so that code without the bounds renders them
(and the test fails) without taking the machine's memory. Real templates render exactly as
transformers renders them (here a template using what real ones use; the SmolLM2 and tiny
checkpoints' templates are compared in test_loader_gguf_smollm.py and test_loader_hf_folder.py).
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvasir.runtime.loader.chat_template import (
    ChatTemplateError,
    ChatTemplateLimitError,
    render_chat_template,
)
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.loader.template_bounds import LIMITS
from tests.runtime.loader.tiny_gguf import write_tiny_gguf

USER = [{"role": "user", "content": "Hello"}]
STEPS, STRING, ITEMS = "render step limit", "string size limit", "list size limit"
INTEGER, OUTPUT = "integer size limit", "render output limit"

HOSTILE = {
    # Time: the loops the issue reported, and loops that do nothing the other checks would see.
    "nested ranges": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        STEPS,
    ),
    "filtered loop": (
        "{% for i in range(100000) %}{% for j in range(100000) if j < 0 %}{% endfor %}{% endfor %}",
        STEPS,
    ),
    "macro recursion": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
        STEPS,
    ),
    "compares on a long string": (
        "{% set b = 'a' * 10000000 %}{% for i in range(100000) %}{% if 'b' in b %}{% endif %}{% endfor %}",
        STEPS,
    ),
    # Memory: values far larger than their inputs.
    "string times n": ("{{ 'a' * 100000000 }}", STRING),
    "list times n": ("{{ ['a'] * 100000000 }}", ITEMS),
    "doubling with ~": (
        "{% set ns = namespace(s='ab') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        STRING,
    ),
    "doubling with +": (
        "{% set ns = namespace(s='ab') %}{% for i in range(27) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        STRING,
    ),
    "replace filter": ("{% set s = 'a' * 10000 %}{{ s|replace('a', s) }}", STRING),
    "replace method": ("{% set s = 'a' * 10000 %}{{ s.replace('a', s) }}", STRING),
    "join filter": ("{{ (['a' * 100000] * 1000)|join }}", STRING),
    "join method": ("{{ ('a' * 100000).join(['x'] * 1000) }}", STRING),
    "percent format": ("{{ '%s' * 100 % (('a' * 1000000,) * 100) }}", STRING),
    "format width": ("{{ '{:>100000000}'.format(1) }}", STRING),
    "percent width": ("{{ '%100000000d' % 1 }}", STRING),
    "format filter": ("{{ '%s%s%s%s%s%s%s%s%s%s'|format(*(['a' * 10000000] * 10)) }}", STRING),
    "center": ("{{ 'a'|center(100000000) }}", STRING),
    "ljust": ("{{ 'a'.ljust(100000000) }}", STRING),
    "indent": ("{{ ('a\\n' * 100000)|indent(1000) }}", STRING),
    "expandtabs": ("{{ ('\\t' * 100000).expandtabs(1000) }}", STRING),
    "printing a list": ("{{ ['a' * 1000000] * 100 }}", STRING),
    "string filter": ("{{ (['a' * 1000000] * 100)|string }}", STRING),
    "tojson": ("{{ (['a' * 1000000] * 100)|tojson }}", STRING),
    "~ of a list": ("{{ 'x' ~ ['a' * 1000000] * 100 }}", STRING),
    "split": ("{{ ('a ' * 5000000).split()|length }}", ITEMS),
    "list of a string": ("{{ ('a' * 5000000)|list|length }}", ITEMS),
    "power": ("{{ 2 ** 1000000 }}", INTEGER),
    "sum of lists": ("{{ ([['a'] * 100000] * 100)|sum(start=[])|length }}", ITEMS),
    # Characters written: the output, and what a template captures and throws away.
    "long output": ("{% for i in range(100000) %}{{ 'a' * 1000 }}{% endfor %}", OUTPUT),
    "captured output": (
        "{% for i in range(1000) %}{% set x %}{% for j in range(100) %}{{ 'a' * 1000 }}{% endfor %}"
        "{% endset %}{% endfor %}",
        OUTPUT,
    ),
    "literal text in a loop": ("{% for i in range(100000) %}" + "a" * 1000 + "{% endfor %}", OUTPUT),
    # A filter of constants that Jinja would fold into literal text at compile time, unchecked.
    "constant filter in a loop": ("{% for i in range(100000) %}{{ 'x' | center(1000) }}{% endfor %}", OUTPUT),
}


# The most memory (traced by tracemalloc) a refused render may reach: strings up to the string size
# limit exist, and an output up to the output limit; the step cases run untraced (tracing slows
# each allocation: their memory is a few loop variables).
PEAKS = {
    STRING: 3 * LIMITS.max_string_chars,
    ITEMS: 3 * LIMITS.max_string_chars,
    INTEGER: 3 * LIMITS.max_string_chars,
    OUTPUT: 2 * LIMITS.max_output_chars,
}


@pytest.mark.parametrize(("template", "limit"), list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_render_past_a_bound_is_an_error_naming_it(template: str, limit: str) -> None:
    traced = limit in PEAKS
    if traced:
        tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateLimitError, match=rf"^chat template: .*{limit}") as caught:
            render_chat_template(template, USER)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "\n" not in str(caught.value)
    if traced:  # nothing near the refused size was built
        assert peak < PEAKS[limit], f"peak {peak / 2**20:.0f} MiB"


def test_limits_are_per_render() -> None:
    # Each render takes ~600k steps (a bit over half the budget): one budget shared by both would run out.
    template = "{% for i in range(100000) %}{% for j in range(5) %}{% endfor %}{% endfor %}"
    assert render_chat_template(template, USER) == ""
    assert render_chat_template(template, USER) == ""


def test_other_template_faults_are_chat_template_errors() -> None:
    for template in ("{{ 1 / 0 }}", "{{ messages[0]['content'] + 1 }}", "{{ range(1000000) }}"):
        with pytest.raises(ChatTemplateError, match=r"^chat template: "):
            render_chat_template(template, USER)


# What real templates do (Llama 3.x, Qwen, Mistral, Hermes tool templates): system message split,
# tools as JSON (indented), a macro over JSON schema types, namespace state, loop neighbours,
# filters chained, string methods, slicing, the `%` operator and `format`.
REALISTIC = """{{- bos_token }}
{%- macro py_type(spec) -%}
  {%- if spec.type is string %}{{ {"string": "str", "integer": "int", "number": "float"}.get(spec.type, spec.type) }}
  {%- elif spec.type is iterable %}Union[{{ spec.type | map('string') | join(', ') }}]
  {%- else %}Any{% endif -%}
{%- endmacro %}
{%- if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}{% set rest = messages[1:] %}
{%- else %}{% set system = "You are helpful." %}{% set rest = messages %}{% endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" + system }}
{%- if tools %}
  {{- "\\nTools (%d):\\n" % (tools | length) }}
  {%- for t in tools %}{% set f = t.function if t.function is defined else t %}
    {{- f | tojson(indent=4) }}{{ "\\n" }}
    {%- for name, spec in f.parameters.properties | dictsort %}
      {{- "  - {}: {}".format(name, py_type(spec)) }}{% if not loop.last %}{{ "\\n" }}{% endif %}
    {%- endfor %}
  {%- endfor %}
{%- endif %}
{{- "<|eot_id|>" }}
{%- set ns = namespace(last_user=-1, calls=0) %}
{%- for m in rest %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in rest %}
  {%- if m.role == 'assistant' and m.tool_calls is defined and m.tool_calls %}
    {%- set ns.calls = ns.calls + m.tool_calls | length %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
    {%- for c in m.tool_calls %}{{ '{"name": "' ~ c.function.name ~ '", "parameters": ' ~ c.function.arguments | tojson ~ '}' }}{% endfor %}
  {%- elif m.role == 'tool' %}
    {%- if loop.previtem and loop.previtem.role != 'tool' %}{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{% endif %}
    {{- {"output": m.content} | tojson }}
  {%- else %}
    {%- set content = m.content.split('</think>')[-1].strip() if m.role == 'assistant' else m.content %}
    {{- '<|start_header_id|>' ~ m.role ~ '<|end_header_id|>\\n\\n' ~ content | trim }}
    {%- if loop.index0 == ns.last_user %}{{ " [last user, %s words]" | format(content.split() | length) }}{% endif %}
  {%- endif %}
  {{- '<|eot_id|>' }}
{%- endfor %}
{{- "<calls=" ~ ns.calls ~ " total=" ~ ([1, 2.5, 3] | sum) ~ " " ~ ("x" * 3) ~ ">" }}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & later, ünï",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city"},
                    "days": {"type": "integer"},
                    "units": {"type": ["string", "null"], "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    }
]
CHAT = [
    {"role": "system", "content": "  Be terse. \n"},
    {"role": "user", "content": "Weather in Paris? <b>&</b> 🙂"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "<think>hm</think> It is 21 degrees."},
    {"role": "user", "content": "Thanks, and tomorrow?"},
]


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("messages", [CHAT, CHAT * 50])
def test_realistic_template_renders_as_transformers_does(messages: list[dict[str, Any]], tools: Any) -> None:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    variables = {"bos_token": "<s>", "tools": tools, "add_generation_prompt": True}
    ours = render_chat_template(REALISTIC, messages, **variables)
    theirs = _compile_jinja_template(REALISTIC).render(messages=messages, **variables)
    assert ours == theirs
    assert "get_weather" in ours or tools is None


def test_a_model_whose_template_cannot_render_a_chat_is_refused_at_load(tmp_path: Path) -> None:
    hanging = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    path = write_tiny_gguf(tmp_path / "hang.gguf", meta={"tokenizer.chat_template": hanging})
    with pytest.raises(
        ModelLoadError,
        match=r"hang\.gguf: the chat template cannot render a one-message chat: .*render step limit",
    ):
        open_model(str(path))


def test_a_template_failing_otherwise_still_loads(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "copy")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('system message required') }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING"):
        files = open_model(str(folder))
    assert "system message required" in caplog.text
    assert files.tokenizer.encode("hello")  # completions still work
