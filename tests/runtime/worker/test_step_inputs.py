"""`build_step_inputs` on a hand-written plan: every field against values worked out by hand."""

from __future__ import annotations

import torch

from kvasir.runtime.core.request import Request
from kvasir.runtime.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.worker.step_inputs import build_step_inputs


def _request(request_id: str, prompt: list[int], outputs: tuple[int, ...] = ()) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=8), max_tokens=8, seed=0)
    for token in outputs:
        request.append_output_token(token, now=0.0)
    return request


def test_mixed_step_of_a_decode_a_mid_block_chunk_and_an_unfinished_prompt() -> None:
    decode = _request("decode", [1, 2, 3, 4, 5], outputs=(6,))  # 6 tokens, the last one new
    chunk = _request("chunk", list(range(10, 20)))  # 10 prompt tokens, 5 already cached
    partial = _request("partial", [30, 31, 32, 33, 34, 35, 36])  # first 3 of 7 prompt tokens
    plan = SchedulerOutput(
        scheduled=[
            ScheduledRequest(decode, start=5, num_tokens=1, block_ids=[7, 2], sample=True),
            ScheduledRequest(chunk, start=5, num_tokens=5, block_ids=[4, 9, 0], sample=True),
            ScheduledRequest(partial, start=0, num_tokens=3, block_ids=[5], sample=False),
        ],
        num_batched_tokens=9,
        preempted=[],
        finished_request_ids=[],
    )
    inputs = build_step_inputs(plan, block_size=4)

    assert inputs.num_tokens == 9
    assert inputs.input_ids.tolist() == [6, 15, 16, 17, 18, 19, 30, 31, 32]
    assert inputs.positions.tolist() == [5, 5, 6, 7, 8, 9, 0, 1, 2]
    # Position p of a request lives in its block p // 4 at offset p % 4.
    assert inputs.attn.slot_mapping.tolist() == [2 * 4 + 1, 9 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3, 0, 1, 20, 21, 22]
    assert inputs.attn.block_table.tolist() == [[7, 2, 0], [4, 9, 0], [5, 0, 0]]
    assert inputs.attn.query_start_loc.tolist() == [0, 1, 6, 9]
    assert inputs.attn.seq_lens.tolist() == [6, 10, 3]
    assert (inputs.attn.max_query_len, inputs.attn.max_seq_len) == (5, 10)
    assert inputs.logits_indices.tolist() == [0, 5]  # the last row of each sampled request
    dtypes = (inputs.input_ids.dtype, inputs.positions.dtype, inputs.attn.slot_mapping.dtype)
    assert dtypes == (torch.int64, torch.int64, torch.int64)
    assert inputs.attn.block_table.dtype == inputs.attn.seq_lens.dtype == torch.int32
    assert inputs.attn.query_start_loc.dtype == torch.int32
