"""Turns scheduler updates into per-request outputs: detokenization, stop strings, logprobs, n > 1."""

from __future__ import annotations

from dataclasses import dataclass

from kvasir.runtime.core.request import Request
from kvasir.runtime.engine.detokenizer import IncrementalDetokenizer
from kvasir.runtime.engine.outputs import CompletionDelta, RequestOutput
from kvasir.runtime.loader.tokenizer import Tokenizer
from kvasir.runtime.outputs import StepResult, TokenLogprob


@dataclass
class _Choice:
    request: Request
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    num_emitted: int = 0  # output tokens already handed out in earlier deltas


@dataclass
class _Parent:
    child_ids: list[str]
    num_prompt_tokens: int
    num_finished: int = 0


class OutputProcessor:
    """Owns the detokenizer of every live choice and groups choices back under their request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._choices: dict[str, _Choice] = {}
        self._parents: dict[str, _Parent] = {}

    def add(self, parent_id: str, children: list[Request]) -> None:
        child_ids = [child.request_id for child in children]
        self._parents[parent_id] = _Parent(child_ids, children[0].num_prompt_tokens)
        for index, child in enumerate(children):
            params = child.sampling_params
            detokenizer = IncrementalDetokenizer(
                self._tokenizer.backend,
                child.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            self._choices[child.request_id] = _Choice(child, parent_id, index, detokenizer)

    def has(self, parent_id: str) -> bool:
        return parent_id in self._parents

    def request(self, child_id: str) -> Request:
        return self._choices[child_id].request

    def child_ids(self, parent_id: str) -> list[str]:
        """The ids of the request's choices that are still live."""
        parent = self._parents.get(parent_id)
        if parent is None:
            return []
        return [child_id for child_id in parent.child_ids if child_id in self._choices]

    def process(
        self, updated: list[Request], step: StepResult | None
    ) -> tuple[list[RequestOutput], list[str]]:
        """Build this step's outputs; also return the ids of choices a stop string just ended."""
        logprobs = _logprobs_by_request(step) if step is not None else {}
        by_parent: dict[str, list[CompletionDelta]] = {}
        cached_tokens: dict[str, int] = {}
        stopped_by_string: list[str] = []
        for request in updated:
            choice = self._choices.get(request.request_id)
            if choice is None:
                continue
            new_tokens = request.output_token_ids[choice.num_emitted :]
            text, new_tokens = _detokenize(choice.detokenizer, new_tokens)
            choice.num_emitted += len(new_tokens)
            finish_reason = request.status.finish_reason
            if choice.detokenizer.stop_string_hit is not None and request.stop_reason is None:
                request.stop_reason = choice.detokenizer.stop_string_hit
                if finish_reason is None:
                    stopped_by_string.append(request.request_id)
                finish_reason = "stop"
            if finish_reason is not None:
                text += choice.detokenizer.flush()
            wants_logprobs = request.sampling_params.logprobs is not None
            token_logprobs = logprobs.get(request.request_id) if wants_logprobs else None
            delta = CompletionDelta(
                index=choice.index,
                text=text,
                token_ids=new_tokens,
                logprobs=token_logprobs[: len(new_tokens)] if token_logprobs is not None else None,
                finish_reason=finish_reason,
                stop_reason=request.stop_reason,
                times=request.times if finish_reason is not None else None,
                num_output_tokens=choice.num_emitted,
            )
            by_parent.setdefault(choice.parent_id, []).append(delta)
            cached_tokens[choice.parent_id] = max(
                cached_tokens.get(choice.parent_id, 0), request.num_cached_tokens
            )
            if finish_reason is not None:
                del self._choices[request.request_id]
                self._parents[choice.parent_id].num_finished += 1
        outputs = []
        for parent_id, deltas in by_parent.items():
            parent = self._parents[parent_id]
            finished = parent.num_finished == len(parent.child_ids)
            outputs.append(
                RequestOutput(
                    request_id=parent_id,
                    outputs=deltas,
                    num_prompt_tokens=parent.num_prompt_tokens,
                    num_cached_tokens=cached_tokens[parent_id],
                    finished=finished,
                )
            )
            if finished:
                del self._parents[parent_id]
        return outputs, stopped_by_string


def _detokenize(detokenizer: IncrementalDetokenizer, new_tokens: list[int]) -> tuple[str, list[int]]:
    """Feed the step's tokens; a stop string ends the choice at the token that completed it, so
    tokens after it (the rest of an accepted speculative run) are dropped."""
    if len(new_tokens) <= 1:
        return (detokenizer.update(new_tokens) if new_tokens else ""), new_tokens
    text = []
    for count, token_id in enumerate(new_tokens, start=1):
        text.append(detokenizer.update([token_id]))
        if detokenizer.stop_string_hit is not None:
            return "".join(text), new_tokens[:count]
    return "".join(text), new_tokens


def _logprobs_by_request(step: StepResult) -> dict[str, list[TokenLogprob]]:
    if step.logprobs is None:
        return {}
    return dict(zip(step.request_ids, step.logprobs, strict=True))
