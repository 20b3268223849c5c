"""Persistent sampling rows build exactly the batch `SamplingBatch.build` would, step after step,
while requests join, leave, go ahead of the host (async scheduling) and reuse finished ids."""

from __future__ import annotations

import dataclasses
import random

import torch

from kvasir.runtime.core.request import Request, RequestStatus
from kvasir.runtime.sample.metadata import PendingRow, SamplingBatch
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.sample.persistent_rows import PersistentSamplingRows

VOCAB = 50


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.random()
    if kind < 0.3:
        return SamplingParams(temperature=0.0, max_tokens=20)
    return SamplingParams(
        temperature=rng.choice([0.5, 1.0, 1.3]),
        top_p=rng.choice([1.0, 0.8]),
        top_k=rng.choice([0, 5, 100]),
        min_p=rng.choice([0.0, 0.1]),
        min_tokens=rng.choice([0, 0, 3]),
        logprobs=rng.choice([None, 0, 2]),
        stop_token_ids=(7,) if rng.random() < 0.3 else (),
        seed=rng.randrange(1 << 40) if rng.random() < 0.5 else None,
        max_tokens=20,
    )


def _assert_same(got: SamplingBatch, want: SamplingBatch) -> None:
    for field in dataclasses.fields(SamplingBatch):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype, field.name
            assert torch.equal(a, b), field.name
        else:
            assert a == b, field.name


def test_every_step_equals_a_fresh_build() -> None:
    rng = random.Random(0)
    rows = PersistentSamplingRows(VOCAB, torch.device("cpu"), capacity=4)  # grows as it goes
    live: list[Request] = []
    serial = 0
    for _step in range(200):
        # Requests join (some reusing the id of one that finished) and leave.
        for _ in range(rng.randrange(0, 4)):
            request_id = f"r{rng.randrange(serial + 1)}" if rng.random() < 0.2 else f"r{serial}"
            serial += 1
            if any(r.request_id == request_id for r in live):
                continue
            live.append(
                Request(request_id, [1, 2, 3], _params(rng), max_tokens=20, seed=rng.randrange(1 << 62))
            )
        finished = [r for r in live if rng.random() < 0.1]
        for request in finished:
            request.status = RequestStatus.FINISHED_LENGTH
            live.remove(request)
        if rng.random() < 0.7:  # the release usually arrives; when it does not, the row is swept
            rows.release(r.request_id for r in finished)
        for request in live:
            request.output_token_ids.append(rng.randrange(VOCAB))
        if not live:
            continue
        step = rng.sample(live, k=rng.randrange(1, len(live) + 1))
        pending = [rng.random() < 0.5 for _ in step]
        want = SamplingBatch.build(
            [PendingRow(r) if ahead else r for r, ahead in zip(step, pending, strict=True)],
            VOCAB,
            torch.device("cpu"),
        )
        _assert_same(rows.build(step, pending), want)
    assert rows.num_rows <= len(live) + 64  # finished requests do not pile up


def test_penalties_fall_back_to_a_fresh_build() -> None:
    rows = PersistentSamplingRows(VOCAB, torch.device("cpu"))
    penalized = Request(
        "p", [1, 2], SamplingParams(repetition_penalty=1.2, max_tokens=5), max_tokens=5, seed=1
    )
    plain = Request("q", [3], SamplingParams(temperature=0.7, max_tokens=5), max_tokens=5, seed=2)
    penalized.output_token_ids.extend([4, 4])
    built = rows.build([penalized, plain])
    assert built.needs_penalties and built.output_token_ids is not None
    _assert_same(built, SamplingBatch.build([penalized, plain], VOCAB, torch.device("cpu")))
