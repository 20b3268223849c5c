"""What the engine hands the text side each step: plain, picklable records per choice.

The engine's thread turns scheduler updates into `ChoiceUpdate`s (new token ids, logprobs, when
they were made, how the choice finished) with `OutputCollector`, which costs a few attribute reads
per request; the text work (detokenizing, stop strings, grouping n > 1 choices) happens in
`OutputProcessor`, in this process or in the output process (`process.py`). Torch-free,
like the text side.

Every update carries its own timestamps rather than the finishing update carrying the request's
whole timing record: the text side may end a choice (a stop string) on an update the engine did
not finish, and a consumer that leaves early never sees the final update, so whoever ends a choice
must already hold its timing, built from the updates seen so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvasir.runtime.core.request import Request
from kvasir.runtime.outputs import StepResult, TokenLogprob


@dataclass(frozen=True, slots=True)
class ChoiceSpec:
    """A new choice, as the text side needs it: where it belongs and how its text is made."""

    child_id: str
    parent_id: str
    index: int
    num_choices: int
    prompt_token_ids: list[int]
    skip_special_tokens: bool
    stop: tuple[str, ...]
    include_stop_str_in_output: bool


class ChoiceUpdate(NamedTuple):
    """One choice's progress in one step (only what is new). A tuple: a step sends hundreds of
    these to the output process, and a tuple pickles several times faster than a dataclass."""

    child_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop", "length", "abort" when the engine ended it
    stop_reason: int | None  # the stop token id, when one ended it
    time: float  # time.monotonic() its tokens were sampled at; without tokens (an abort), it ended at
    first_scheduled: float | None  # when the choice first ran; None if it never did
    num_cached_tokens: int


class OutputCollector:
    """The engine side's bookkeeping of live choices: which tokens were already handed over."""

    def __init__(self) -> None:
        self._children: dict[str, list[Request]] = {}  # parent id -> its choices
        self._num_live: dict[str, int] = {}  # parent id -> choices not finished yet
        self._parent_of: dict[str, str] = {}
        self._num_sent: dict[str, int] = {}  # live child id -> output tokens handed over

    def add(self, parent_id: str, children: list[Request]) -> list[ChoiceSpec]:
        self._children[parent_id] = list(children)
        self._num_live[parent_id] = len(children)
        specs = []
        for index, child in enumerate(children):
            params = child.sampling_params
            self._num_sent[child.request_id] = 0
            self._parent_of[child.request_id] = parent_id
            specs.append(
                ChoiceSpec(
                    child.request_id,
                    parent_id,
                    index,
                    len(children),
                    child.prompt_token_ids,
                    params.skip_special_tokens,
                    params.stop,
                    params.include_stop_str_in_output,
                )
            )
        return specs

    def has(self, parent_id: str) -> bool:
        return parent_id in self._children

    def live_children(self, parent_id: str) -> list[Request]:
        return [child for child in self._children.get(parent_id, ()) if child.request_id in self._num_sent]

    def updates(self, requests: list[Request], step: StepResult | None) -> list[ChoiceUpdate]:
        """The step's records for `requests` (those the scheduler updated, or just finished)."""
        logprobs = dict(zip(step.request_ids, step.logprobs, strict=True)) if step and step.logprobs else {}
        num_sent = self._num_sent
        updates = []
        for request in requests:
            child_id = request.request_id
            sent = num_sent.get(child_id)
            if sent is None:
                continue  # already finished (an abort after a stop string, say)
            new_tokens = request.output_token_ids[sent:]
            finish_reason = request.status.finish_reason
            token_logprobs = logprobs.get(child_id) if request.sampling_params.logprobs is not None else None
            times = request.times
            # A step's tokens and a finish in that step share the step's time; an abort between
            # steps brings no tokens, only its own time.
            at = times.finished if times.finished is not None else times.token_times[-1]
            updates.append(
                ChoiceUpdate(
                    child_id,
                    new_tokens,
                    token_logprobs,
                    finish_reason,
                    request.stop_reason if isinstance(request.stop_reason, int) else None,
                    at,
                    times.first_scheduled,
                    request.num_cached_tokens,
                )
            )
            if finish_reason is None:
                num_sent[child_id] = sent + len(new_tokens)
            else:
                self._forget(child_id)
        return updates

    def finish(self, child_ids: list[str]) -> None:
        """Forget choices the text side ended (a stop string) before the scheduler did."""
        for child_id in child_ids:
            if child_id in self._num_sent:
                self._forget(child_id)

    def _forget(self, child_id: str) -> None:
        del self._num_sent[child_id]
        parent_id = self._parent_of.pop(child_id)
        self._num_live[parent_id] -= 1
        if not self._num_live[parent_id]:  # a parent goes with its last choice
            del self._num_live[parent_id], self._children[parent_id]
