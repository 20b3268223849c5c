"""Multi-LoRA serving against an independent reference: transformers with `peft`.

A tiny random-weight Llama and four adapters written by `peft` (ranks 4, 8, 12 and 16 on all seven
projections, one with rsLoRA scaling), then a batch of 16 requests with the base model and the four
adapters interleaved, through `LLMEngine` in float32. Each request's greedy tokens must equal what
PEFT generates for its adapter alone, and the log-probabilities of every generated token (the
logits, normalised) must agree within 1e-4.

The same batch runs again on the model packed as the embedded one is (a Q8_0 GGUF, float32
activations), whose decode steps run every layer, adapters included, in the C decoder stack; PEFT's
reference there is the checkpoint holding the weights that file holds (each matrix quantized and
dequantized).

With `--lora-dtype bfloat16` (both paths again) the slot pool holds the adapters rounded to
bfloat16; PEFT's reference then loads adapters whose weights were rounded the same way (stored as
float32), so both sides compute on the same weights in float32 arithmetic and the same bounds hold.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from kvasir.kernels.cpu_ops import decoder_stack
from kvasir.kernels.cpu_ops.decoder_stack import DecoderStack
from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.engine.outputs import Completion
from kvasir.runtime.layers.quantization.gguf import ACTIVATIONS_ENV
from kvasir.runtime.loader.lora_adapter import read_adapter_digest
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.sample.params import SamplingParams
from tests.gguf_encode import encode
from tests.lora_adapters import make_peft_adapter
from tests.runtime.models.test_gguf_packed import write_gguf
from tests.tiny_checkpoints import VOCAB_SIZE, make_tiny_checkpoint

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
NUM_REQUESTS = 16
# (rank, use_rslora) of the four adapters; the third is scaled by alpha / sqrt(r).
ADAPTERS = [(4, False), (8, False), (12, True), (16, False)]
MAX_RANK = 16
Q8_0 = GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root / "base", "llama", num_key_value_heads=2)
    model_config = open_model(str(base)).config
    loras = []
    for index, (rank, rslora) in enumerate(ADAPTERS):
        path = make_peft_adapter(base, root / f"adapter{index}", rank, use_rslora=rslora, seed=index + 1)
        digest = read_adapter_digest(path, model_config, MAX_RANK)
        loras.append(LoRARequest(f"adapter{index}", index + 1, str(path), digest, rank, "base"))
    generator = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(4, VOCAB_SIZE, (5 + 3 * i,), generator=generator).tolist() for i in range(NUM_REQUESTS)
    ]
    # Request i runs the base model when i % 5 == 0, else adapter i % 5 - 1: interleaved.
    assignment = [None if i % 5 == 0 else loras[i % 5 - 1] for i in range(NUM_REQUESTS)]
    return base, loras, prompts, assignment


@pytest.fixture(scope="module")
def packed_case(case, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(PEFT's base: the checkpoint of the packed file's weights, the Q8_0 GGUF Kvasir serves).
    Q8_0 quantizes each row on its own, so llama.cpp's reordering of q/k rows does not change the
    values; the adapters (random A and B) are the same files on either base."""
    base = case[0]
    root = tmp_path_factory.mktemp("packed")
    reference = root / "dequantized"
    shutil.copytree(base, reference)
    weights = load_file(base / "model.safetensors")
    for name, weight in weights.items():
        if weight.dim() == 2:
            blocks = encode(weight.numpy(), Q8_0)
            values = np.ascontiguousarray(dequantize(blocks, Q8_0).reshape(weight.shape), dtype=np.float32)
            weights[name] = torch.from_numpy(values)
    save_file(weights, str(reference / "model.safetensors"), metadata={"format": "pt"})
    return reference, write_gguf(base, Q8_0, root / "q8_0.gguf", vocabulary=True)


@pytest.fixture(scope="module")
def bf16_loras(case, tmp_path_factory: pytest.TempPathFactory) -> dict[int, LoRARequest]:
    """Each adapter (by id) with every weight rounded to bfloat16 and stored as float32: what a
    bfloat16 slot pool holds, as files PEFT reads."""
    root = tmp_path_factory.mktemp("bf16")
    rounded = {}
    for lora in case[1]:
        folder = root / Path(lora.path).name
        shutil.copytree(lora.path, folder)
        weights = load_file(folder / "adapter_model.safetensors")
        save_file(
            {name: weight.to(torch.bfloat16).float() for name, weight in weights.items()},
            str(folder / "adapter_model.safetensors"),
        )
        rounded[lora.adapter_id] = dataclasses.replace(lora, path=str(folder))
    return rounded


