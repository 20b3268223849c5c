"""Greedy parity with `transformers.generate` when the engine runs Kvasir's Triton kernels.

`KVASIR_KERNELS=triton` routes every kernel (store_kv, paged attention, and the elementwise ops)
through Triton; without a GPU they run in Triton's interpreter on CPU tensors. One tiny GQA model
with llama3 rope scaling, and the engine settings that hit each attention path: whole prompts,
6-token chunks starting mid-block, prefix-cache hits, preemption, and split-K decodes.
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

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 16, 23, 40, 57)
VARIANTS = {
    "default": {},
    "chunk-6-block-8": {"max_num_batched_tokens": 6, "block_size": 8},
    "preemption": {"block_size": 8, "num_kv_blocks": 9, "max_model_len": 72, "max_num_batched_tokens": 32},
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llama-triton"), "llama-gqa-llama3-rope")
    vocab_size = transformers.AutoConfig.from_pretrained(path).vocab_size
    generator = torch.Generator().manual_seed(99)
    prompts = [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    return path, prompts, expected


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers_on_the_triton_path(
    case: tuple[Path, list[list[int]], list[list[int]]], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvasir.kernels.triton_ops import attention as triton_attention

    path, prompts, expected = case
    monkeypatch.setenv("KVASIR_KERNELS", "triton")
    calls = {"n": 0}
    kernel = triton_attention.paged_attention

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        return kernel(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_attention, "paged_attention", counting)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = EngineConfig(model=str(path), device=device, dtype="float32", **VARIANTS[variant])  # type: ignore[arg-type]
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    results = engine.generate(prompts, params)
    assert calls["n"] > 0  # the Triton kernel, not the reference, computed the attention
    assert [r.choices[0].token_ids for r in results] == expected
    if variant == "preemption":
        assert engine.scheduler.num_preemptions_total > 0
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.usage == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (bf16 Triton kernels on the GPU)"
)
def test_bf16_on_cuda_stays_close_to_transformers(
    case: tuple[Path, list[list[int]], list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 on the GPU: greedy paths may part at near-ties, so compare log-probabilities instead.

    Each prompt's first-token log-probabilities (top 5) must be within bf16 tolerance of
    transformers' own bf16 forward pass on the same GPU.
    """
    path, prompts, _ = case
    monkeypatch.delenv("KVASIR_KERNELS", raising=False)  # auto: Triton on CUDA
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16"))
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
        reference = torch.log_softmax(logits, dim=-1)
        logprobs = result.choices[0].logprobs
        assert logprobs is not None
        for token_id, value in logprobs[0].top:
            assert value == pytest.approx(float(reference[token_id]), abs=0.05)
    engine.kv_cache.check_integrity()
