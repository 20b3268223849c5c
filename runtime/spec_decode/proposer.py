"""After each step, who drafts what: the engine's one entry into speculative decoding.

The scheduler verifies whatever drafts a request carries (`Request.spec_token_ids`); this module
fills them after each step for the requests that just got tokens, with the configured drafter
(prompt lookup here, a draft model or the target's first layers through the model runner), turns
speculation down for requests whose drafts keep being rejected (`SpeculationController`), and
counts every verified run (`SpecDecodeStats`).

It reads the scheduler's requests, its block tables and the model runner through the small
protocols below, so speculative decoding imports neither the scheduler nor the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvasir.runtime.outputs import StepResult
from kvasir.runtime.spec_decode.config import SpeculativeConfig
from kvasir.runtime.spec_decode.controller import SpeculationController
from kvasir.runtime.spec_decode.ngram import NgramProposer
from kvasir.runtime.spec_decode.stats import SpecDecodeStats


class DraftGrammar(Protocol):
    """A request's grammar state, as drafting reads it (structured output)."""

    def valid_prefix(self, token_ids: Sequence[int]) -> int: ...


class DraftingRequest(Protocol):
    """What drafting reads of a request, and the one field it writes (the scheduler's `Request`)."""

    spec_token_ids: list[int]

    @property
    def request_id(self) -> str: ...
    @property
    def is_finished(self) -> bool: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def grammar(self) -> DraftGrammar | None: ...


class BlockTables(Protocol):
    """Where a request's KV lives (the KV cache manager): a model drafter writes there too."""

    def block_ids(self, request_id: str) -> list[int]: ...


class ModelDrafter(Protocol):
    """The model runner's drafting call, for the model-based methods (it owns the weights)."""

    def propose_drafts(
        self, last_token_ids: list[int], num_tokens: list[int], block_tables: list[list[int]]
    ) -> list[list[int]]: ...


class DraftProposer:
    """Proposes the next step's drafts; `enabled` is False without a speculative config."""

    def __init__(self, config: SpeculativeConfig | None, runner: ModelDrafter | None) -> None:
        self.config = config
        self._runner = runner
        self._ngram: NgramProposer | None = None
        self._controller: SpeculationController | None = None
        self.stats = SpecDecodeStats()
        if config is not None:
            self._controller = SpeculationController(config.min_acceptance_rate)
            if config.method == "ngram":
                self._ngram = NgramProposer(*config.ngram_range)

    @classmethod
    def create(cls, config: SpeculativeConfig | None, runner: ModelDrafter) -> DraftProposer:
        return cls(config, runner if config is not None and config.method != "ngram" else None)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past its scheduled tokens a request needs for a drafter that writes KV."""
        if self.config is None or self.config.method == "ngram":
            return 0
        return self.config.num_speculative_tokens

    def stats_snapshot(self) -> SpecDecodeStats | None:
        """The counters so far; None when speculative decoding is off."""
        return self.stats.snapshot() if self.enabled else None

    def after_step(
        self,
        result: StepResult,
        updated: Sequence[DraftingRequest],
        finished_request_ids: Sequence[str],
        block_tables: BlockTables,
    ) -> None:
        """Learn from this step's verified drafts, then draft for the requests that got a token.

        `updated` are the requests the scheduler applied this step's tokens to (`Scheduler.update`)."""
        controller = self._controller
        assert self.config is not None and controller is not None
        controller.tick()
        controller.forget(list(finished_request_ids))
        if result.num_draft_tokens is not None:
            self._learn(result, {request.request_id for request in updated})
        k = self.config.num_speculative_tokens
        drafting = [
            request
            for request in updated
            if not request.is_finished
            and controller.wants_drafts(request.request_id)
            # At least one draft must fit before max_tokens and the context length.
            and request.num_output_tokens + 1 < request.max_tokens
        ]
        if not drafting:
            return
        if self._ngram is not None:
            drafts = [self._ngram.propose(request.all_token_ids, k) for request in drafting]
        else:
            assert self._runner is not None
            drafts = self._runner.propose_drafts(
                [request.all_token_ids[-1] for request in drafting],
                [request.num_tokens for request in drafting],
                [block_tables.block_ids(request.request_id) for request in drafting],
            )
        for request, proposed in zip(drafting, drafts, strict=True):
            grammar = request.grammar
            # Structured output: verify only the drafts the grammar accepts (the rest would be
            # rejected anyway, after costing their verification rows).
            request.spec_token_ids = (
                proposed if grammar is None else proposed[: grammar.valid_prefix(proposed)]
            )

    def _learn(self, result: StepResult, applied: set[str]) -> None:
        """Each verified run: its acceptance to the controller, and to the counters when the
        scheduler applied it (a request aborted while its step ran never got those tokens)."""
        assert self._controller is not None and result.num_draft_tokens is not None
        for request_id, num_drafted, token_ids in zip(
            result.request_ids, result.num_draft_tokens, result.token_ids, strict=True
        ):
            if num_drafted:
                # The emitted tokens are the accepted drafts plus one from the target.
                num_accepted = len(token_ids) - 1
                self._controller.observe(request_id, num_drafted, num_accepted)
                if request_id in applied:
                    self.stats.record(num_drafted, num_accepted)
