"""What a request must be to run on a model: a non-empty prompt whose token ids are in the
vocabulary, and prompt plus max_tokens within the context length. It needs the model's config and
tokenizer but not its weights, so `kvasir generate` checks a whole batch before the weights load;
LLMEngine checks every request with the same code."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.loader.model_files import ModelFiles
from kvasir.runtime.loader.tokenizer import Tokenizer
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from kvasir.runtime.structured.compiler import CompiledGrammar

# How much a tokenizer's normalizer may shrink text (NFC composes a letter and its accents): the
# prompt-length bound allows this much on top of the longest token.
PROMPT_CHARS_MARGIN = 4


class ContextLengthError(InvalidParameterError):
    """The prompt plus the tokens asked for do not fit the model's context length."""


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready to enter the scheduler (built off the engine thread)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    # Structured output: the request's compiled grammar (each choice copies its own state).
    grammar: CompiledGrammar | None = None
    # The LoRA adapter the request runs with (None: the base model).
    lora: LoRARequest | None = None
    # The client's `cache_salt` (None: none): prefix-cache hits only under the same salt.
    cache_salt: str | None = None


@dataclass(frozen=True)
class PromptCheck:
    """The limits of one model; `prepare` validates and tokenizes, raising InvalidParameterError
    that names the field. Thread-safe."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int

    @classmethod
    def for_model(cls, config: EngineConfig, files: ModelFiles) -> PromptCheck:
        return cls(files.tokenizer, files.config.vocab_size, config.context_length(files.config))

    def prepare(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        arrival_time: float | None = None,
    ) -> PreparedRequest:
        params = params or SamplingParams()
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidParameterError("prompt", "give exactly one of a prompt or prompt token ids")
        if prompt is not None:
            self.check_prompt_chars(len(prompt))
            token_ids = self.tokenizer.encode(prompt)
        else:
            if len(prompt_token_ids or ()) > self.max_model_len:
                raise ContextLengthError(
                    "prompt",
                    f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                    f"{len(prompt_token_ids or ())} token ids.",
                )
            token_ids = list(prompt_token_ids or [])
            vocab_size = self.vocab_size
            for token in token_ids:
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                    raise InvalidParameterError(
                        "prompt", f"token id {token!r} is outside the vocabulary [0, {vocab_size})"
                    )
        if not token_ids:
            raise InvalidParameterError("prompt", "the prompt is empty")
        max_tokens = self.resolve_max_tokens(len(token_ids), params)
        return PreparedRequest(
            request_id,
            token_ids,
            params,
            max_tokens,
            time.monotonic() if arrival_time is None else arrival_time,
        )

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse, without tokenizing, a prompt too long to fit whatever its tokens: tokenizing
        megabytes of text holds a CPU (and, for some tokenizers, the GIL) for seconds. The bound,
        max_model_len x the longest token x 4 (a normalizer may merge characters), is never wrong
        about what it refuses."""
        limit = self.max_model_len * self.tokenizer.max_token_chars * PROMPT_CHARS_MARGIN
        if num_chars > limit:
            raise ContextLengthError(
                param,
                f"This model's maximum context length is {self.max_model_len} tokens; a prompt of "
                f"{num_chars} characters cannot fit (at most {limit} characters can).",
            )

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        room = self.max_model_len - num_prompt_tokens
        asked = params.max_tokens if params.max_tokens is not None else max(room, 1)
        if num_prompt_tokens + asked > self.max_model_len:
            raise ContextLengthError(
                "max_tokens" if room > 0 else "prompt",
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + asked} tokens ({num_prompt_tokens} in the prompt, "
                f"{asked} for the completion). Please reduce the prompt or max_tokens.",
            )
        return asked
