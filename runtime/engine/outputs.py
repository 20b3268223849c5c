"""What the engine hands to its callers after each step: per-request deltas of new tokens and text."""

from __future__ import annotations

from dataclasses import dataclass, field

# Records the server reads, re-exported so that it imports the engine and nothing below it.
from kvasir.runtime.core.request import RequestTimes
from kvasir.runtime.outputs import TokenLogprob

__all__ = [
    "Completion",
    "CompletionDelta",
    "GenerationResult",
    "RequestOutput",
    "RequestTimes",
    "TokenLogprob",
    "record_times",
]


@dataclass(frozen=True)
class CompletionDelta:
    """One choice's progress in one step: only what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    time: float  # time.monotonic() these tokens were sampled at; without tokens (an abort), it ended at
    first_scheduled: float | None  # when the choice first ran; None if it never did
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_output_tokens: int = 0  # cumulative

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def record_times(times: RequestTimes, delta: CompletionDelta) -> None:
    """Extend a choice's timing record with one of its deltas (first run, tokens, end).

    The record is built from every delta, not handed over with the last one, so it is complete
    however the choice ends: in the engine, on a stop string in the text side, or by a consumer
    that stops reading (then it sets `times.finished` itself)."""
    if times.first_scheduled is None:
        times.first_scheduled = delta.first_scheduled
    if delta.token_ids:
        if times.first_token is None:
            times.first_token = delta.time
        times.token_times.extend([delta.time] * len(delta.token_ids))
    if delta.finish_reason is not None:
        times.finished = delta.time


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
