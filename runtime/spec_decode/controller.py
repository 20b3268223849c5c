"""Speculation that turns itself down: a request whose drafts are mostly rejected pauses drafting.

Verification is not free (each draft is one more token in the forward pass), so a request whose
drafts keep failing (plain chat under prompt lookup, a draft model that disagrees) stops
speculating for a while and probes again later, with the pause doubling while probes fail.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest verified run in the running acceptance estimate.
_EMA_WEIGHT = 0.3
_FIRST_PAUSE_STEPS = 4
_MAX_PAUSE_STEPS = 64


@dataclass(slots=True)
class _RequestState:
    acceptance: float = 1.0  # optimistic: a new request gets to try
    paused_until: int = 0
    pause_steps: int = _FIRST_PAUSE_STEPS


class SpeculationController:
    """Per request: whether to draft this step; fed with each verified run's acceptance."""

    def __init__(self, min_acceptance_rate: float) -> None:
        self.min_acceptance_rate = min_acceptance_rate
        self._step = 0
        self._requests: dict[str, _RequestState] = {}

    def tick(self) -> None:
        """One engine step has passed."""
        self._step += 1

    def wants_drafts(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        return state is None or self._step >= state.paused_until

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """Record a verified run of `num_drafted` drafts of which `num_accepted` were accepted."""
        if num_drafted <= 0:
            return
        state = self._requests.setdefault(request_id, _RequestState())
        rate = num_accepted / num_drafted
        state.acceptance = (1 - _EMA_WEIGHT) * state.acceptance + _EMA_WEIGHT * rate
        if state.acceptance >= self.min_acceptance_rate:
            state.pause_steps = _FIRST_PAUSE_STEPS
            return
        state.paused_until = self._step + state.pause_steps
        state.pause_steps = min(2 * state.pause_steps, _MAX_PAUSE_STEPS)
        # A probe after the pause starts from the threshold: one good run resumes drafting.
        state.acceptance = self.min_acceptance_rate

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)
