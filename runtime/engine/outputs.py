"""What the engine hands to its callers after each step: per-request deltas of new tokens and text."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvasir.runtime.core.request import RequestTimes
from kvasir.runtime.outputs import TokenLogprob

__all__ = ["Completion", "CompletionDelta", "GenerationResult", "RequestOutput", "TokenLogprob"]


@dataclass(frozen=True)
class CompletionDelta:
    """One choice's progress in one step: only what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    times: RequestTimes | None = None  # set on the final output of the choice
    num_output_tokens: int = 0  # cumulative

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """A request's step output; `outputs` holds the choices that changed this step."""

    request_id: str
    outputs: list[CompletionDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool  # every choice has finished


@dataclass
class Completion:
    """A finished choice, accumulated from its deltas (offline use: `LLMEngine.generate`)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass
class GenerationResult:
    """All choices of one finished request."""

    request_id: str
    num_prompt_tokens: int
    choices: list[Completion]
