"""Where a prompt's greedy output can be made to end, for tests of every way a choice finishes.

A tiny random model says nothing meaningful, so a stop string or a stop token id is taken from
what greedy decoding of the prompt actually produces, at a known token: never the first (every
finish then has inter-token gaps to count) and where it occurs for the first time (it ends the
output exactly there).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import SamplingParams

# Token ids only: the same prompt whether sent to an engine or, as a list, to /v1/completions.
PROMPT = [9, 10, 11, 12, 13, 14, 15]
GREEDY_TOKENS = 12


@dataclass(frozen=True)
class GreedyOutput:
    """The prompt's greedy output, one token per step, with the text each token released."""

    token_ids: list[int]
    pieces: list[str]

    def stop_token(self, start: int = 2) -> int:
        """The index of the first token at or after `start` that appears there for the first time."""
        for index in range(start, len(self.token_ids)):
            if self.token_ids[index] not in self.token_ids[:index]:
                return index
        raise AssertionError(f"no new token after {start} in {self.token_ids}")

    def stop_string(self, start: int = 2) -> tuple[str, int]:
        """A stop string that first completes with token `index` (>= start): that token's text."""
        for index in range(start, len(self.pieces)):
            before, piece = "".join(self.pieces[:index]), self.pieces[index]
            readable = piece.strip() and "\ufffd" not in piece  # no half of a split character
            if readable and (before + piece).find(piece) == len(before):
                return piece, index
        raise AssertionError(f"no stop string after token {start} in {self.pieces}")


def greedy_output(engine: LLMEngine) -> GreedyOutput:
    """Decode PROMPT greedily (EOS ignored), a step at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    engine.add_request("greedy", prompt_token_ids=PROMPT, params=params)
    token_ids: list[int] = []
    pieces: list[str] = []
    while engine.has_unfinished():
        for output in engine.step():
            for delta in output.outputs:
                if delta.token_ids:
                    assert len(delta.token_ids) == 1, "one token per step, so each has its own text"
                    token_ids += delta.token_ids
                    pieces.append(delta.text)
                else:
                    pieces[-1] += delta.text  # held-back text flushed at the end
    return GreedyOutput(token_ids, pieces)
