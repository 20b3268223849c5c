"""The engine's token logprobs in the two OpenAI shapes: completions' parallel lists and chat's objects."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvasir.runtime.engine.outputs import TokenLogprob
from kvasir.runtime.loader.tokenizer import Tokenizer
from kvasir.runtime.server.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

# JSON has no -inf; OpenAI clients expect a number (vLLM answers the same).
_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


class TokenTexts:
    """Each token id's text on its own (a byte-level piece may be an incomplete character), cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def completion_logprobs(
    logprobs: Sequence[TokenLogprob], texts: TokenTexts, text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """Completions' `logprobs` object; `text_offset` is where the first token starts in the choice's text.

    Returns the object and the offset just past the last token (the next chunk's start)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for item in logprobs:
        token = texts(item.token_id)
        tokens.append(token)
        token_logprobs.append(_finite(item.logprob))
        tops.append({texts(token_id): _finite(logprob) for token_id, logprob in item.top})
        offsets.append(text_offset)
        text_offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    ), text_offset


def chat_logprobs(logprobs: Sequence[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    """Chat's `logprobs` object: one entry per token with its top alternatives."""
    content = []
    for item in logprobs:
        token = texts(item.token_id)
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=_finite(item.logprob),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=texts(token_id),
                        logprob=_finite(logprob),
                        bytes=list(texts(token_id).encode("utf-8")),
                    )
                    for token_id, logprob in item.top
                ],
            )
        )
    return ChatLogprobs(content=content)
