"""Constrained decoding composed with the rest of the engine: every sampling parameter, logprobs,
n > 1, seeds, batches that mix constrained and free rows, preemption by recompute, prefix
caching, async scheduling and speculative decoding. Outputs are checked by the independent
references of support.py, and where a feature must not change what is generated, against the
same batch run without it, token for token."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvasir.runtime.core.scheduler_output import SchedulerOutput
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.engine.outputs import GenerationResult
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.spec_decode.config import parse_speculative_config
from kvasir.runtime.structured.params import StructuredOutputs
from tests.runtime.structured.support import engine, json_spec, output_errors

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
JSON = json_spec(SCHEMA)
REGEX = StructuredOutputs.regex(r"[a-z]{2,6}( [a-z]{2,6}){1,3}", "structured_outputs.regex")
CHOICE = StructuredOutputs.choice(["red", "green", "blue", "dark blue"], "structured_outputs.choice")
MAX_TOKENS = 160
# Too few KV blocks for the mixed batch: requests are preempted and recomputed mid-grammar.
PREEMPTION: dict[str, Any] = {"block_size": 8, "num_kv_blocks": 32, "max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


def prompts(count: int, seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, 40, (count,), generator=generator).tolist()
    return [torch.randint(4, 384, (n,), generator=generator).tolist() for n in lengths]


def mixed_params() -> list[SamplingParams]:
    """Constrained and free rows, greedy and seeded: the batch the equivalence tests run."""
    return [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=JSON),
        SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=MAX_TOKENS, structured_outputs=JSON),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.9, top_k=40, seed=8, max_tokens=MAX_TOKENS, structured_outputs=REGEX),
        SamplingParams(temperature=1.0, seed=9, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=CHOICE),
        SamplingParams(temperature=1.0, seed=10, n=2, max_tokens=MAX_TOKENS, structured_outputs=CHOICE),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=MAX_TOKENS, structured_outputs=JSON),
    ]


def choices(results: list[GenerationResult]) -> list[tuple[list[int], str, str | None]]:
    return [(c.token_ids, c.text, c.finish_reason) for r in results for c in r.choices]


def assert_valid(llm: LLMEngine, params: list[SamplingParams], results: list[GenerationResult]) -> int:
    """Every constrained choice valid; returns how many were checked."""
    checked = 0
    for request, result in zip(params, results, strict=True):
        if request.structured_outputs is None:
            continue
        for choice in result.choices:
            assert not output_errors(llm, request.structured_outputs, choice), (
                request,
                choice.text,
                output_errors(llm, request.structured_outputs, choice),
            )
            checked += 1
    return checked


@pytest.fixture(scope="module")
def reference(path: Path) -> list[GenerationResult]:
    """The mixed batch on a plain engine (sync, prefix caching off, no speculation, no preemption)."""
    llm = engine(path, enable_prefix_caching=False)
    params = mixed_params()
    results = llm.generate(prompts(len(params)), params)
    assert assert_valid(llm, params, results) == 8
    # The batch is worth comparing: greedy rows finish, some choices by the grammar's end.
    assert sum(c.finish_reason == "stop" for r in results for c in r.choices) >= 5
    llm.close()
    return results


SAMPLING_VARIANTS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.5},
    "top-p": {"temperature": 1.0, "top_p": 0.5},
    "top-k": {"temperature": 1.0, "top_k": 3},
    "top-k-1": {"temperature": 1.0, "top_k": 1},
    "min-p": {"temperature": 1.0, "min_p": 0.3},
    "all-truncations": {"temperature": 0.7, "top_p": 0.8, "top_k": 10, "min_p": 0.05},
    "presence": {"temperature": 1.0, "presence_penalty": 2.0},
    "frequency": {"temperature": 1.0, "frequency_penalty": 2.0},
    "repetition": {"temperature": 1.0, "repetition_penalty": 1.8},
    "penalties-greedy": {"temperature": 0.0, "repetition_penalty": 0.5, "presence_penalty": -2.0},
    "min-tokens": {"temperature": 1.0, "min_tokens": 6},
}


def test_sampling_parameters_compose_with_grammars(path: Path) -> None:
    """Penalties, truncation and temperature act before the grammar's mask or within it: every
    output is still in the language (including a negative presence penalty and a repetition
    penalty below 1, which push the model toward what it already wrote)."""
    llm = engine(path)
    batch, params = [], []
    for index, variant in enumerate(SAMPLING_VARIANTS.values()):
        for spec in (JSON, REGEX, CHOICE):
            batch.append(prompts(1, seed=100 + index)[0])
            params.append(
                SamplingParams(n=2, seed=index, max_tokens=MAX_TOKENS, structured_outputs=spec, **variant)
            )
    results = llm.generate(batch, params)
    assert assert_valid(llm, params, results) == 2 * len(params)
    stopped = sum(c.finish_reason == "stop" for r in results for c in r.choices)
    assert stopped >= 0.8 * 2 * len(params)
    for request, result in zip(params, results, strict=True):
        if request.min_tokens:
            for choice in result.choices:  # the grammar can always continue past 6 tokens here
                assert len(choice.token_ids) >= 6 or choice.finish_reason == "stop", choice


def test_logprobs_are_reported_for_constrained_tokens(path: Path) -> None:
    llm = engine(path)
    params = [
        SamplingParams(temperature=t, seed=3, n=2, logprobs=3, max_tokens=MAX_TOKENS, structured_outputs=spec)
        for spec in (JSON, REGEX)
        for t in (0.0, 1.0)
    ]
    results = llm.generate(prompts(len(params)), params)
    assert_valid(llm, params, results)
    for result in results:
        for choice in result.choices:
            assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids)
            for token_id, entry in zip(choice.token_ids, choice.logprobs, strict=True):
                assert entry.token_id == token_id
                assert math.isfinite(entry.logprob) and entry.logprob <= 0.0
                assert len(entry.top) == 3 and all(math.isfinite(lp) for _, lp in entry.top)


def test_n_choices_each_follow_the_grammar_and_differ(path: Path) -> None:
    llm = engine(path)
    params = [SamplingParams(n=6, temperature=1.0, seed=21, max_tokens=MAX_TOKENS, structured_outputs=JSON)]
    (result,) = llm.generate(prompts(1), params)
    assert assert_valid(llm, params, [result]) == 6
    assert len({tuple(c.token_ids) for c in result.choices}) >= 5, "choices share one grammar state?"


def test_seeded_constrained_output_does_not_depend_on_the_batch(path: Path, reference) -> None:
    """Same seed, same constrained output: alone, or in a batch with other (constrained and free)
    requests in other positions."""
    llm = engine(path, enable_prefix_caching=False)
    params, batch = mixed_params(), prompts(8)
    for index in (1, 3, 6, 7):  # the seeded constrained rows
        (alone,) = llm.generate([batch[index]], [params[index]])
        assert choices([alone]) == choices([reference[index]])
    # Reversed: every request in another row, next to other neighbours.
    reversed_results = llm.generate(batch[::-1], params[::-1])[::-1]
    assert choices(reversed_results) == choices(reference)


def test_free_rows_are_untouched_by_constrained_neighbours(path: Path, reference) -> None:
    """The unconstrained rows of the mixed batch equal, token for token, the same requests run
    without any constrained request (the bitmask leaves their rows alone)."""
    llm = engine(path, enable_prefix_caching=False)
    params, batch = mixed_params(), prompts(8)
    free = [i for i, p in enumerate(params) if p.structured_outputs is None]
    results = llm.generate([batch[i] for i in free], [params[i] for i in free])
    assert choices(results) == choices([reference[i] for i in free])
    assert all(len(c.token_ids) == MAX_TOKENS for r in results for c in r.choices)


def test_preemption_by_recompute_keeps_outputs(path: Path, reference) -> None:
    """Too few KV blocks for the batch: requests are preempted and recomputed mid-grammar; their
    grammar states carry on and the outputs (greedy and seeded) equal the plain run's."""
    llm = engine(path, enable_prefix_caching=False, **PREEMPTION)
    params = mixed_params()
    results = llm.generate(prompts(len(params)), params)
    assert llm.scheduler.num_preemptions_total > 0
    assert choices(results) == choices(reference)
    llm.kv_cache.check_integrity()
    assert llm.kv_cache.usage == 0.0


