"""A tiny Llama written as GGUF in each packed type, run with its weights kept packed, against the
same file dequantized by the `gguf` package (an independent implementation of the block formats)
and run as a float model.

Both models compute with the same weight values (our decoder is exact); the CPU kernel's
activation setting (`KVASIR_GGUF_CPU_ACTIVATIONS`) decides the rest, each one tested for every type:
- float: float32 activations, so the logits differ only by the order of float32 sums: bound 1e-4
  of the logits' scale, greedy decoding identical;
- int16 (the default): x rounded to 16 bits per block of 32 values: measured at most 4-6e-5 of
  the logits' scale (2026-11-26), bound 2e-4, greedy decoding identical;
- int8 (llama.cpp's rounding): measured at most 1.2-1.6e-2 of the logits' scale and the same
  top-1 token at 97-100% of the 36 teacher-forced positions of each type; bounds 3e-2 and 90%.
Prompts and decode steps alike run the CPU C kernel (the torch reference without a compiler); a
packed layer also runs through the Triton kernel (in the interpreter without a GPU).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from safetensors.torch import load_file

from kvasir.kernels.group_affine import tiles_on
from kvasir.kernels.triton_ops.group_affine import group_affine_linear as triton_linear
from kvasir.runtime.layers.linear import Linear
from kvasir.runtime.layers.quantization.gguf import (
    ACTIVATIONS_ENV,
    PACKED_GGUF_TYPES,
    GGUFWeight,
    activation_bits,
)
from kvasir.runtime.layers.quantization.half import HalfWeight
from kvasir.runtime.loader.gguf_checkpoint import GGUFCheckpoint
from kvasir.runtime.models.base import CausalLM
from kvasir.runtime.models.registry import get_model_class
from tests.gguf_encode import encode
from tests.runtime.models.paged_runner import PagedRunner
from tests.tiny_checkpoints import SPECIAL_TOKENS

Q = GGMLQuantizationType
# K-quants need rows of whole 256-value super-blocks: every matrix here has 256 or 512 columns.
DIMS = {"hidden_size": 256, "intermediate_size": 512, "num_key_value_heads": 2}
NEW_TOKENS = 8
# Max logit error allowed, as a share of the logits' largest magnitude, per activation setting.
LOGIT_BOUNDS = {"float": 1e-4, "int16": 2e-4, "int8": 3e-2}
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}  # fmt: skip


def _gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    module, leaf = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{leaf}"


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    folder: Path,
    qtype: GGMLQuantizationType | Callable[[str], GGMLQuantizationType],
    path: Path,
    *,
    tied: bool = False,
    vocabulary: bool = False,
) -> Path:
    """The tiny HF checkpoint in `folder` (Llama, Qwen2 or Qwen3) as llama.cpp would convert it,
    every matrix in `qtype` (or in `qtype(hf_name)`: a file whose layers mix types); `vocabulary`:
    with a minimal byte-level tokenizer (token ids only matter), so that `LLMEngine` can open the
    file."""
    weights = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_context_length(256)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(weights["model.embed_tokens.weight"].shape[0])
    if vocabulary:
        size = weights["model.embed_tokens.weight"].shape[0]
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b", "ab", *(f"t{i}" for i in range(size - 3))])
        writer.add_token_merges(["a b"])
    for hf_name, tensor in weights.items():
        if tied and hf_name == "lm_head.weight":
            continue
        values = tensor.float().numpy()
        # Only the "llama" architecture has its q/k rows permuted by llama.cpp's converter.
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            values = _llama_cpp_permute(values, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            values = _llama_cpp_permute(values, kv_heads)
        stored = qtype(hf_name) if callable(qtype) else qtype
        if values.ndim == 1:
            writer.add_tensor(_gguf_name(hf_name), values)
        elif stored == Q.F16:
            writer.add_tensor(_gguf_name(hf_name), values.astype(np.float16))
        else:
            writer.add_tensor(_gguf_name(hf_name), encode(values, stored), raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _reference_weights(checkpoint: GGUFCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight as float32, packed ones dequantized by gguf-py from the blocks we were handed."""
    for name, weight in checkpoint.iter_weights():
        if isinstance(weight, GGUFWeight):
            values = dequantize(weight.blocks, Q[weight.type_name]).reshape(weight.shape)
            yield name, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        elif isinstance(weight, HalfWeight):
            yield name, weight.tensor.float()
        else:
            yield name, weight


