"""Speculation that turns itself down: a request whose drafts are mostly rejected pauses drafting.

Verification is not free (each draft is one more token in the forward pass), so a request whose
drafts keep failing (plain chat under prompt lookup, a draft model that disagrees) stops
speculating for a while and probes again later, with the pause doubling while probes fail.

A new request starts from what the engine has seen across requests: while drafts are accepted,
optimistically; once the engine-wide acceptance has fallen below the threshold (a drafter that
does not suit this traffic), from the threshold and with the longest pause, so one rejected run
pauses it for long. Without that, every new request would pay several rejected runs before its
own estimate fell and several short pauses after (measured with a drafter whose drafts are all
rejected: 9 runs per 55-token request, each costing about two plain steps with layer_skip).
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest verified run in the running acceptance estimates (a request's and the
# engine's): after five rejected runs in a row either falls below the default threshold, 0.2.
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
        self.engine_acceptance = 1.0  # engine-wide running estimate; optimistic at start

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
        rate = num_accepted / num_drafted
        state = self._requests.get(request_id)
        if state is None:
            state = _RequestState()
            if self.engine_acceptance < self.min_acceptance_rate:
                state.acceptance, state.pause_steps = self.min_acceptance_rate, _MAX_PAUSE_STEPS
            self._requests[request_id] = state
        self.engine_acceptance = (1 - _EMA_WEIGHT) * self.engine_acceptance + _EMA_WEIGHT * rate
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
