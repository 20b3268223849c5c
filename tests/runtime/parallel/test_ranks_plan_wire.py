"""A step's plan on the wire to the other ranks: each request's prompt once, then only its new
tokens and new blocks; the rank's rebuilt plan gives the model runner the same inputs as rank 0's,
and the same request object every step until the id is reused."""

from __future__ import annotations

import pickle

from kvasir.runtime.core.request import Request, RequestStatus
from kvasir.runtime.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvasir.runtime.engine.ranks.plan_wire import PlanReceiver, PlanSender
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.worker.step_inputs import build_step_inputs


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0), max_tokens=8, seed=7)


def _plan(items: list[ScheduledRequest], finished: list[str] | None = None) -> SchedulerOutput:
    return SchedulerOutput(items, sum(item.num_tokens for item in items), [], finished or [])


def _send(sender: PlanSender, receiver: PlanReceiver, plan: SchedulerOutput) -> tuple[SchedulerOutput, int]:
    """The rank's plan, and the bytes the wire carried."""
    wire = pickle.dumps(sender.encode(plan))
    return receiver.decode(pickle.loads(wire)), len(wire)


def _same_inputs(ours: SchedulerOutput, theirs: SchedulerOutput) -> None:
    assert [item.block_ids for item in theirs.scheduled] == [item.block_ids for item in ours.scheduled]
    a, b = build_step_inputs(ours, 4), build_step_inputs(theirs, 4)
    assert a.input_ids.tolist() == b.input_ids.tolist()
    assert a.positions.tolist() == b.positions.tolist()
    assert a.attn.slot_mapping.tolist() == b.attn.slot_mapping.tolist()


def test_a_request_travels_once_then_as_new_tokens() -> None:
    sender, receiver = PlanSender(), PlanReceiver()
    prompt = list(range(100, 164))  # 64 tokens
    request = _request("a", prompt)
    prefill = _plan([ScheduledRequest(request, 0, 64, list(range(16)), True)])
    rank_plan, first_bytes = _send(sender, receiver, prefill)
    _same_inputs(prefill, rank_plan)
    rank_request = rank_plan.scheduled[0].request
    assert rank_request.all_token_ids == prompt and rank_request.grammar is None

    for step in range(3):
        request.append_output_token(500 + step, 0.0)
        decode = _plan([ScheduledRequest(request, 64 + step, 1, list(range(17)), True)])
        rank_plan, decode_bytes = _send(sender, receiver, decode)
        _same_inputs(decode, rank_plan)
        assert rank_plan.scheduled[0].request is rank_request  # the runner's rows are keyed by it
        assert decode_bytes < first_bytes / 2  # no prompt, no known blocks on the wire again
    assert sender.encode(_plan([ScheduledRequest(request, 67, 1, list(range(18)), True)])).scheduled[
        0
    ].new_block_ids == [17]
    assert rank_request.output_token_ids == [500, 501, 502]
    assert rank_request.all_token_ids == request.all_token_ids


def test_a_pending_token_is_not_sent_before_the_host_has_it() -> None:
    sender, receiver = PlanSender(), PlanReceiver()
    request = _request("a", [1, 2, 3])
    _send(sender, receiver, _plan([ScheduledRequest(request, 0, 3, [0], True)]))
    ahead = _plan([ScheduledRequest(request, 3, 1, [0], True, pending_row=0)])  # planned ahead
    rank_plan, _ = _send(sender, receiver, ahead)
    assert rank_plan.scheduled[0].pending_row == 0
    assert rank_plan.scheduled[0].request.all_token_ids == [1, 2, 3]
    request.append_output_token(9, 0.0)  # arrives on the host; the next plan carries it
    request.append_output_token(10, 0.0)
    rank_plan, _ = _send(sender, receiver, _plan([ScheduledRequest(request, 5, 1, [0], True)]))
    assert rank_plan.scheduled[0].request.all_token_ids == [1, 2, 3, 9, 10]


def test_a_finished_id_reused_is_a_new_request_on_the_rank() -> None:
    sender, receiver = PlanSender(), PlanReceiver()
    first = _request("x", [1, 2])
    rank_first = (
        _send(sender, receiver, _plan([ScheduledRequest(first, 0, 2, [0], True)]))[0].scheduled[0].request
    )
    again = _request("x", [3, 4, 5])
    rank_plan, _ = _send(sender, receiver, _plan([ScheduledRequest(again, 0, 3, [1], True)], finished=["x"]))
    rank_again = rank_plan.scheduled[0].request
    assert rank_again is not rank_first and rank_again.all_token_ids == [3, 4, 5]
    assert rank_first.status is RequestStatus.FINISHED_ABORTED  # a row sweep may reclaim it
    assert receiver.num_requests == 1
    _send(sender, receiver, _plan([], finished=["x"]))
    assert receiver.num_requests == 0


def test_preemption_and_drafts_reach_the_rank() -> None:
    sender, receiver = PlanSender(), PlanReceiver()
    request = _request("p", [1, 2, 3, 4])
    _send(sender, receiver, _plan([ScheduledRequest(request, 0, 4, [0], True)]))
    request.append_output_token(5, 0.0)
    request.num_preemptions = 1
    verify = _plan([ScheduledRequest(request, 0, 7, [2, 3], True, spec_token_ids=[6, 7])])
    rank_plan, _ = _send(sender, receiver, verify)  # blocks [2, 3] replace [0]: sent whole
    item = rank_plan.scheduled[0]
    assert item.request.num_preemptions == 1 and item.spec_token_ids == [6, 7]
    _same_inputs(verify, rank_plan)
