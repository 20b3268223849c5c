"""AWQ, GPTQ and FP8 checkpoints end to end: loaded packed (format auto-detected from config.json),
run, and compared with Hugging Face `transformers` running the same weights dequantized by the
formats' published readers (tests/quantized_checkpoints.py) in float32.

What each backend must show, and why:

- FP8 on CPU (the fallback: dequantized to float32 at load): the reference's own numbers, so the
  logits match to float32 rounding and greedy output is identical.
- FP8 through the GPU's code path (`KVASIR_KERNELS=triton`: per-token activation quantization and
  `torch._scaled_mm`, which also runs on CPU): activations are rounded to e4m3 too, so the logits
  move; bounded here, with top-1 agreement.
- int4 through the Triton kernel (interpreter, float32): float32 arithmetic on the same weights,
  logits within float32 rounding of the reference.
- int4 through torch's CPU kernel: bfloat16 activations and scales inside, so the logits move by
  bfloat16 rounding; bounded here (LOGIT_ERROR_BF16), with top-1 agreement at every position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from kvasir.kernels.dispatch import reset_backend_choice
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.worker.model_runner import load_model
from tests.quantized_checkpoints import make_quantized_checkpoint
from tests.runtime.models.test_model_parity import PagedRunner
from tests.tiny_checkpoints import SPECIAL_TOKENS

PROMPT_LENGTHS = (7, 16, 23)
# Largest |logit difference| allowed, relative to the reference logits' largest magnitude.
LOGIT_ERROR_FP32 = 1e-5
LOGIT_ERROR_BF16 = 2e-2  # int4 on torch's CPU kernel: bfloat16 activations and scales
LOGIT_ERROR_FP8_ACTIVATIONS = 1e-1  # FP8 activations: 3 mantissa bits per token
TOP1_AGREEMENT_FP8_ACTIVATIONS = 0.9

# name -> (method, make_quantized_checkpoint options)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "awq-g32": ("awq", {"group_size": 32}),
    "awq-g64": ("awq", {"group_size": 64}),
    "gptq-g32-sym": ("gptq", {"group_size": 32, "sym": True}),
    "gptq-g32-act-order": ("gptq", {"group_size": 32, "act_order": True}),
    "gptq-v2-whole-rows": ("gptq", {"group_size": -1, "v1": False}),
    "fp8-per-tensor": ("fp8", {"fp8_kind": "fp8"}),
    "fp8-static": ("fp8", {"fp8_kind": "fp8", "static": True}),
    "compressed-tensors-per-channel": ("fp8", {"fp8_kind": "compressed-tensors", "per_channel": True}),
    "compressed-tensors-static": ("fp8", {"fp8_kind": "compressed-tensors", "static": True}),
}
INT4_CASES = [name for name, (method, _) in CASES.items() if method != "fp8"]
FP8_CASES = [name for name, (method, _) in CASES.items() if method == "fp8"]


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}
    # GQA (2 KV heads) so q/k/v have different widths; biases on q/k/v (Qwen2-like) stay float.
    source = tiny_checkpoint("llama", num_key_value_heads=2, attention_bias=True)

    def get(name: str) -> Path:
        if name not in made:
            method, options = CASES[name]
            made[name] = make_quantized_checkpoint(source, tmp_path_factory.mktemp(name), method, **options)
        return made[name]

    return get


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    def use(backend: str) -> None:
        monkeypatch.setenv("KVASIR_KERNELS", backend)
        reset_backend_choice()

    yield use


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(len(SPECIAL_TOKENS), vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def kvasir_logits(path: Path, quantization: str | None = None) -> tuple[Any, list[torch.Tensor]]:
    files = open_model(str(path), quantization=quantization)
    model = load_model(files, torch.device("cpu"), torch.float32)
    runner = PagedRunner(model)
    batch = prompts(files.config.vocab_size)
    return model, runner.step([(r, p, 0) for r, p in enumerate(batch)])


def reference_logits(path: Path) -> list[torch.Tensor]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0] for p in prompts(hf.config.vocab_size)]


def kernel_names(model: Any) -> set[str]:
    from kvasir.runtime.layers.quantization.report import weights_report

    return set(weights_report(model, None).kernels)


def compare(ours: list[torch.Tensor], expected: list[torch.Tensor]) -> tuple[float, float]:
    """(largest |difference| relative to the largest |reference logit|, top-1 agreement)."""
    scale = max(float(e.abs().max()) for e in expected)
    error = max(float((o - e).abs().max()) for o, e in zip(ours, expected, strict=True)) / scale
    agree = torch.cat([o.argmax(-1) == e.argmax(-1) for o, e in zip(ours, expected, strict=True)])
    return error, float(agree.float().mean())


@pytest.mark.parametrize("name", FP8_CASES)
def test_fp8_on_cpu_runs_the_checkpoints_numbers(name: str, quantized: Callable[[str], Path], kernels: Any) -> None:
    kernels("torch")
    path = quantized(name)
    model, ours = kvasir_logits(path)
    assert model.config.quantization == "fp8"
    assert all("fp8 e4m3" in k and "dequantized to float32 at load" in k for k in kernel_names(model) if "dense" not in k)
    error, agreement = compare(ours, reference_logits(path / "reference"))
    assert error < LOGIT_ERROR_FP32 and agreement == 1.0


@pytest.mark.parametrize("name", ["fp8-per-tensor", "compressed-tensors-static"])
def test_fp8_gemm_path_with_quantized_activations_is_bounded(name: str, quantized: Callable[[str], Path], kernels: Any) -> None:
    kernels("triton")  # the GPU's path: Triton quantizer (interpreter) + torch._scaled_mm (CPU)
    path = quantized(name)
    model, ours = kvasir_logits(path)
    assert any("torch._scaled_mm" in k for k in kernel_names(model))
    error, agreement = compare(ours, reference_logits(path / "reference"))
    assert error < LOGIT_ERROR_FP8_ACTIVATIONS and agreement >= TOP1_AGREEMENT_FP8_ACTIVATIONS, (error, agreement)


@pytest.mark.parametrize("name", INT4_CASES)
def test_int4_triton_kernel_in_float32_matches_the_published_dequantization(
    name: str, quantized: Callable[[str], Path], kernels: Any
) -> None:
    kernels("triton")
    path = quantized(name)
    model, ours = kvasir_logits(path)
    assert model.config.quantization == CASES[name][0]
    assert any("Triton int4 GEMM" in k for k in kernel_names(model))
    error, agreement = compare(ours, reference_logits(path / "reference"))
    assert error < LOGIT_ERROR_FP32 and agreement == 1.0, error


@pytest.mark.parametrize("name", INT4_CASES)
def test_int4_cpu_kernel_agrees_within_bfloat16_rounding(name: str, quantized: Callable[[str], Path], kernels: Any) -> None:
    kernels("torch")
    path = quantized(name)
    model, ours = kvasir_logits(path)
    assert any("torch int4 packed, cpu" in k for k in kernel_names(model))
    error, agreement = compare(ours, reference_logits(path / "reference"))
    assert error < LOGIT_ERROR_BF16 and agreement == 1.0, (error, agreement)


def test_online_fp8_quantizes_a_float_checkpoint(tiny_checkpoint: Callable[..., Path], kernels: Any) -> None:
    kernels("torch")
    path = tiny_checkpoint("llama", num_key_value_heads=2, attention_bias=True)
    model, ours = kvasir_logits(path, quantization="fp8")
    assert model.config.quantization == "fp8"
    names = kernel_names(model)
    assert any("quantized at load" in k for k in names)
    # the LM head stays float (as vLLM's dynamic FP8 leaves it)
    assert model.lm_head.describe() == [k for k in model.lm_head.describe() if "fp8" not in k]
    # FP8 weights (per-row scales): logits within e4m3's relative precision of the float model's
    error, agreement = compare(ours, reference_logits(path))
    assert error < LOGIT_ERROR_FP8_ACTIVATIONS and agreement >= TOP1_AGREEMENT_FP8_ACTIVATIONS, (error, agreement)
