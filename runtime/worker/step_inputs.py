"""The scheduler's plan for one step turned into the model's flattened inputs, on the CPU.

Built with a constant number of numpy calls per step instead of several per request: with 256
running requests the per-request version cost ~1.5 ms of Python per step, which on a GPU is a
large part of a decode step (the GPU waits for it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvasir.runtime.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvasir.runtime.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from kvasir.runtime.worker.lora_slots import StepAdapters


@dataclass(frozen=True)
class ModelInputs:
    """One step's flattened batch, on the CPU: the model's arguments and the rows to sample."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    num_tokens: int
    # Async scheduling: input_ids[pending_positions[i]] is the previous step's sampled token of
    # row pending_rows[i], written in on the device just before the step runs (empty: none).
    pending_positions: torch.Tensor | None = None
    pending_rows: torch.Tensor | None = None
    # The step's LoRA adapters per row (`--enable-lora` and at least one adapter row), else None.
    adapters: StepAdapters | None = None


def build_step_inputs(
    plan: SchedulerOutput, block_size: int, block_table: np.ndarray | None = None
) -> ModelInputs:
    """Flatten `plan`: token ids, positions, slots, block table and the rows whose logits are sampled.

    `block_table`: the step's padded table when the caller keeps one across steps
    (`PersistentBlockTable.gather`); without it, it is built from the requests' block lists.
    """
    scheduled = plan.scheduled
    num_requests = len(scheduled)
    starts = np.fromiter((item.start for item in scheduled), dtype=np.int64, count=num_requests)
    query_lens = np.fromiter((item.num_tokens for item in scheduled), dtype=np.int64, count=num_requests)
    num_tokens = int(query_lens.sum())
    if block_table is None:
        block_table = _padded_block_table(scheduled)

    # Token t of request r sits at position starts[r] + (t - first row of r).
    query_start_loc = np.zeros(num_requests + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    row_of_token = np.repeat(np.arange(num_requests), query_lens)
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], query_lens)
    slots = (
        block_table[row_of_token, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )

    input_ids = np.fromiter(
        itertools.chain.from_iterable(_token_ids(item) for item in scheduled),
        dtype=np.int64,
        count=num_tokens,
    )
    # A sampled request yields logits at its last row, and with drafts at each draft's row too:
    # row j predicts the token after the j-th scheduled token.
    num_logits = np.fromiter(
        ((1 + len(item.spec_token_ids)) * item.sample for item in scheduled),
        dtype=np.int64,
        count=num_requests,
    )
    logits_ends = query_start_loc[1:]
    logits_indices = np.repeat(logits_ends - num_logits, num_logits) + (
        np.arange(int(num_logits.sum())) - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
    )
    pending_positions = pending_rows = None
    pending = [(r, item.pending_row) for r, item in enumerate(scheduled) if item.pending_row >= 0]
    if pending:
        # A pending token is its request's first (and only) input this step.
        pending_positions = torch.tensor([int(query_start_loc[r]) for r, _ in pending], dtype=torch.int64)
        pending_rows = torch.tensor([row for _, row in pending], dtype=torch.int64)
    seq_lens = starts + query_lens
    attn = AttentionMetadata(
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slots),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return ModelInputs(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        attn=attn,
        logits_indices=torch.from_numpy(logits_indices),
        num_tokens=num_tokens,
        pending_positions=pending_positions,
        pending_rows=pending_rows,
    )


def _padded_block_table(scheduled: list[ScheduledRequest]) -> np.ndarray:
    """Every request's block ids in one flat array, scattered into zero-padded rows."""
    num_blocks = np.fromiter(
        (len(item.block_ids) for item in scheduled), dtype=np.int64, count=len(scheduled)
    )
    block_table = np.zeros((len(scheduled), int(num_blocks.max())), dtype=np.int32)
    flat_blocks = np.fromiter(
        itertools.chain.from_iterable(item.block_ids for item in scheduled),
        dtype=np.int32,
        count=int(num_blocks.sum()),
    )
    block_table[np.arange(block_table.shape[1]) < num_blocks[:, None]] = flat_blocks
    return block_table


def _token_ids(item: ScheduledRequest) -> list[int]:
    """The step's input tokens of one request: known tokens, then any drafts to verify."""
    if item.pending_row >= 0:
        return [0]  # a placeholder: the previous step's sample replaces it on the device
    if item.spec_token_ids:
        num_known = item.num_tokens - len(item.spec_token_ids)
        return item.request.all_token_ids[item.start : item.start + num_known] + item.spec_token_ids
    return item.request.all_token_ids[item.start : item.start + item.num_tokens]
