"""Bounds on what a non-streamed answer holds in memory before it is sent.

A streamed answer sends each token as it comes. A non-streamed one keeps every choice's tokens, text
and logprobs until the last choice has finished, then builds one JSON body from all of them, and
nothing bounded `n x max_tokens`: 64 choices of 256 tokens with 20 logprobs took 200 MB and
answered 9.3 MB; on the embedded model, 12 chat choices of 512 tokens with 20 top logprobs took
148 MB (1.1 KB per logprob entry). So a non-streamed request may ask for at most `MAX_HELD_TOKENS`
tokens (`prompts x n x max_tokens`, `max_tokens` resolved to what the context leaves when it is
not given) and, with logprobs, at most `MAX_HELD_LOGPROBS` logprob entries (those tokens x
(1 + logprobs)); past either it is refused with 400 before it is admitted, and told to stream.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvasir.runtime.engine.llm_engine import PreparedRequest
from kvasir.runtime.sample.params import InvalidParameterError

MAX_HELD_TOKENS = 1 << 20  # a held token without logprobs is its id and its text
MAX_HELD_LOGPROBS = 1 << 17  # about 1.1 KB each (chat); 6,241 tokens with 20 logprobs


def check_held_answer(
    prepared: Sequence[PreparedRequest], *, max_tokens_param: str, logprobs_param: str
) -> None:
    """Raise InvalidParameterError naming the field to lower when the answer would hold too much."""
    params = prepared[0].params
    tokens = params.n * sum(p.max_tokens for p in prepared)
    advice = "or set stream to true (a streamed answer holds nothing back)"
    if tokens > MAX_HELD_TOKENS:
        raise InvalidParameterError(
            max_tokens_param,
            f"a non-streamed answer may hold at most {MAX_HELD_TOKENS} tokens (prompts x n x max_tokens); "
            f"this one could hold {tokens}. Lower n or {max_tokens_param}, {advice}.",
        )
    if params.logprobs is not None and tokens * (1 + params.logprobs) > MAX_HELD_LOGPROBS:
        raise InvalidParameterError(
            logprobs_param,
            f"a non-streamed answer may hold at most {MAX_HELD_LOGPROBS} logprobs (tokens x (1 + "
            f"{logprobs_param})); this one could hold {tokens} x {1 + params.logprobs} = "
            f"{tokens * (1 + params.logprobs)}. Lower {logprobs_param}, n or {max_tokens_param}, {advice}.",
        )
