"""Verifying drafts in the target's step: one sampling row per verified position, rejection
sampling on those rows, and each request's accepted run.

A request verifying K drafts has K + 1 rows of logits: row i scores draft i (or, for the last, the
bonus token). The rows after a draft see it as output (penalties, min_tokens, the noise position),
as if that draft had been accepted. The model runner calls `verify_step` when a step carries drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvasir.runtime.core.scheduler_output import RequestView, ScheduledRequest
from kvasir.runtime.outputs import SamplerOutput
from kvasir.runtime.sample.metadata import SamplingBatch
from kvasir.runtime.sample.params import SamplingRow
from kvasir.runtime.sample.sampler import (
    exponential_noise,
    process_logits,
    sampling_probs,
    uniform_noise,
    with_logprobs,
)

# The acceptance draw's own stream: the seed salted, so it is independent of the token race
# (below 2**63, so an int64 as it stands).
_ACCEPT_SALT = 0x5EC0DEC0FFEE1234


@dataclass(frozen=True)
class VerifiedStep:
    """A verification step's outcome, per sampled request in the plan's order."""

    output: SamplerOutput  # one row per verified position (K + 1 per request)
    token_ids: list[list[int]]  # the accepted drafts, then one token from the target
    rows: list[int]  # rows each request took in `output`
    num_draft_tokens: list[int]


def verify_step(
    logits: torch.Tensor,
    sampled: Sequence[ScheduledRequest],
    vocab_size: int,
    device: torch.device,
    token_bitmask: torch.Tensor | None = None,
) -> VerifiedStep:
    """Verify every sampled request's drafts against `logits` (its K + 1 rows each, in order).

    `token_bitmask` (structured output) has a row per verified position, each filled as if the
    drafts before it were accepted: a draft the grammar refuses is never accepted, and the token
    emitted in its place is one the grammar allows."""
    rows: list[SamplingRow] = []
    row_drafts: list[int] = []
    for item in sampled:
        rows.extend(verification_rows(item.request, item.spec_token_ids))
        row_drafts.extend(item.spec_token_ids)
        row_drafts.append(-1)  # the last row scores the bonus token: nothing to verify
    batch = SamplingBatch.build(rows, vocab_size, device)
    if token_bitmask is not None:
        batch = dataclasses.replace(batch, token_bitmask=token_bitmask)
    output = verify_rows(logits, batch, torch.tensor(row_drafts, dtype=torch.int64, device=device))
    assert output.accepted is not None
    token_ids, counts, row = [], [], 0
    for item in sampled:
        num_drafts = len(item.spec_token_ids)
        token_ids.append(accepted_run(output.token_ids, output.accepted, row, num_drafts))
        counts.append(num_drafts + 1)
        row += num_drafts + 1
    return VerifiedStep(output, token_ids, counts, [len(item.spec_token_ids) for item in sampled])


def verify_rows(logits: torch.Tensor, batch: SamplingBatch, draft_token_ids: torch.Tensor) -> SamplerOutput:
    """The sampler's processing of `logits` [R, V] (penalties, suppression), then `verify_drafts`;
    logprobs, when asked, are of the emitted tokens under the raw distribution."""
    raw, processed = process_logits(logits, batch)
    tokens, accepted = verify_drafts(processed, batch, draft_token_ids)
    return with_logprobs(tokens, raw, batch, accepted.tolist())


def verify_drafts(
    processed: torch.Tensor, batch: SamplingBatch, draft_token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of deterministic drafts: ([R] emitted token, [R] draft accepted).

    Row r scores the draft d placed at its position (`draft_token_ids`, -1 where a row has none),
    over `processed` logits (penalties and suppression applied). Greedy rows accept d when it is
    the argmax, so the output equals decoding without speculation. Sampled rows accept d with
    probability p(d) under the target's processed distribution p (a drafter that proposes
    deterministically is a point mass q, and min(1, p/q) = p(d)); a rejected row emits a token
    drawn from the residual, p without d, renormalised. Either way each emitted token is
    distributed exactly as p (Leviathan et al., 2023). Rows without a draft sample as usual.
    The caller keeps a request's accepted prefix and the emitted token of its first rejection.
    """
    has_draft = draft_token_ids >= 0
    drafts = draft_token_ids.clamp(min=0)
    tokens = processed.argmax(dim=-1)
    accepted = has_draft & (tokens == drafts)
    if not batch.all_greedy:
        rows = torch.nonzero(~batch.greedy_mask).squeeze(1)
        probs = sampling_probs(processed[rows], batch, rows)
        row_drafts, row_has_draft = drafts[rows], has_draft[rows]
        draft_probs = probs.gather(1, row_drafts.unsqueeze(1)).squeeze(1)
        coin = uniform_noise(batch.seeds[rows] ^ _ACCEPT_SALT, batch.output_positions[rows], 1)[:, 0]
        accepted[rows] = row_has_draft & (coin < draft_probs)
        residual = probs.masked_fill(
            row_has_draft.unsqueeze(1)
            & (torch.arange(probs.shape[1], device=probs.device) == row_drafts.unsqueeze(1)),
            0.0,
        )
        # A draft with probability 1 leaves nothing to draw from, but it is then always accepted.
        noise = exponential_noise(batch.seeds[rows], batch.output_positions[rows], probs.shape[1])
        tokens[rows] = (residual / noise).argmax(dim=-1)
    return torch.where(accepted, drafts, tokens), accepted


def accepted_run(tokens: list[int], accepted: list[bool], first_row: int, num_drafts: int) -> list[int]:
    """A request's emitted tokens: its rows' tokens up to and including the first rejection."""
    run = []
    for row in range(first_row, first_row + num_drafts + 1):
        run.append(tokens[row])
        if row == first_row + num_drafts or not accepted[row]:
            break
    return run


class DraftedRow:
    """Request `request` as it would stand after its first drafts were accepted: the row that
    scores the next draft sees them in its output (penalties, min_tokens, the noise position)."""

    __slots__ = ("eos_token_ids", "output_token_ids", "prompt_token_ids", "sampling_params", "seed")

    def __init__(self, request: RequestView, accepted_drafts: list[int]) -> None:
        self.sampling_params = request.sampling_params
        self.seed = request.seed
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = request.output_token_ids + accepted_drafts
        self.eos_token_ids = request.eos_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def verification_rows(request: RequestView, drafts: list[int]) -> list[SamplingRow]:
    """The 1 + len(drafts) sampling rows of a request verifying `drafts`, in position order."""
    return [request, *(DraftedRow(request, drafts[:count]) for count in range(1, len(drafts) + 1))]
