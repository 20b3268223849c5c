"""Speculative decoding in the engine: greedy output identical to Hugging Face's and to decoding
without speculation for every method, inside continuous batching (chunked prefill, prefix hits,
preemption, aborts, requests that do and do not speculate in one step), with the KV accounting
intact; stops inside an accepted run end the request at the right token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.spec_decode.config import SpeculativeConfig
from tests.hf_reference import hf_greedy

NEW_TOKENS = 20
FAMILIES = ["llama", "qwen3", "mistral"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)

VARIANTS = {
    "default": {},
    "chunk-8": {"max_num_batched_tokens": 8},
    # Too few blocks for the batch: requests are preempted and recomputed mid-speculation.
    "preemption": {"block_size": 8, "num_kv_blocks": 14, "max_model_len": 96, "max_num_batched_tokens": 32},
}


def methods(draft_path: Path, target_path: Path | None = None) -> dict[str, SpeculativeConfig]:
    """min_acceptance_rate 0: speculation is never turned down, so every step verifies drafts
    (these tests are about exactness; the backoff has its own in test_drafting.py)."""
    return {
        "ngram": SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=4,
            prompt_lookup_max=3,
            prompt_lookup_min=1,
            min_acceptance_rate=0.0,
        ),
        "layer_skip": SpeculativeConfig(
            method="layer_skip", num_layers=1, num_speculative_tokens=3, min_acceptance_rate=0.0
        ),
        "draft_model": SpeculativeConfig(
            method="draft_model", model=str(draft_path), num_speculative_tokens=3, min_acceptance_rate=0.0
        ),
        # The target as its own draft: long accepted runs through chunking, prefix hits, preemption.
        "draft_model_same": SpeculativeConfig(
            method="draft_model",
            model=str(target_path or draft_path),
            num_speculative_tokens=3,
            min_acceptance_rate=0.0,
        ),
    }


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(99)
    random = [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in (5, 17, 33, 41)]
    # Repetitive prompts, so prompt lookup finds matches and drafts get accepted and rejected.
    return [*random, [9, 10, 11, 12, 13] * 6, [20, 21, 22] * 9 + [20]]


def engine(path: Path, spec: SpeculativeConfig | None, **overrides: object) -> LLMEngine:
    config = EngineConfig(
        model=str(path),
        device="cpu",
        dtype="float32",
        speculative_config=spec,
        **overrides,  # type: ignore[arg-type]
    )
    return LLMEngine(config)


@pytest.fixture(scope="module", params=FAMILIES)
def case(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]):
    path = tiny_checkpoint(request.param)
    # A different, smaller model with the same vocabulary: it disagrees often, which is the point.
    draft = tiny_checkpoint(request.param, num_hidden_layers=1, seed=7)
    batch = prompts(256)
    return path, draft, batch, hf_greedy(path, batch, NEW_TOKENS)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft_model", "draft_model_same"])
def test_greedy_output_equals_transformers(case, method: str, variant: str) -> None:
    path, draft, batch, expected = case
    llm = engine(path, methods(draft, path)[method], **VARIANTS[variant])
    results = llm.generate(batch, GREEDY)
    assert [r.choices[0].token_ids for r in results] == expected
    stats = llm.drafts.stats
    assert stats.num_draft_tokens > 0, "nothing was drafted: the test proves nothing"
    # A random-weight draft model never agrees with its random target; the others must have
    # had drafts both accepted and rejected, or a path went untested.
    if method == "draft_model_same":
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    elif method != "draft_model":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if variant == "preemption":
        assert llm.scheduler.num_preemptions_total > 0
    llm.kv_cache.check_integrity()
    assert llm.kv_cache.usage == 0.0


def test_a_draft_model_equal_to_the_target_is_almost_always_accepted(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama")
    spec = SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=4)
    llm = engine(path, spec)
    llm.generate(prompts(256), GREEDY)
    stats = llm.drafts.stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1] > 0


@pytest.mark.parametrize("method", ["ngram", "layer_skip"])
def test_stops_inside_an_accepted_run_end_the_request_at_that_token(tiny_checkpoint, method: str) -> None:
    path = tiny_checkpoint("llama")
    batch = prompts(256)
    reference = engine(path, None)
    speculative = engine(path, methods(path)[method])
    full = reference.generate(batch, GREEDY)
    cases = []
    for result in full:
        tokens = result.choices[0].token_ids
        text = result.choices[0].text
        cases.append(SamplingParams(temperature=0.0, max_tokens=7))  # a length stop mid-run
        cases.append(SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=(tokens[9],)))
        if text.strip():
            cases.append(
                SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=(text[len(text) // 2 :][:2],))
            )
    for params in cases:
        want = reference.generate(batch, params)
        got = speculative.generate(batch, params)
        for a, b in zip(got, want, strict=True):
            assert (a.choices[0].token_ids, a.choices[0].text, a.choices[0].finish_reason) == (
                b.choices[0].token_ids,
                b.choices[0].text,
                b.choices[0].finish_reason,
            ), params
    assert speculative.drafts.stats.num_accepted_tokens > 0
    speculative.kv_cache.check_integrity()
    assert speculative.kv_cache.usage == 0.0


def test_eos_inside_an_accepted_run_stops_there(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama")
    batch = prompts(256)
    full = engine(path, None).generate(batch, GREEDY)
    # Make a token the greedy run produces mid-output the EOS: both engines must stop right there.
    eos = full[4].choices[0].token_ids[8]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    llm = engine(path, methods(path)["ngram"])
    llm._eos_token_ids = (eos,)
    got = llm.generate(batch, params)
    plain = engine(path, None)
    plain._eos_token_ids = (eos,)
    want = plain.generate(batch, params)
    assert [r.choices[0].token_ids for r in got] == [r.choices[0].token_ids for r in want]
    assert any(r.choices[0].token_ids[-1] == eos and r.choices[0].finish_reason == "stop" for r in got)


def test_logprobs_are_the_targets(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    batch = prompts(256)
    want = engine(path, None).generate(batch, params)
    got = engine(path, methods(path)["ngram"]).generate(batch, params)
    for a, b in zip(got, want, strict=True):
        assert a.choices[0].token_ids == b.choices[0].token_ids
        assert a.choices[0].logprobs is not None and b.choices[0].logprobs is not None
        for x, y in zip(a.choices[0].logprobs, b.choices[0].logprobs, strict=True):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_aborts_mid_speculation_and_mixed_sampling_keep_the_kv_cache_consistent(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama")
    llm = engine(path, methods(path)["layer_skip"], block_size=8)
    batch = prompts(256)
    for index, prompt in enumerate(batch):
        params = (
            SamplingParams(temperature=0.9, seed=index, max_tokens=30)
            if index % 2
            else SamplingParams(temperature=0.0, max_tokens=30)
        )
        llm.add_request(f"r{index}", prompt_token_ids=prompt, params=params)
    for step in range(40):
        llm.step()
        llm.kv_cache.check_integrity()
        if step in (3, 6):
            llm.abort(f"r{step // 3}")
            llm.abort(f"r{step // 3 + 3}")
    while llm.has_unfinished():
        llm.step()
    llm.kv_cache.check_integrity()
    assert llm.kv_cache.usage == 0.0
    assert llm.drafts.stats.num_drafts > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft_model"])
def test_embedded_model_greedy_output_is_unchanged(method: str) -> None:
    path = embedded_model_path()
    spec = {
        # The GGUF file as its own draft: a second model loaded, with its own KV, through the
        # quantized loader (a truncated draft is measured in benchmarks/spec_decode.py).
        "draft_model": SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=3),
        "ngram": SpeculativeConfig(
            method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2
        ),
        "layer_skip": SpeculativeConfig(method="layer_skip", num_layers=20, num_speculative_tokens=3),
    }[method]
    prompts_text = [
        "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
        "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    want = plain.generate(prompts_text, params)
    fast = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", speculative_config=spec))
    got = fast.generate(prompts_text, params)
    assert [r.choices[0].token_ids for r in got] == [r.choices[0].token_ids for r in want]
    assert fast.drafts.stats.num_accepted_tokens > 0


def test_metrics_export_the_spec_decode_counters(tiny_checkpoint) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvasir.runtime.server.metrics import ServerMetrics

    path = tiny_checkpoint("llama")
    llm = engine(path, methods(path)["ngram"])
    llm.generate(prompts(256), GREEDY)
    stats = llm.stats()
    assert stats.spec_decode is not None
    text = ServerMetrics("m", lambda: stats).render().decode()
    samples = {
        (sample.name, sample.labels.get("position")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("kvasir_spec_decode")
    }
    spec = stats.spec_decode
    assert samples[("kvasir_spec_decode_num_drafts_total", None)] == spec.num_drafts > 0
    assert samples[("kvasir_spec_decode_num_draft_tokens_total", None)] == spec.num_draft_tokens
    assert samples[("kvasir_spec_decode_num_accepted_tokens_total", None)] == spec.num_accepted_tokens
    per_pos = "kvasir_spec_decode_num_accepted_tokens_per_pos_total"
    per_position = [samples[(per_pos, str(i))] for i in range(4)]
    assert sum(per_position) == spec.num_accepted_tokens
    # A later draft is accepted only after every earlier one.
    assert per_position == sorted(per_position, reverse=True)
    # Without speculation the family is absent, not zero.
    plain = engine(path, None).stats()
    assert "kvasir_spec_decode" not in ServerMetrics("m", lambda: plain).render().decode()
