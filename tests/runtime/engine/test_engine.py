"""LLMEngine behaviour beyond parity: validation, aborts, stop strings, seeds (timing: test_finish_times)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvasir.kernels.cpu_ops import paged_attention as cpu_attention
from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.engine.prompt_check import ContextLengthError
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from tests.tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", max_model_len=128))


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_prompt_plus_max_tokens_beyond_context_is_rejected_at_add(engine: LLMEngine) -> None:
    with pytest.raises(ContextLengthError) as error:
        engine.add_request("r", prompt_token_ids=[5] * 100, params=SamplingParams(max_tokens=50))
    assert error.value.param == "max_tokens"
    assert "maximum context length is 128 tokens" in str(error.value)
    assert "150 tokens" in str(error.value)
    with pytest.raises(ContextLengthError) as error:
        engine.add_request("r", prompt_token_ids=[5] * 128, params=SamplingParams(max_tokens=None))
    assert error.value.param == "prompt"
    assert not engine.has_unfinished()


def test_bad_prompts_name_the_field(engine: LLMEngine) -> None:
    with pytest.raises(InvalidParameterError, match="prompt") as error:
        engine.add_request("r", prompt_token_ids=[])
    assert error.value.param == "prompt"
    with pytest.raises(InvalidParameterError, match="outside the vocabulary"):
        engine.add_request("r", prompt_token_ids=[10**9])
    with pytest.raises(InvalidParameterError, match="exactly one"):
        engine.add_request("r", "text", prompt_token_ids=[1])


def test_max_tokens_none_fills_the_context(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    result = engine.generate([[7] * 100], params)[0]
    assert len(result.choices[0].token_ids) == 28
    assert result.choices[0].finish_reason == "length"


def test_abort_at_any_moment_frees_blocks(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", prompt_token_ids=[5 + i] * (20 + i), params=params)
    engine.abort("r0")  # still waiting
    engine.step()
    engine.step()
    engine.abort("r1")  # running
    engine.abort("unknown-id")  # ignored
    # The text side may run in the output process: the abort's output comes within a few steps.
    outputs = {}
    while engine.has_unfinished() and "r1" not in outputs:
        outputs.update((o.request_id, o) for o in engine.step())
    assert outputs["r1"].finished
    assert outputs["r1"].outputs[0].finish_reason == "abort"
    _drain(engine)
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.usage == 0.0
    assert not engine.has_unfinished()


def test_stop_string_ends_the_request_and_is_trimmed(engine: LLMEngine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = [[11, 12, 13, 14]]
    full = engine.generate(prompt, greedy)[0].choices[0]
    # A stop string taken from the middle of the greedy text must cut the output right there.
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), f"need a non-blank stop string, got {full.text!r}"
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=(stop,))
    stopped = engine.generate(prompt, params)[0].choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    assert stopped.text == full.text[: full.text.index(stop)]
    assert len(stopped.token_ids) < len(full.token_ids)
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.usage == 0.0


def test_seeded_sampling_is_reproducible_and_batch_independent(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=42, ignore_eos=True)
    alone = engine.generate([[20, 21, 22]], params)[0].choices[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = engine.generate([[30] * 9, [20, 21, 22], [40] * 17], [others, params, others])
    assert batch[1].choices[0].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=43, ignore_eos=True)
    assert engine.generate([[20, 21, 22]], different)[0].choices[0].token_ids != alone


def test_n_seeded_choices_differ(engine: LLMEngine) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=1, ignore_eos=True)
    choices = engine.generate([[20, 21, 22]], params)[0].choices
    assert len({tuple(c.token_ids) for c in choices}) == 3


def test_unknown_architecture_is_a_clear_error(tmp_path: Path, checkpoint: Path) -> None:
    import json
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LLMEngine(EngineConfig(model=str(broken), device="cpu"))


def test_missing_weights_are_a_clear_error(tmp_path: Path, checkpoint: Path) -> None:
    import shutil

    broken = tmp_path / "noweights"
    shutil.copytree(checkpoint, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(broken), device="cpu"))


# A float32 model's KV cache is float16 on CPU (docs/kernels.md), when the C attention kernel is built.
HALF_KV = torch.float16 if cpu_attention.library() is not None else torch.float32


@pytest.mark.parametrize(
    ("dtype", "expected", "expected_kv"),
    [
        ("auto", torch.float32, HALF_KV),
        ("float32", torch.float32, HALF_KV),
        ("bfloat16", torch.bfloat16, torch.bfloat16),
        ("float16", torch.float16, torch.float16),
    ],
)
def test_dtypes(checkpoint: Path, dtype: str, expected: torch.dtype, expected_kv: torch.dtype) -> None:
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype=dtype, max_model_len=64))
    assert engine.runner.dtype == expected
    assert engine.runner.kv_caches[0][0].dtype == expected_kv
    assert next(engine.runner.model.parameters()).dtype == expected
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    result = engine.generate([[5, 6, 7, 8]], params)[0]
    assert len(result.choices[0].token_ids) == 4
