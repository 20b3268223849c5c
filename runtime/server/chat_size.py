"""The fewest tokens a chat's messages can take, known before its template is rendered.

The length checks before rendering count message content only, but a chat template writes its role
markers around every message (about five tokens each in ChatML): 2M empty messages passed them and
were rendered to tens of megabytes of text and millions of tokens before the context length refused
them, minutes later and gigabytes larger. So the least the template adds for one message is measured
once, when the model is loaded, and a chat with more messages than could fit on that alone is
refused at once, before any message is rendered.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvasir.runtime.engine.prompt_check import ContextLengthError
from kvasir.runtime.loader.tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")


def min_tokens_per_message(tokenizer: Tokenizer) -> int:
    """A lower bound on the tokens the chat template adds for each message; 0 when there is none.

    For each role, how much one more empty message grows a one-message conversation, and then one
    more again; the smallest growth seen, halved (a message's content may merge into one token with
    the template's text around it). A role the template refuses in that place is left out: a
    conversation the template refuses fails on its first misplaced message, before rendering more."""

    def length(messages: list[dict[str, Any]]) -> int | None:
        try:
            return len(tokenizer.encode_chat(messages, add_generation_prompt=False))
        except Exception:  # whatever a template raises here only means "not measurable"
            return None

    base: list[dict[str, Any]] = [{"role": "user", "content": ""}]
    growths = []
    for role in ROLES:
        sizes = [length(base + [{"role": role, "content": ""}] * count) for count in range(3)]
        steps = [b - a for a, b in itertools.pairwise(sizes) if a is not None and b is not None]
        growths.extend(steps)
    return max(min(growths, default=0), 0) // 2


def check_message_count(num_messages: int, tokens_per_message: int, max_model_len: int) -> None:
    """400 on `messages` when that many messages cannot fit the context, whatever their content."""
    if tokens_per_message and num_messages * tokens_per_message > max_model_len:
        raise ContextLengthError(
            "messages",
            f"This model's maximum context length is {max_model_len} tokens; its chat template adds "
            f"at least {tokens_per_message} tokens for each message, so {num_messages} messages "
            f"cannot fit.",
        )


def text_chars(value: Any) -> int:
    """The characters of every string in a JSON value, keys included: the least a template that
    renders it writes (tool declarations: names, descriptions, parameter names, enums). Its depth
    is bounded by the request body's (json_shape)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(key) + text_chars(item) for key, item in value.items())
    if isinstance(value, list):
        return sum(text_chars(item) for item in value)
    return 0
