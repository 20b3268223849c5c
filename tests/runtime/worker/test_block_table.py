"""The persistent block table gathers exactly the table a fresh build makes, step after step, while
requests join, grow, get preempted and re-admitted with other blocks, finish, and reuse ids."""

from __future__ import annotations

import random

import numpy as np
import torch

from kvasir.runtime.core.request import Request, RequestStatus
from kvasir.runtime.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.worker.block_table import PersistentBlockTable
from kvasir.runtime.worker.step_inputs import build_step_inputs


def _fresh_table(scheduled: list[ScheduledRequest]) -> np.ndarray:
    """The reference: zero-padded rows written out one by one."""
    table = np.zeros((len(scheduled), max(len(item.block_ids) for item in scheduled)), dtype=np.int32)
    for row, item in enumerate(scheduled):
        table[row, : len(item.block_ids)] = item.block_ids
    return table


def _request(request_id: str) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=8), max_tokens=8, seed=0)


def test_every_step_equals_a_fresh_build() -> None:
    rng = random.Random(0)
    table = PersistentBlockTable(capacity=2, max_blocks=2)  # grows in rows and columns as it goes
    blocks: dict[Request, list[int]] = {}
    serial = next_block = 0
    for _step in range(300):
        for _ in range(rng.randrange(0, 3)):
            request_id = f"r{rng.randrange(serial + 1)}" if rng.random() < 0.2 else f"r{serial}"
            serial += 1
            if all(r.request_id != request_id for r in blocks):
                blocks[_request(request_id)] = []
        for request in list(blocks):
            event = rng.random()
            if event < 0.08:  # finished: its release reaches the table most of the time
                request.status = RequestStatus.FINISHED_STOPPED
                del blocks[request]
                if rng.random() < 0.7:
                    table.release([request.request_id])
            elif event < 0.15:  # preempted, then re-admitted at once with other blocks
                request.num_preemptions += 1
                blocks[request] = []
        for held in blocks.values():  # every live request grows by 0..2 new blocks
            for _ in range(rng.randrange(0, 3) if held else rng.randrange(1, 4)):
                held.append(next_block)
                next_block += 1
        if not blocks:
            continue
        step = rng.sample(list(blocks), k=rng.randrange(1, len(blocks) + 1))
        scheduled = [ScheduledRequest(r, 0, 1, list(blocks[r]), True) for r in step]
        got = table.gather(scheduled)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, _fresh_table(scheduled))
    assert table.num_rows <= len(blocks) + 8  # finished requests' rows are reused


def test_preempted_request_re_admitted_with_the_same_number_of_blocks() -> None:
    """Same length, other ids: only the preemption count tells the row is stale."""
    table = PersistentBlockTable()
    request = _request("a")
    np.testing.assert_array_equal(table.gather([ScheduledRequest(request, 0, 1, [5, 6], True)]), [[5, 6]])
    request.num_preemptions += 1
    np.testing.assert_array_equal(table.gather([ScheduledRequest(request, 0, 1, [9, 2], True)]), [[9, 2]])


def test_step_inputs_with_the_persistent_table_equal_a_fresh_build() -> None:
    requests = [_request(f"r{i}") for i in range(3)]
    for request in requests:
        request.num_computed_tokens = 2
    scheduled = [
        ScheduledRequest(requests[0], 2, 1, [3], True),
        ScheduledRequest(requests[1], 0, 3, [7], True),
        ScheduledRequest(requests[2], 2, 1, [1], True),
    ]
    plan = SchedulerOutput(scheduled, 5, [], [])
    table = PersistentBlockTable()
    fresh = build_step_inputs(plan, block_size=4)
    kept = build_step_inputs(plan, block_size=4, block_table=table.gather(scheduled))
    assert torch.equal(fresh.attn.block_table, kept.attn.block_table)
    assert torch.equal(fresh.attn.slot_mapping, kept.attn.slot_mapping)