def test_prefix_caching_keeps_outputs(path: Path, reference) -> None:
    llm = engine(path, enable_prefix_caching=True)
    params = mixed_params()
    llm.generate(prompts(len(params)), params)
    again = llm.generate(prompts(len(params)), params)  # every prompt's full blocks are cached now
    assert llm.kv_cache.prefix_cache_hits > 0
    assert choices(again) == choices(reference)
    # A long shared prefix, hit within one batch.
    shared = prompts(1, seed=77)[0] * 2
    params2 = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=JSON)] * 2
    first, second = llm.generate([shared, shared], params2)
    hits = llm.kv_cache.prefix_cache_hits
    plain = engine(path, enable_prefix_caching=False).generate([shared], params2[:1])
    assert choices([first]) == choices([second]) == choices(plain)
    assert hits > 0


class AheadRecorder:
    """Records the plans async scheduling makes ahead, and whether any sampled a grammar request
    whose previous token was still in flight."""

    def __init__(self, llm: LLMEngine) -> None:
        self.ahead = self.grammar_rows_ahead = 0
        self._plan = llm.scheduler.schedule_ahead
        llm.scheduler.schedule_ahead = self  # type: ignore[method-assign]

    def __call__(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        plan = self._plan(in_flight)
        if plan is not None:
            self.ahead += 1
            self.grammar_rows_ahead += sum(
                item.pending_row >= 0 and item.request.grammar is not None for item in plan.scheduled
            )
        return plan


ASYNC_VARIANTS = {"default": {}, "chunked-prefill": {"max_num_batched_tokens": 8}, "preemption": PREEMPTION}


@pytest.mark.parametrize("variant", list(ASYNC_VARIANTS))
def test_async_scheduling_keeps_outputs(path: Path, reference, variant: str) -> None:
    """Steps planned ahead never sample a grammar row whose previous token is still in flight
    (its mask would be stale); the output equals the synchronous engine's."""
    llm = engine(path, enable_prefix_caching=False, async_scheduling=True, **ASYNC_VARIANTS[variant])
    recorder = AheadRecorder(llm)
    params = mixed_params()
    results = llm.generate(prompts(len(params)), params)
    assert choices(results) == choices(reference)
    assert recorder.ahead > 0, "nothing was planned ahead: the test proves nothing"
    assert recorder.grammar_rows_ahead == 0
    if variant == "preemption":
        assert llm.scheduler.num_preemptions_total > 0


def _speculative(**extra: Any) -> Any:
    return parse_speculative_config(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
            "min_acceptance_rate": 0.0,
            **extra,
        }
    )


