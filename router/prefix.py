"""Approximate prefix affinity: which backend has most likely cached a prompt's leading blocks.

The router has no tokenizer, so a block is a fixed number of characters of the prompt's text, and
its key is a chained hash (the parent key and the block's text), so equal keys mean equal whole
prefixes. Each backend remembers the keys of the prompts it was sent, least recently routed
forgotten first; a backend's match is its run of remembered keys from the first block on. It is
approximate (the backend may since have evicted the blocks), which is why it is one score among
three, not a rule."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Never hash more than this many blocks of one prompt: beyond them every backend that matched this
# far is equally good, and the cost of hashing a huge prompt stays bounded.
MAX_BLOCKS = 512


def prompt_text(body: Mapping[str, Any]) -> str:
    """The text whose prefix the backend's cache will hold: a chat's messages in order (role and
    content, as the chat template lays them out), or a completion's prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts: the text ones, in order
                content = "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
            parts.append(f"<{message.get('role', '')}>{content if content is not None else ''}")
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):  # token ids: their decimal text is as good a key as any
            return ",".join(str(token) for token in prompt)
        if isinstance(first, list):
            return ",".join(str(token) for token in first)
    return ""


def block_keys(text: str, block_chars: int) -> list[int]:
    """Chained keys of the text's full blocks (at most MAX_BLOCKS)."""
    keys = []
    parent = 0
    for start in range(0, min(len(text) // block_chars, MAX_BLOCKS) * block_chars, block_chars):
        parent = hash((parent, text[start : start + block_chars]))
        keys.append(parent)
    return keys


class PrefixIndex:
    """Per backend, the block keys of the prompts routed to it (an LRU of `capacity` keys)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._keys: dict[str, OrderedDict[int, None]] = {}

    def match(self, keys: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """For each backend, how many of `keys` it holds in a row from the first."""
        matches = {}
        for backend in backends:
            held = self._keys.get(backend)
            count = 0
            if held:
                for key in keys:
                    if key not in held:
                        break
                    count += 1
            matches[backend] = count
        return matches

    def record(self, backend: str, keys: Sequence[int]) -> None:
        """`backend` now holds `keys` (just routed there): most recently used, oldest evicted."""
        held = self._keys.setdefault(backend, OrderedDict())
        for key in keys:
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, backend: str) -> None:
        """A backend that left: its cache is gone with it."""
        self._keys.pop(backend, None)

    def size(self, backend: str) -> int:
        return len(self._keys.get(backend, ()))
