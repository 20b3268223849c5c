"""A GGUF file whose layers mix block types, as llama.cpp's K-quant presets write them (q and k in
one type, v in another, the MLP in a third, the head in Q6_K): every projection stays one packed
kernel (parts of different layouts brought to a common one), the CPU decoder stack binds the whole
model, and it agrees with the same file dequantized by gguf-py and run as a float model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from kvasir.kernels.cpu_ops import decoder_stack
from kvasir.runtime.layers.linear import Linear
from kvasir.runtime.layers.quantization.gguf import GGUFLinear
from kvasir.runtime.layers.quantization.half import HalfLinear
from tests.runtime.models.test_gguf_packed import (
    DIMS,
    LOGIT_BOUNDS,
    _prompts,
    build_pair,
    greedy_logits,
    write_gguf,
)

Q = GGMLQuantizationType

# Per projection: layouts (4-bit/32, 8-bit/32, 8-bit/16) mixed inside q/k/v and gate/up.
MIXES: dict[str, dict[str, GGMLQuantizationType]] = {
    "k-quant": {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q5_0, "gate_proj": Q.Q4_K,
                "up_proj": Q.Q5_K, "down_proj": Q.Q6_K, "embed_tokens": Q.Q8_0, "lm_head": Q.Q6_K},
    "fallbacks": {"q_proj": Q.Q5_0, "k_proj": Q.Q5_1, "v_proj": Q.Q8_0, "o_proj": Q.IQ4_NL, "gate_proj": Q.Q3_K,
                  "up_proj": Q.Q2_K, "down_proj": Q.IQ4_XS, "embed_tokens": Q.Q4_0, "lm_head": Q.Q4_1},
}  # fmt: skip


def _types(mix: dict[str, GGMLQuantizationType]) -> Callable[[str], GGMLQuantizationType]:
    return lambda hf_name: mix.get(hf_name.split(".")[-2], Q.F32)  # norms and biases: 1-D, kept F32


@pytest.fixture(scope="module")
def hf_folder(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen2", **DIMS)


@pytest.mark.parametrize("mix", MIXES)
def test_mixed_layers_are_one_kernel_each_bind_the_stack_and_match_gguf_py(
    mix: str, hf_folder: Path, tmp_path: Path
) -> None:
    packed, reference = build_pair(write_gguf(hf_folder, _types(MIXES[mix]), tmp_path / "mixed.gguf"))
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert all(len(m.kernels or ()) == 1 and isinstance(m.kernels[0], GGUFLinear) for m in linears)
    qkv = packed.model.layers[0].self_attn.qkv_proj.describe()[0]
    assert qkv.startswith(f"gguf {MIXES[mix]['q_proj'].name}+"), qkv  # q and k stack with v
    prompts = _prompts(packed.config.vocab_size)
    ours_tokens, ours = greedy_logits(packed, prompts)
    ref_tokens, expected = greedy_logits(reference, prompts)
    if decoder_stack.library() is not None:
        assert packed.model._cpu_stack is not None  # every layer ran in the one C call
    assert ours_tokens == ref_tokens
    scale = max(e.abs().max().item() for e in expected)
    error = max((o - e).abs().max().item() for o, e in zip(ours, expected, strict=True))
    assert error <= LOGIT_BOUNDS["int16"] * scale, f"max logit error {error:.2e} (logits up to {scale:.1f})"


def test_an_f16_matrix_runs_16_bit_and_the_model_still_matches(hf_folder: Path, tmp_path: Path) -> None:
    mix = {**MIXES["k-quant"], "down_proj": Q.F16, "embed_tokens": Q.F16, "lm_head": Q.F16}
    packed, reference = build_pair(write_gguf(hf_folder, _types(mix), tmp_path / "f16.gguf"))
    (down,) = packed.model.layers[0].mlp.down_proj.kernels  # type: ignore[arg-type]
    assert isinstance(down, HalfLinear) and down.weight.dtype == torch.float16
    assert "float16 (row lookup)" in packed.model.embed_tokens.describe()
    prompts = _prompts(packed.config.vocab_size)
    ours_tokens, ours = greedy_logits(packed, prompts)
    ref_tokens, expected = greedy_logits(reference, prompts)
    assert ours_tokens == ref_tokens
    scale = max(e.abs().max().item() for e in expected)
    error = max((o - e).abs().max().item() for o, e in zip(ours, expected, strict=True))
    assert error <= LOGIT_BOUNDS["int16"] * scale
