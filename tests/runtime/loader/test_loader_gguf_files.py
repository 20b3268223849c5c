"""GGUF files written here with gguf.GGUFWriter: quant types, names, q/k un-permute, rope, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from kvasir.runtime.layers.quantization.gguf import PACKED_GGUF_TYPES, GGUFWeight
from kvasir.runtime.layers.quantization.gguf_blocks import BLOCK_TYPES, decode_blocks
from kvasir.runtime.layers.quantization.half import HalfWeight
from kvasir.runtime.layers.quantization.weights import QuantizedWeight
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.gguf_checkpoint import SUPPORTED_QUANT_TYPES, GGUFCheckpoint
from kvasir.runtime.loader.model_files import open_model
from tests.gguf_encode import encode

Q = GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 96


# Relative RMS error a plain quantizer reaches on Gaussian data, with ~1.5x headroom. A wrong block
# layout or a transposed reshape gives errors near or above 1.
_TOLERANCE = {
    Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 0.01, Q.Q5_0: 0.06, Q.Q5_1: 0.06, Q.Q4_0: 0.12,
    Q.Q4_1: 0.12, Q.Q6_K: 0.03, Q.Q5_K: 0.06, Q.Q4_K: 0.12, Q.Q3_K: 0.27, Q.Q2_K: 0.45,
    Q.IQ4_NL: 0.12, Q.IQ4_XS: 0.12,
}  # fmt: skip


def _write_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
    *,
    arch: str = "llama",
    metadata: dict[str, Any] | None = None,
    heads: tuple[int, int] = (HEADS, KV_HEADS),
) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(heads[0])
    writer.add_head_count_kv(heads[1])
    writer.add_context_length(4096)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(32)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    for name, (values, qtype) in tensors.items():
        if values.dtype == np.uint8:  # already encoded
            writer.add_tensor(name, values, raw_dtype=qtype)
        elif qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, values.astype(np.float32 if qtype == Q.F32 else np.float16))
        elif qtype == Q.BF16:  # the top half of each float32 (gguf-py's own rounding is to nearest)
            bf16 = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            writer.add_tensor(name, bf16.view(np.uint8), raw_dtype=qtype)
        else:
            writer.add_tensor(name, encode(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """Every weight as float32: packed ones through our block decoder."""
    return {
        name: weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
        for name, weight in GGUFCheckpoint(path).iter_weights()
    }


def test_every_claimed_quant_type_dequantizes_within_its_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    # Non-square (rows != row length) so a reversed reshape cannot pass.
    originals = {qtype: rng.standard_normal((8, 512)).astype(np.float32) for qtype in SUPPORTED_QUANT_TYPES}
    names = {qtype: f"blk.{i}.ffn_up.weight" for i, qtype in enumerate(SUPPORTED_QUANT_TYPES)}
    path = _write_gguf(tmp_path / "q.gguf", {names[q]: (v, q) for q, v in originals.items()})
    loaded = _weights(path)
    assert set(_TOLERANCE) == set(SUPPORTED_QUANT_TYPES)
    for qtype, original in originals.items():
        tensor = loaded[f"model.layers.{names[qtype].split('.')[1]}.mlp.up_proj.weight"]
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == (8, 512), qtype.name
        error = np.linalg.norm(tensor.numpy() - original) / np.linalg.norm(original)
        assert error <= _TOLERANCE[qtype], f"{qtype.name}: relative error {error:.4f}"


def test_unsupported_quant_type_names_tensor_and_type(tmp_path: Path) -> None:
    # IQ2_XXS: 256 values in 66 bytes; gguf-py can read it but we do not claim it.
    raw = {"blk.0.ffn_up.weight": (np.zeros((4, 66 * 2), dtype=np.uint8), Q.IQ2_XXS)}
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight.*IQ2_XXS.*supported: F32"):
        GGUFCheckpoint(_write_gguf(tmp_path / "iq.gguf", raw))


def test_unsupported_architecture_is_named_with_the_supported_list(tmp_path: Path) -> None:
    path = _write_gguf(
        tmp_path / "g.gguf", {"token_embd.weight": (np.ones((32, HIDDEN)), Q.F32)}, arch="gemma2"
    )
    with pytest.raises(ModelLoadError, match=r"'gemma2' is not supported; supported: llama, qwen2, qwen3"):
        open_model(str(path))


def test_not_a_gguf_or_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: not a readable GGUF"):
        open_model(str(path))
    tensors = {"token_embd.weight": (np.ones((32, HIDDEN), dtype=np.float32), Q.F32)}
    data = _write_gguf(tmp_path / "whole.gguf", tensors).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: not a readable GGUF"):
        open_model(str(tmp_path / "cut.gguf"))


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's `permute`, written out here to build a file the way llama.cpp does."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_llama_q_and_k_are_unpermuted_to_hf_row_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    k = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    v = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    tensors = {
        "blk.0.attn_q.weight": (_llama_cpp_permute(q, HEADS), Q.F32),
        "blk.0.attn_k.weight": (_llama_cpp_permute(k, KV_HEADS), Q.F32),
        "blk.0.attn_v.weight": (v, Q.F32),
    }
    loaded = _weights(_write_gguf(tmp_path / "l.gguf", tensors))
    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert torch.equal(loaded["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(k))
    assert torch.equal(loaded["model.layers.0.self_attn.v_proj.weight"], torch.from_numpy(v))


def test_qwen3_names_biases_norms_and_no_permute(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    arrays = {
        "token_embd.weight": rng.standard_normal((32, HIDDEN)),
        "output.weight": rng.standard_normal((32, HIDDEN)),
        "output_norm.weight": rng.standard_normal(HIDDEN),
        "blk.0.attn_q.weight": rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)),
        "blk.0.attn_q.bias": rng.standard_normal(HEADS * HEAD_DIM),
        "blk.0.attn_q_norm.weight": rng.standard_normal(HEAD_DIM),
        "blk.0.attn_k_norm.weight": rng.standard_normal(HEAD_DIM),
        "blk.0.ffn_norm.weight": rng.standard_normal(HIDDEN),
    }
    tensors = {name: (value.astype(np.float32), Q.F32) for name, value in arrays.items()}
    path = _write_gguf(
        tmp_path / "q3.gguf", tensors, arch="qwen3", metadata={"qwen3.attention.key_length": 16}
    )
    checkpoint = GGUFCheckpoint(path)
    loaded = _weights(path)
    expected_names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "lm_head.weight": "output.weight",
        "model.norm.weight": "output_norm.weight",
        "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
        "model.layers.0.self_attn.q_proj.bias": "blk.0.attn_q.bias",
        "model.layers.0.self_attn.q_norm.weight": "blk.0.attn_q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight": "blk.0.attn_k_norm.weight",
        "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    }
    assert set(loaded) == set(expected_names)
    for hf_name, gguf_name in expected_names.items():
        assert torch.equal(loaded[hf_name], torch.from_numpy(arrays[gguf_name].astype(np.float32))), hf_name
    config = checkpoint.model_config()
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm
    assert not config.tie_word_embeddings  # output.weight is present
    assert (config.head_dim, config.num_key_value_heads, config.rope_theta) == (16, KV_HEADS, 500000.0)


def test_missing_output_weight_means_tied_embeddings(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": (np.ones((32, HIDDEN), dtype=np.float32), Q.F32)}
    config = GGUFCheckpoint(_write_gguf(tmp_path / "t.gguf", tensors)).model_config()
    assert config.tie_word_embeddings
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (32, HIDDEN, FFN)


def test_llama3_rope_freqs_tensor_becomes_rope_scaling(tmp_path: Path) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    common = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "max_position_embeddings": 4096}
    scaled = LlamaConfig(**common, rope_parameters={"rope_theta": 500000.0, **scaling})
    plain = LlamaConfig(**common, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    scaled_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](scaled, "cpu")
    plain_inv = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    assert plain_inv.shape == scaled_inv.shape and plain.head_dim == HEAD_DIM
    # llama.cpp stores the per-frequency divisor transformers' llama3 rope applies.
    factors = (plain_inv / scaled_inv.double()).numpy().astype(np.float32)
    tensors = {"rope_freqs.weight": (factors, Q.F32), "token_embd.weight": (np.ones((32, HIDDEN)), Q.F32)}
    checkpoint = GGUFCheckpoint(_write_gguf(tmp_path / "r.gguf", tensors))
    assert checkpoint.model_config().rope_scaling == scaling
    assert "rope_freqs.weight" not in {name for name, _ in checkpoint.iter_weights()}

    odd = {**tensors, "rope_freqs.weight": (np.linspace(1, 3, HEAD_DIM // 2, dtype=np.float32), Q.F32)}
    with pytest.raises(ModelLoadError, match="rope frequency factors that match no known"):
        GGUFCheckpoint(_write_gguf(tmp_path / "odd.gguf", odd))


def test_unknown_tensor_and_moe_are_refused(tmp_path: Path) -> None:
    stray = {"blk.0.ffn_gate_exps.weight": (np.ones((2, HIDDEN), dtype=np.float32), Q.F32)}
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_gate_exps\.weight' has no counterpart"):
        GGUFCheckpoint(_write_gguf(tmp_path / "s.gguf", stray))
    moe = {"token_embd.weight": (np.ones((32, HIDDEN), dtype=np.float32), Q.F32), **stray}
    path = _write_gguf(tmp_path / "moe.gguf", moe, metadata={"llama.expert_count": 8})
    with pytest.raises(ModelLoadError, match=r"mixture-of-experts.*expert_count=8"):
        GGUFCheckpoint(path)


# Where each block type keeps its float16 fields (scales): random bytes there could be NaN or inf.
_F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0], "Q2_K": [80, 82],
    "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0],
}  # fmt: skip


@pytest.mark.parametrize("type_name", PACKED_GGUF_TYPES)
def test_block_decoder_equals_gguf_py_on_random_blocks(type_name: str) -> None:
    # Random bytes set every bit of every field (quantizers leave many patterns unused); gguf-py's
    # dequantization is the independent reference.
    per_block, block_bytes, _, _ = BLOCK_TYPES[type_name]
    rng = np.random.default_rng(len(type_name))
    blocks = rng.integers(0, 256, (3 * 512 // per_block, block_bytes), dtype=np.uint8)
    for start in _F16_FIELDS[type_name]:
        blocks[:, start : start + 2] = rng.standard_normal((len(blocks), 1)).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(3, -1)
    expected = dequantize(raw, Q[type_name]).reshape(3, 512)
    assert np.array_equal(decode_blocks(type_name, raw).dequantize(), expected)


def test_every_quantized_type_stays_packed_and_half_matrices_stay_16_bit() -> None:
    assert set(PACKED_GGUF_TYPES) == {t.name for t in SUPPORTED_QUANT_TYPES} - {"F32", "F16", "BF16"}


def test_mixed_file_keeps_every_matrix_packed_and_logs_what_runs_dense_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng = np.random.default_rng(3)
    tensors = {
        "blk.0.ffn_up.weight": (rng.standard_normal((FFN, HIDDEN)).astype(np.float32), Q.Q5_0),
        "blk.0.ffn_gate.weight": (rng.standard_normal((FFN, HIDDEN)).astype(np.float32), Q.IQ4_NL),
        "blk.0.ffn_down.weight": (rng.standard_normal((HIDDEN, FFN)).astype(np.float32), Q.F16),
        "blk.0.attn_q.weight": (rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), Q.BF16),
        "blk.0.attn_k.weight": (rng.standard_normal((32, HIDDEN)).astype(np.float32), Q.F32),
        "blk.0.attn_v.weight": (rng.standard_normal((32, HIDDEN)).astype(np.float32), Q.F32),
        "blk.0.attn_norm.weight": (rng.standard_normal(HIDDEN).astype(np.float32), Q.F32),
    }
    path = _write_gguf(tmp_path / "w.gguf", tensors)
    with caplog.at_level("INFO"):
        loaded = dict(GGUFCheckpoint(path).iter_weights())
    layer = "model.layers.0."
    assert isinstance(loaded[layer + "mlp.up_proj.weight"], GGUFWeight)
    assert isinstance(loaded[layer + "mlp.gate_proj.weight"], GGUFWeight)
    down, q = loaded[layer + "mlp.down_proj.weight"], loaded[layer + "self_attn.q_proj.weight"]
    assert isinstance(down, HalfWeight) and down.tensor.dtype == torch.float16
    assert isinstance(q, HalfWeight) and q.tensor.dtype == torch.bfloat16
    # BF16 is float32's top half: widening is exact. (q was un-permuted to HF's row order.)
    stored = tensors["blk.0.attn_q.weight"][0].view(np.uint32) & 0xFFFF0000
    unpermuted = stored.view(np.float32).reshape(HEADS, HEAD_DIM // 2, 2, HIDDEN).swapaxes(1, 2)
    assert np.array_equal(q.dequantize().numpy(), unpermuted.reshape(HIDDEN, HIDDEN))
    lines = [r for r in caplog.records if "run dense in float32" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "INFO"  # the file's own F32 matrices only
    message = lines[0].getMessage()
    assert "2 matrices (0.0 MiB)" in message and "2 F32 (e.g. 'blk.0.attn_k.weight')" in message