def build_pair(path: Path) -> tuple[CausalLM, CausalLM]:
    """(the model with packed weights, the float model of gguf-py's dequantization)."""
    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.model_config()
    model_class = get_model_class(config.architecture)
    packed = model_class(dataclasses.replace(config, quantization="gguf"))
    packed.load_weights(checkpoint.iter_weights())
    reference = model_class(config)
    reference.load_weights(_reference_weights(checkpoint))
    return packed, reference


def greedy_logits(model: CausalLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill each prompt, then NEW_TOKENS greedy decode steps of the whole batch together;
    returns the tokens and every step's logits."""
    runner = PagedRunner(model)
    steps = runner.step([(r, p, 0) for r, p in enumerate(prompts)])
    last = [rows[-1] for rows in steps]
    all_logits = list(last)
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(NEW_TOKENS):
        chunks = []
        for r, logits in enumerate(last):
            tokens[r].append(int(logits.argmax()))
            chunks.append((r, [tokens[r][-1]], len(prompts[r]) + len(tokens[r]) - 1))
        last = [rows[-1] for rows in runner.step(chunks)]
        all_logits.extend(last)
    return tokens, all_logits


@pytest.fixture(scope="module")
def hf_folder(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama", **DIMS)


def _prompts(vocab: int, lengths: tuple[int, ...] = (29, 5), seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(len(SPECIAL_TOKENS), vocab, (n,), generator=g).tolist() for n in lengths]


def forced_logits(model: CausalLM, prompts: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
    """Logits [steps, prompts, vocab] after each prompt and after each of `tokens` fed in turn
    (teacher forcing: both models see the same sequences, so every position compares)."""
    runner = PagedRunner(model)
    steps = [torch.stack([rows[-1] for rows in runner.step([(r, p, 0) for r, p in enumerate(prompts)])])]
    for t in range(len(tokens[0])):
        chunks = [(r, [tokens[r][t]], len(prompts[r]) + t) for r in range(len(prompts))]
        steps.append(torch.stack([rows[-1] for rows in runner.step(chunks)]))
    return torch.stack(steps)


@pytest.mark.parametrize("activations", ["float", "int16", "int8"])
@pytest.mark.parametrize("type_name", PACKED_GGUF_TYPES)
def test_packed_model_matches_gguf_dequantized_reference(
    type_name: str, activations: str, hf_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ACTIVATIONS_ENV, activations)
    packed, reference = build_pair(write_gguf(hf_folder, Q[type_name], tmp_path / f"{type_name}.gguf"))
    kernels = [k for m in packed.modules() if isinstance(m, Linear) for k in m.describe()]
    assert kernels and all(f"gguf {type_name}" in k for k in kernels), kernels
    if tiles_on(torch.device("cpu"), 4, 32):  # the C kernel runs, and says with what activations
        described = "float32" if activations == "float" else activations
        assert all(f"C kernel, {described} activations" in k for k in kernels), kernels
    prompts = _prompts(packed.config.vocab_size)
    ours_tokens, ours = greedy_logits(packed, prompts)
    ref_tokens, expected = greedy_logits(reference, prompts)
    scale = max(e.abs().max().item() for e in expected)
    if activations != "int8":
        assert ours_tokens == ref_tokens
        error = max((o - e).abs().max().item() for o, e in zip(ours, expected, strict=True))
        bound = LOGIT_BOUNDS[activations] * scale
        assert error <= bound, f"{type_name}: max logit error {error:.2e} (logits up to {scale:.1f})"
        return
    # Four prompts, every position compared: 36 positions.
    prompts += _prompts(packed.config.vocab_size, lengths=(12, 17), seed=12)
    ref_tokens = greedy_logits(reference, prompts)[0]
    ours_forced = forced_logits(packed, prompts, ref_tokens)
    expected_forced = forced_logits(reference, prompts, ref_tokens)
    error = (ours_forced - expected_forced).abs().max().item()
    agreement = (ours_forced.argmax(-1) == expected_forced.argmax(-1)).float().mean().item()
    assert error <= LOGIT_BOUNDS["int8"] * scale, (
        f"{type_name}: max logit error {error:.2e} (logits up to {scale:.1f})"
    )
    assert agreement >= 0.9, f"{type_name}: same top-1 token at {agreement:.0%} of positions"


def test_tied_embedding_and_head_share_one_packed_table(hf_folder: Path, tmp_path: Path) -> None:
    path = write_gguf(hf_folder, Q.Q8_0, tmp_path / "tied.gguf", tied=True)
    packed, reference = build_pair(path)
    assert packed.config.tie_word_embeddings
    embed_codes = packed.model.embed_tokens.kernel.codes  # type: ignore[union-attr]
    (head,) = packed.lm_head.kernels  # type: ignore[arg-type]
    assert head.codes.data_ptr() == embed_codes.data_ptr()
    prompts = _prompts(packed.config.vocab_size)
    assert greedy_logits(packed, prompts)[0] == greedy_logits(reference, prompts)[0]


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q2_K", "IQ4_XS"])
def test_triton_kernel_on_a_packed_layer_matches_gguf_dequantized(
    type_name: str, hf_folder: Path, tmp_path: Path
) -> None:
    # The merged q/k/v layer of the packed model through the Triton kernel (Triton's interpreter
    # without a GPU), against gguf-py's dequantization of the same three tensors.
    packed, reference = build_pair(write_gguf(hf_folder, Q[type_name], tmp_path / "t.gguf"))
    (kernel,) = packed.model.layers[0].self_attn.qkv_proj.kernels  # type: ignore[arg-type]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(3, packed.config.hidden_size, generator=torch.Generator().manual_seed(5))
    got = triton_linear(x.to(device), kernel.weight().to(device)).cpu()
    expected = reference.model.layers[0].self_attn.qkv_proj(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_activation_setting_is_read_at_load_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ACTIVATIONS_ENV, raising=False)
    assert all(activation_bits(t) == 16 for t in PACKED_GGUF_TYPES)  # the default: int16 for every type
    monkeypatch.setenv(ACTIVATIONS_ENV, "INT8")
    assert activation_bits("Q4_K") == 8
    monkeypatch.setenv(ACTIVATIONS_ENV, "fp8")
    with pytest.raises(ValueError, match=f"{ACTIVATIONS_ENV} must be auto, float, int8, int16"):
        activation_bits("Q4_K")


def test_a_packed_weight_lets_its_file_pages_go_once_decoded_for_a_build() -> None:
    # The loader hands each weight over with a `release` of its file pages: called once its blocks
    # are decoded for a build (a merged projection's every part), so a build's peak never holds
    # the file's bytes next to the decoded and packed ones; the product is unchanged.
    rng = np.random.default_rng(7)
    values = [rng.standard_normal((rows, 64)).astype(np.float32) for rows in (16, 8)]
    released: list[int] = []
    parts = [
        GGUFWeight("Q8_0", encode(v, GGMLQuantizationType.Q8_0), v.shape, lambda i=i: released.append(i))
        for i, v in enumerate(values)
    ]
    merged = GGUFWeight.build_linear(parts, torch.device("cpu"), torch.float32)
    assert sorted(released) == [0, 1]
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    expected = x @ torch.cat([part.dequantize() for part in parts]).T
    torch.testing.assert_close(merged(x), expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())
    single = GGUFWeight(
        "Q8_0", encode(values[0], GGMLQuantizationType.Q8_0), (16, 64), lambda: released.append(2)
    )
    single.build_embedding(torch.device("cpu"), torch.float32)
    GGUFWeight.build_linear([single], torch.device("cpu"), torch.float32)  # the tied head: packed once
    assert sorted(released) == [0, 1, 2]
