"""Turns choice updates into per-request outputs: detokenization, stop strings, logprobs, n > 1."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer as BackendTokenizer

from kvasir.runtime.engine.output.detokenizer import IncrementalDetokenizer
from kvasir.runtime.engine.output.updates import ChoiceSpec, ChoiceUpdate
from kvasir.runtime.engine.outputs import CompletionDelta, RequestOutput


@dataclass
class _Choice:
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    num_emitted: int = 0  # output tokens already handed out in earlier deltas


@dataclass
class _Parent:
    num_choices: int
    num_prompt_tokens: int
    num_finished: int = 0


class OutputProcessor:
    """Owns the detokenizer of every live choice and groups choices back under their request.

    It sees only `ChoiceSpec`s and `ChoiceUpdate`s (plain data), so it runs in the engine's
    process or in the output process alike."""

    def __init__(self, tokenizer: BackendTokenizer) -> None:
        self._tokenizer = tokenizer
        self._choices: dict[str, _Choice] = {}
        self._parents: dict[str, _Parent] = {}

    def add(self, specs: list[ChoiceSpec]) -> None:
        for spec in specs:
            if spec.parent_id not in self._parents:
                self._parents[spec.parent_id] = _Parent(spec.num_choices, len(spec.prompt_token_ids))
            detokenizer = IncrementalDetokenizer(
                self._tokenizer,
                spec.prompt_token_ids,
                skip_special_tokens=spec.skip_special_tokens,
                stop=spec.stop,
                include_stop_str_in_output=spec.include_stop_str_in_output,
            )
            self._choices[spec.child_id] = _Choice(spec.parent_id, spec.index, detokenizer)

    def process(self, updates: list[ChoiceUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Build this step's outputs; also return the ids of choices a stop string just ended."""
        by_parent: dict[str, list[CompletionDelta]] = {}
        cached_tokens: dict[str, int] = {}
        stopped_by_string: list[str] = []
        for update in updates:
            choice = self._choices.get(update.child_id)
            if choice is None:
                continue  # ended here already (a stop string) before the engine knew
            text, new_tokens = _detokenize(choice.detokenizer, update.new_token_ids)
            choice.num_emitted += len(new_tokens)
            finish_reason = update.finish_reason
            stop_reason: int | str | None = update.stop_reason
            stop_string = choice.detokenizer.stop_string_hit
            if stop_string is not None and stop_reason is None:
                if finish_reason is None:
                    stopped_by_string.append(update.child_id)
                finish_reason, stop_reason = "stop", stop_string
            if finish_reason is not None:
                text += choice.detokenizer.flush()
            delta = CompletionDelta(
                index=choice.index,
                text=text,
                token_ids=new_tokens,
                # A stop string ends the choice at the step whose token completed it.
                time=update.time,
                first_scheduled=update.first_scheduled,
                logprobs=update.logprobs[: len(new_tokens)] if update.logprobs is not None else None,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                num_output_tokens=choice.num_emitted,
            )
            by_parent.setdefault(choice.parent_id, []).append(delta)
            cached_tokens[choice.parent_id] = max(
                cached_tokens.get(choice.parent_id, 0), update.num_cached_tokens
            )
            if finish_reason is not None:
                del self._choices[update.child_id]
                self._parents[choice.parent_id].num_finished += 1
        outputs = []
        for parent_id, deltas in by_parent.items():
            parent = self._parents[parent_id]
            finished = parent.num_finished == parent.num_choices
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
