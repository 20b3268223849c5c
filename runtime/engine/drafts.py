"""After each step, who drafts what: the engine's side of speculative decoding.

The scheduler verifies whatever drafts a request carries (`Request.spec_token_ids`); this module
fills them after each step for the requests that just got tokens, with the configured drafter
(prompt lookup here, a draft model or the target's first layers in the model runner), and turns
speculation down for requests whose drafts keep being rejected (`SpeculationController`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvasir.runtime.core.kv_cache.manager import KVCacheManager
from kvasir.runtime.core.request import Request
from kvasir.runtime.outputs import StepResult
from kvasir.runtime.spec_decode.config import SpeculativeConfig
from kvasir.runtime.spec_decode.controller import SpeculationController
from kvasir.runtime.spec_decode.ngram import NgramProposer
from kvasir.runtime.worker.model_runner import ModelRunner


class DraftProposer:
    """Proposes the next step's drafts; `enabled` is False without a speculative config."""

    def __init__(self, config: SpeculativeConfig | None, runner: ModelRunner | None) -> None:
        self.config = config
        self._runner = runner
        self._ngram: NgramProposer | None = None
        self._controller: SpeculationController | None = None
        if config is not None:
            self._controller = SpeculationController(config.min_acceptance_rate)
            if config.method == "ngram":
                self._ngram = NgramProposer(*config.ngram_range)

    @classmethod
    def create(cls, config: SpeculativeConfig | None, runner: ModelRunner) -> DraftProposer:
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

    def after_step(
        self,
        result: StepResult,
        updated: Sequence[Request],
        finished_request_ids: Sequence[str],
        kv_cache: KVCacheManager,
    ) -> None:
        """Learn from this step's verified drafts, then draft for the requests that got a token."""
        controller = self._controller
        assert self.config is not None and controller is not None
        controller.tick()
        controller.forget(list(finished_request_ids))
        if result.num_draft_tokens is not None:
            for request_id, num_drafted, token_ids in zip(
                result.request_ids, result.num_draft_tokens, result.token_ids, strict=True
            ):
                if num_drafted:
                    controller.observe(request_id, num_drafted, len(token_ids) - 1)
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
            for request in drafting:
                request.spec_token_ids = self._ngram.propose(request.all_token_ids, k)
            return
        assert self._runner is not None
        drafts = self._runner.propose_drafts(
            [request.all_token_ids[-1] for request in drafting],
            [request.num_tokens for request in drafting],
            [kv_cache.block_ids(request.request_id) for request in drafting],
        )
        for request, proposed in zip(drafting, drafts, strict=True):
            request.spec_token_ids = proposed
