"""End-to-end greedy parity: Kvasir's engine against `transformers.generate`, token for token.

Tiny random-weight checkpoints of every supported family, a batch of prompts of different lengths,
and the engine configurations that exercise every scheduling path: tiny chunks (chunked prefill),
prefix caching on and off, a KV pool too small for the batch (preemption by recompute), n > 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny_checkpoints import make_tiny_checkpoint

NEW_TOKENS = 12
PROMPT_LENGTHS = (5, 16, 23, 40, 57)

# Qwen2 ties its embeddings in tests/tiny_checkpoints.py; the others are untied.
FAMILIES = [
    "llama",
    "llama-gqa-llama3-rope",
    "llama-linear-rope",
    "mistral",
    "qwen2",
    "qwen3",
]


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    # Token 0..3 may be special in the tiny tokenizer; keep prompts to ordinary ids.
    return [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    config = transformers.AutoConfig.from_pretrained(path)
    prompts = _prompts(config.vocab_size)
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def _engine(path: Path, **overrides: object) -> LLMEngine:
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", **overrides)  # type: ignore[arg-type]
    return LLMEngine(config)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)

ENGINE_VARIANTS = {
    "default": {},
    "chunk-8": {"max_num_batched_tokens": 8},
    "no-prefix-cache": {"enable_prefix_caching": False, "max_num_batched_tokens": 16},
    # 9 blocks of 8 tokens cannot hold the batch at once (it needs 28): requests are preempted
    # and recomputed, and their greedy outputs must not change.
    "preemption": {"block_size": 8, "num_kv_blocks": 9, "max_model_len": 72, "max_num_batched_tokens": 32},
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(family_case, variant: str) -> None:
    path, prompts, expected = family_case
    engine = _engine(path, **ENGINE_VARIANTS[variant])
    results = engine.generate(prompts, GREEDY)
    assert [r.choices[0].token_ids for r in results] == expected
    assert all(r.choices[0].finish_reason == "length" for r in results)
    if variant == "preemption":
        assert engine.scheduler.num_preemptions_total > 0
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.usage == 0.0


def test_n_greedy_choices_share_the_prompt(family_case) -> None:
    path, prompts, expected = family_case
    engine = _engine(path)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    results = engine.generate(prompts[-1:], params)
    assert [c.token_ids for c in results[0].choices] == [expected[-1]] * 3
    # The prompt's full blocks were computed once and shared by the other two choices.
    full_blocks_tokens = (len(prompts[-1]) - 1) // 16 * 16
    assert engine.kv_cache.prefix_cache_hits >= 2 * full_blocks_tokens
    engine.kv_cache.check_integrity()


def test_first_token_logprobs_match_transformers(family_case) -> None:
    path, prompts, _ = family_case
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # Logprobs within 1e-4 of float32 transformers need a float32 KV cache: the CPU default,
    # float16, moves them by ~1e-3 (the greedy tests above run the default and match exactly).
    engine = _engine(path, kv_cache_dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    results = engine.generate(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1]
        reference = torch.log_softmax(logits.float(), dim=-1)
        top = reference.topk(5)
        logprobs = result.choices[0].logprobs
        assert logprobs is not None
        ours = logprobs[0]
        assert ours.token_id == int(top.indices[0])
        assert ours.logprob == pytest.approx(float(top.values[0]), abs=1e-4)
        assert [token for token, _ in ours.top] == top.indices.tolist()
        assert [value for _, value in ours.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    single = make_tiny_checkpoint(tmp_path / "single", "llama")
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "llama", sharded=True)
    assert (sharded / "model.safetensors.index.json").exists()
    prompts = _prompts(transformers.AutoConfig.from_pretrained(single).vocab_size)[:2]
    a = _engine(single).generate(prompts, GREEDY)
    b = _engine(sharded).generate(prompts, GREEDY)
    assert [r.choices[0].token_ids for r in a] == [r.choices[0].token_ids for r in b]