def _peft_reference(
    base: Path, lora: LoRARequest | None, prompt: list[int]
) -> tuple[list[int], torch.Tensor]:
    """PEFT's greedy tokens for `prompt` and the log-probabilities of each generated token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if lora is not None:
        model = peft.PeftModel.from_pretrained(model, lora.path)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        generated = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )[0]
        logits = model(input_ids=generated[None, :-1]).logits[0, len(prompt) - 1 :]
    tokens = generated[len(prompt) :]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), logprobs


def _serve(engine: LLMEngine, prompts, assignment) -> list[Completion]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    results = {}
    for i, (prompt, lora) in enumerate(zip(prompts, assignment, strict=True)):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt, lora=lora)
        results[f"r{i}"] = Completion(0)
    while engine.has_unfinished():
        for output in engine.step():
            for delta in output.outputs:
                results[output.request_id].add(delta)
    return [results[f"r{i}"] for i in range(len(prompts))]


def _engine(base: Path, loras: list[LoRARequest], **overrides: object) -> LLMEngine:
    config = EngineConfig(
        model=str(base),
        device="cpu",
        dtype="float32",
        kv_cache_dtype="float32",  # logprobs within 1e-4 need a float32 cache (see test_engine_parity)
        enable_lora=True,
        max_loras=4,
        max_lora_rank=MAX_RANK,
        **overrides,  # type: ignore[arg-type]
    )
    engine = LLMEngine(config)
    for lora in loras:
        engine.runner.add_lora(lora)
    return engine


@pytest.mark.parametrize("variant", [{}, {"max_num_batched_tokens": 16}], ids=["default", "chunk-16"])
def test_mixed_batch_matches_peft(case, variant: dict[str, object]) -> None:
    base, loras, prompts, assignment = case
    engine = _engine(base, loras, **variant)
    served = _serve(engine, prompts, assignment)
    # All four adapters ran from slots, each copied in once (the batch fits the four slots).
    assert engine.runner.lora is not None and engine.runner.lora.copies_total == len(loras)
    _assert_matches_peft(base, prompts, assignment, served)


def _c_stack_steps(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Filled with one entry per C decoder-stack call from now on: whether it had LoRA rows."""
    adapter_steps: list[bool] = []
    original = DecoderStack.run

    def spy(self: DecoderStack, *args: Any) -> Any:
        adapter_steps.append(len(args) > 5 and args[5] is not None)
        return original(self, *args)

    monkeypatch.setattr(DecoderStack, "run", spy)
    return adapter_steps


@pytest.mark.skipif(decoder_stack.library() is None, reason="no C compiler: the stack is not built")
def test_mixed_batch_through_the_c_stack_matches_peft(
    case, packed_case: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, loras, prompts, assignment = case
    reference, packed = packed_case
    monkeypatch.setenv(ACTIVATIONS_ENV, "float")  # float32 activations, as the reference's
    adapter_steps = _c_stack_steps(monkeypatch)
    engine = _engine(packed, loras)
    served = _serve(engine, prompts, assignment)
    # Every decode step (all of them have adapter rows) ran in the C stack with its LoRA terms.
    assert sum(adapter_steps) >= NEW_TOKENS - 1, adapter_steps
    _assert_matches_peft(reference, prompts, assignment, served)


def test_bfloat16_pool_layer_by_layer_matches_peft_on_rounded_weights(
    case, bf16_loras: dict[int, LoRARequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--lora-dtype bfloat16` on the float checkpoint: the C stack does not take it (no packed
    weights), so the layers add the adapters' terms from the bfloat16 pool, upcast."""
    base, loras, prompts, assignment = case
    c_steps = _c_stack_steps(monkeypatch)
    engine = _engine(base, loras, lora_dtype="bfloat16")
    served = _serve(engine, prompts, assignment)
    assert engine.runner.lora is not None and engine.runner.lora.dtype == torch.bfloat16
    assert c_steps == []
    _assert_matches_peft(base, prompts, _rounded(assignment, bf16_loras), served)


@pytest.mark.skipif(decoder_stack.library() is None, reason="no C compiler: the stack is not built")
def test_bfloat16_pool_through_the_c_stack_matches_peft_on_rounded_weights(
    case,
    packed_case: tuple[Path, Path],
    bf16_loras: dict[int, LoRARequest],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--lora-dtype bfloat16` on the packed model: every decode step in C, reading bfloat16."""
    _, loras, prompts, assignment = case
    reference, packed = packed_case
    monkeypatch.setenv(ACTIVATIONS_ENV, "float")
    adapter_steps = _c_stack_steps(monkeypatch)
    engine = _engine(packed, loras, lora_dtype="bfloat16")
    served = _serve(engine, prompts, assignment)
    pool = engine.runner.lora
    assert pool is not None and pool.stack_pool is not None and pool.stack_pool.dtype == torch.bfloat16
    assert sum(adapter_steps) >= NEW_TOKENS - 1, adapter_steps
    _assert_matches_peft(reference, prompts, _rounded(assignment, bf16_loras), served)


def _rounded(
    assignment: list[LoRARequest | None], rounded: dict[int, LoRARequest]
) -> list[LoRARequest | None]:
    """The assignment with each adapter replaced by its bfloat16-rounded files (for PEFT)."""
    return [None if lora is None else rounded[lora.adapter_id] for lora in assignment]


def _assert_matches_peft(base: Path, prompts, assignment, served: list[Completion]) -> None:
    for prompt, lora, completion in zip(prompts, assignment, served, strict=True):
        tokens, logprobs = _peft_reference(base, lora, prompt)
        assert completion.token_ids == tokens, f"adapter {lora.name if lora else 'base'}"
        assert completion.logprobs is not None
        ours = torch.tensor([entry.logprob for entry in completion.logprobs])
        torch.testing.assert_close(ours, logprobs, rtol=0, atol=1e-4)


def test_adapters_change_the_output(case) -> None:
    # Guards the parity test against adapters too weak to matter: each one changes the greedy tokens.
    base, loras, prompts, _ = case
    outputs = {_peft_reference(base, lora, prompts[1])[0].__repr__() for lora in [None, *loras]}
    assert len(outputs) == 5
