"""Per-request sampling parameters, validated once when a request is created.

An invalid value raises `InvalidParameterError` naming the field, so the HTTP layer can answer 400
with `param` set and the CLI can print a one-line message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvasir.runtime.structured.params import StructuredOutputs


class InvalidParameterError(ValueError):
    """A request parameter is out of range; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


# OpenAI caps top_logprobs at 20; vLLM allows more, but 20 keeps per-step work bounded.
# Stop strings are checked against each step's new text, one search per string: bounding their
# number and length bounds that work per step, whatever a request sends (OpenAI allows 4 strings;
# these limits are generous).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARACTERS = 4096
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; the fields and defaults follow vLLM / OpenAI."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k truncation
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's plus top k
    priority: int = 0  # lower runs first (only with the priority scheduling policy)
    # A grammar the output must follow (JSON schema, regex, choice, Lark); None: free text.
    structured_outputs: StructuredOutputs | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_float("temperature", self.temperature, minimum=0.0)
        _check_float("top_p", self.top_p, minimum=0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_float("min_p", self.min_p, minimum=0.0)
        if self.min_p > 1.0:
            raise InvalidParameterError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            # The sampler keys its noise on a 64-bit seed; vLLM accepts the same int64 range.
            _check_int("seed", self.seed, minimum=-(2**63), maximum=2**63 - 1)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidParameterError(name, f"must be in [-2, 2], got {value}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise InvalidParameterError(
                "repetition_penalty", f"must be greater than 0, got {self.repetition_penalty}"
            )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                "min_tokens",
                f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameterError("stop", "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParameterError(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        if sum(len(s) for s in self.stop) > MAX_STOP_CHARACTERS:
            raise InvalidParameterError(
                "stop", f"the stop strings may hold at most {MAX_STOP_CHARACTERS} characters in all"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParameterError(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise InvalidParameterError(
                    "logprobs", f"must be at most {MAX_LOGPROBS}, got {self.logprobs}"
                )
        # An int32 either way: the scheduler orders requests by it, and clients send it as one.
        _check_int("priority", self.priority, minimum=-(2**31), maximum=2**31 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        """top_k with the "disabled" spellings (0, -1) normalised to 0."""
        return max(self.top_k, 0)


def _check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidParameterError(name, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidParameterError(name, f"must be at most {maximum}, got {value}")


def _check_float(name: str, value: object, *, minimum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidParameterError(name, f"must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidParameterError(name, f"must be at least {minimum}, got {value}")


class SamplingRow(Protocol):
    """What sampling reads of a request: the scheduler's request (through `RequestView`), or a view
    of one with drafts appended. Declared here, torch-free, so the scheduler's hand-off module can
    extend it without importing the sampler."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def seed(self) -> int: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def num_output_tokens(self) -> int: ...
