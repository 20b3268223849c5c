"""The embedded SmolLM2-135M-Instruct GGUF: Kvasir's greedy output equals transformers' on the
same dequantized weights, for plain and chat prompts."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.sample.params import SamplingParams
from tests.hf_reference import gguf_parsed_once

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
PLAIN_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT_PROMPTS = [[{"role": "user", "content": "What is the capital of France?"}]]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(embedded_model_path()), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def hf_model() -> transformers.PreTrainedModel:
    path = embedded_model_path()
    with gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


def _prompt_ids(engine: LLMEngine) -> list[list[int]]:
    tokenizer = engine.tokenizer
    ids = [tokenizer.encode(p) for p in PLAIN_PROMPTS]
    for messages in CHAT_PROMPTS:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids.append(tokenizer.encode(rendered, add_special_tokens=False))
    return ids


def test_greedy_output_matches_transformers(engine: LLMEngine, hf_model) -> None:
    prompts = _prompt_ids(engine)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    ours = engine.generate(prompts, params)
    for prompt, result in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            reference = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS
            )[0, len(prompt) :].tolist()
        assert result.choices[0].token_ids == reference
    engine.kv_cache.check_integrity()


def test_chat_answer_is_sensible(engine: LLMEngine) -> None:
    prompt = _prompt_ids(engine)[-1]
    result = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in result.choices[0].text
    assert result.choices[0].finish_reason in ("stop", "length")


def test_fp8_kv_cache_keeps_the_real_models_answers(engine: LLMEngine) -> None:
    """Real weights give real K/V magnitudes: with e4m3 and scale 1.0 the greedy answers survive."""
    fp8 = LLMEngine(
        EngineConfig(model=str(embedded_model_path()), device="cpu", dtype="float32", kv_cache_dtype="fp8")
    )
    prompts = _prompt_ids(engine)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    full = engine.generate(prompts, params)
    quantized = fp8.generate(prompts, params)
    for a, b in zip(full, quantized, strict=True):
        assert b.choices[0].token_ids == a.choices[0].token_ids
    assert "Paris" in quantized[-1].choices[0].text
    fp8.kv_cache.check_integrity()