REPEATING = json_spec({"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 6, "maxItems": 10})
REPEATING_PROMPT = '["alpha","beta","alpha","alpha","beta","beta","alpha"] ["alpha","beta","alpha","beta"]'


@pytest.mark.parametrize("variant", ["default", "preemption"])
def test_speculative_decoding_greedy_equals_no_speculation(path: Path, variant: str) -> None:
    """ngram drafts trimmed to the grammar and verified with per-position masks: greedy output is
    the same token for token, drafts were made, and some were accepted, some rejected."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=REPEATING),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=JSON),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=REGEX),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
    ]
    batch: list[Any] = [
        REPEATING_PROMPT,
        '{"name":"ab","n":12,"tags":["a","b"]} {"name":',
        "the cat the dog",
        prompts(1)[0],
    ]
    plain = engine(path)
    want = plain.generate(batch, params)
    overrides: dict[str, Any] = {} if variant == "default" else {**PREEMPTION, "num_kv_blocks": 34}
    llm = engine(path, speculative_config=_speculative(), **overrides)
    got = llm.generate(batch, params)
    assert choices(got) == choices(want)
    if variant == "preemption":
        assert llm.scheduler.num_preemptions_total > 0
    assert assert_valid(llm, params, got) == 3
    stats = llm.drafts.stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_speculative_decoding_sampled_outputs_stay_valid(path: Path) -> None:
    llm = engine(path, speculative_config=_speculative())
    params = [
        SamplingParams(temperature=1.0, seed=s, n=2, max_tokens=MAX_TOKENS, structured_outputs=spec)
        for s, spec in enumerate([REPEATING, JSON, REGEX, CHOICE, REPEATING, JSON])
    ]
    batch = [
        REPEATING_PROMPT,
        "{}",
        "the cat",
        "blue",
        REPEATING_PROMPT[::-1],
        '{"name":"x","n":1,"tags":[]}',
    ]
    results = llm.generate(batch, params)
    assert assert_valid(llm, params, results) == 12
    assert llm.drafts.stats.num_accepted_tokens > 0


FIXED = StructuredOutputs.choice(["the quick brown fox jumps over the lazy dog"], "structured_outputs.choice")


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_min_tokens_with_a_grammar_that_ends_early(path: Path, speculative: bool) -> None:
    """min_tokens holds EOS off, but a complete grammar allows nothing else: the request ends by
    the grammar, with finite logprobs and the exact text (no NaN-driven garbage), also when a
    draft completes the grammar and the bonus row allows only EOS."""
    llm = engine(path, speculative_config=_speculative() if speculative else None)
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
    params = [
        SamplingParams(
            temperature=t,
            seed=5,
            logprobs=1,
            max_tokens=MAX_TOKENS,
            min_tokens=MAX_TOKENS,
            structured_outputs=spec,
        )
        for spec in (FIXED, CHOICE)
        for t in (0.0, 1.0)
    ]
    results = llm.generate([prompt] * len(params), params)
    assert_valid(llm, params, results)
    for request, result in zip(params, results, strict=True):
        (choice,) = result.choices
        assert choice.finish_reason == "stop" and len(choice.token_ids) < MAX_TOKENS
        assert choice.logprobs is not None
        assert all(math.isfinite(e.logprob) for e in choice.logprobs)
        if request.structured_outputs is FIXED:
            assert choice.text == "the quick brown fox jumps over the lazy dog"
    if speculative:
        assert llm.drafts.stats.num_accepted_tokens > 0


def test_json_object_mode_outputs_objects(path: Path) -> None:
    llm = engine(path)
    spec = StructuredOutputs.json_object()
    params = [
        SamplingParams(temperature=1.0, seed=s, n=4, max_tokens=210, structured_outputs=spec)
        for s in range(4)
    ]
    results = llm.generate(prompts(4, seed=0), params)
    assert assert_valid(llm, params, results) == 16
    # Keys and values are unbounded strings: a random model finishes some objects, not all.
    assert sum(c.finish_reason == "stop" for r in results for c in r.choices) >= 3


def test_two_tensor_parallel_ranks_keep_outputs_under_preemption_and_chunked_prefill(
    path: Path, reference
) -> None:
    """--tensor-parallel-size 2 (a spawned gloo rank): the mixed batch, prompts prefilled in 32-token
    chunks and requests preempted mid-grammar, gives the plain one-process run's outputs; the
    grammar masks are applied on rank 0, which samples for both."""
    llm = engine(path, enable_prefix_caching=False, tensor_parallel_size=2, **PREEMPTION)
    try:
        params = mixed_params()
        batch = prompts(len(params))
        assert max(len(prompt) for prompt in batch) > PREEMPTION["max_num_batched_tokens"]  # chunked
        results = llm.generate(batch, params)
        assert llm.scheduler.num_preemptions_total > 0
        assert choices(results) == choices(reference)
        assert assert_valid(llm, params, results) == 8
    finally:
        llm.close()
