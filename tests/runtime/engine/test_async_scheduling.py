"""Async scheduling: step N+1 is planned and queued while step N runs, its placeholder inputs
filled from N's sampled tokens on the device. Output must equal the synchronous engine's token
for token (greedy, seeded sampling, min_tokens, stops, n > 1) through chunked prefill, preemption
and aborts mid-flight, and the KV accounting must stay exact."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.core.scheduler_output import SchedulerOutput
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import SamplingParams
from tests.hf_reference import hf_greedy

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
VARIANTS = {
    "default": {},
    "chunk-8": {"max_num_batched_tokens": 8},
    "preemption": {"block_size": 8, "num_kv_blocks": 14, "max_model_len": 96, "max_num_batched_tokens": 32},
}


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in (5, 17, 33, 41, 9, 26)]


def engine(path: Path, async_scheduling: bool, **overrides: object) -> LLMEngine:
    config = EngineConfig(
        model=str(path),
        device="cpu",
        dtype="float32",
        async_scheduling=async_scheduling,
        **overrides,  # type: ignore[arg-type]
    )
    return LLMEngine(config)


class AheadCounter:
    """Counts the steps planned ahead (and those that fell back to planning with tokens known)."""

    def __init__(self, llm: LLMEngine) -> None:
        self.ahead = self.fallback = self.pending_rows = 0
        self._plan = llm.scheduler.schedule_ahead
        llm.scheduler.schedule_ahead = self  # type: ignore[method-assign]

    def __call__(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        plan = self._plan(in_flight)
        if plan is None:
            self.fallback += 1
        else:
            self.ahead += 1
            self.pending_rows += sum(item.pending_row >= 0 for item in plan.scheduled)
        return plan


def _choices(results) -> list[tuple[list[int], str, str | None]]:
    return [(c.token_ids, c.text, c.finish_reason) for r in results for c in r.choices]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_greedy_output_equals_transformers(
    tiny_checkpoint: Callable[..., Path], family: str, variant: str
) -> None:
    path = tiny_checkpoint(family)
    batch = prompts(256)
    llm = engine(path, True, **VARIANTS[variant])
    counter = AheadCounter(llm)
    results = llm.generate(batch, GREEDY)
    assert [r.choices[0].token_ids for r in results] == hf_greedy(path, batch, NEW_TOKENS)
    assert counter.ahead > NEW_TOKENS // 2 and counter.pending_rows > 0, "nothing ran ahead"
    if variant == "preemption":
        assert llm.scheduler.num_preemptions_total > 0 and counter.fallback > 0
    llm.kv_cache.check_integrity()
    assert llm.kv_cache.usage == 0.0
    llm.close()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=NEW_TOKENS),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=NEW_TOKENS, n=3),
        SamplingParams(temperature=0.7, seed=5, max_tokens=NEW_TOKENS, min_tokens=10, logprobs=2),
        # Penalties read the output so far: these steps are planned with the tokens known.
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, repetition_penalty=1.3, presence_penalty=0.5),
    ],
    ids=["top-p", "n3-top-k", "min-tokens-logprobs", "penalties"],
)
def test_sampled_output_equals_the_synchronous_engine(tiny_checkpoint, params: SamplingParams) -> None:
    """Seeded sampling draws by output position: a row planned ahead must use the position of
    the token it will produce, not of the last one the host has seen."""
    path = tiny_checkpoint("llama")
    batch = prompts(256)
    want = engine(path, False, max_num_batched_tokens=16).generate(batch, params)
    llm = engine(path, True, max_num_batched_tokens=16)
    counter = AheadCounter(llm)
    got = llm.generate(batch, params)
    assert _choices(got) == _choices(want)
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.choices, b.choices, strict=True):
            if x.logprobs is not None:
                assert y.logprobs is not None
                assert [t.token_id for t in x.logprobs] == [t.token_id for t in y.logprobs]
    if params.repetition_penalty != 1.0:
        assert counter.ahead == 0
    else:
        assert counter.pending_rows > 0


def test_stops_end_requests_at_the_same_token(tiny_checkpoint) -> None:
    """EOS, stop tokens, stop strings and length limits found one step late still end the output
    at the right token: the row already queued for the finished request is dropped."""
    path = tiny_checkpoint("llama")
    batch = prompts(256)
    sync = engine(path, False)
    full = sync.generate(batch, GREEDY)
    cases = [SamplingParams(temperature=0.0, max_tokens=1), SamplingParams(temperature=0.0, max_tokens=7)]
    for result in full[:3]:
        tokens, text = result.choices[0].token_ids, result.choices[0].text
        cases.append(SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=(tokens[5],)))
        if text.strip():
            cases.append(
                SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=(text[len(text) // 2 :][:2],))
            )
    llm = engine(path, True)
    for params in cases:
        assert _choices(llm.generate(batch, params)) == _choices(sync.generate(batch, params)), params
    # EOS in the middle of a run.
    eos = full[2].choices[0].token_ids[8]
    llm._eos_token_ids = sync._eos_token_ids = (eos,)
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    got = llm.generate(batch, plain)
    assert _choices(got) == _choices(sync.generate(batch, plain))
    assert any(r.choices[0].finish_reason == "stop" for r in got)
    llm.kv_cache.check_integrity()
    assert llm.kv_cache.usage == 0.0


def test_aborts_while_a_step_is_in_flight(tiny_checkpoint) -> None:
    """An abort lands while the next step (which still computes the request) is queued: its KV
    blocks are freed at once, its late token is dropped, and the other requests are unaffected."""
    path = tiny_checkpoint("llama")
    batch = prompts(256)
    params = SamplingParams(temperature=0.0, max_tokens=30)
    keep = [0, 2, 4, 5]
    want = engine(path, False, block_size=8).generate([batch[i] for i in keep], params)
    llm = engine(path, True, block_size=8)
    for index, prompt in enumerate(batch):
        llm.add_request(f"r{index}", prompt_token_ids=prompt, params=params)
    tokens: dict[str, list[int]] = {}
    for step in range(60):
        if step == 4:
            assert llm._in_flight is not None, "the abort must land with a step queued"
            llm.abort("r1")
        if step == 7:
            llm.abort("r3")
        for output in llm.step():
            for delta in output.outputs:
                tokens.setdefault(output.request_id, []).extend(delta.token_ids)
        llm.kv_cache.check_integrity()
        if not llm.has_unfinished():
            break
    assert [tokens[f"r{i}"] for i in keep] == [r.choices[0].token_ids for r in want]
    assert len(tokens.get("r1", [])) < 30 and len(tokens.get("r3", [])) < 30
    assert llm.kv_cache.usage == 0.0


def test_a_failed_step_surfaces_in_the_engines_thread(tiny_checkpoint, monkeypatch) -> None:
    llm = engine(tiny_checkpoint("llama"), True)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device fell over")

    monkeypatch.setattr(llm.runner, "run_prepared", broken)
    llm.add_request("r0", prompt_token_ids=[5, 6, 7], params=GREEDY)
    with pytest.raises(RuntimeError, match="device fell over"):
        llm.step()
