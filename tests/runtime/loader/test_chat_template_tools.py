"""Tools reach the chat template as Hugging Face's `apply_chat_template(tools=...)` passes them: the
same text as transformers renders, for a Hermes/Qwen-style template that lists the tools, writes
the assistant's calls and wraps tool results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from kvasir.runtime.loader.tokenizer import load_tokenizer
from tests.tiny_checkpoints import make_tiny_checkpoint

# In the shape of Qwen 2.5's template: the tools as JSON in the system turn, the calls as
# <tool_call> objects (arguments a dict, written with tojson), tool results as <tool_response>.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, ünïcode & <tags>",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": -3}'},
]


def test_tools_and_calls_render_as_transformers_renders_them(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "llama")
    reference = PreTrainedTokenizerFast.from_pretrained(folder)
    expected = reference.apply_chat_template(
        MESSAGES, tools=TOOLS, chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    tokenizer = load_tokenizer(folder)
    tokenizer.chat_template = TOOLS_TEMPLATE
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tools=TOOLS)
    assert rendered == expected
    assert '"name": "get_weather", "arguments": {"city": "Oslo"}' in rendered
    assert "<tools>" in rendered and "<tool_response>" in rendered
