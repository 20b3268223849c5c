"""GGUF files written here with gguf.GGUFWriter: quant types, names, q/k un-permute, rope, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from kvasir.runtime.layers.quantization.gguf import GGUFWeight
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.gguf_checkpoint import SUPPORTED_QUANT_TYPES, GGUFCheckpoint
from kvasir.runtime.loader.model_files import open_model

Q = GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 96


# --- Test-only K-quant quantizers: gguf-py dequantizes these types but cannot quantize them. ---
# Each follows ggml's block layout (ggml-quants.c dequantize_row_q*_K) with a plain min/max fit.


def _f16(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _affine(sub: np.ndarray, levels: int, scale_bits: int) -> tuple[np.ndarray, ...]:
    """x ~ d*sc*q - dmin*m per sub-block, q in [0, levels], sc and m on `scale_bits` bits."""
    low = np.minimum(sub.min(axis=-1), 0.0)
    step = (sub.max(axis=-1) - low) / levels
    top = (1 << scale_bits) - 1
    d = (step.max(axis=-1, keepdims=True) / top).astype(np.float16).astype(np.float32)
    dmin = ((-low).max(axis=-1, keepdims=True) / top).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_div(step, d)), 0, top).astype(np.uint8)
    m = np.clip(np.round(_div(-low, dmin)), 0, top).astype(np.uint8)
    q = np.round(_div(sub + (dmin * m)[..., None], (d * sc)[..., None]))
    return d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def _k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 8, 32), 15, 6)
    pairs = q.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16(d), _f16(dmin), _k4_scales(sc, m), qs], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 8, 32), 31, 6)
    low = (q & 0xF).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):  # sub-block j keeps its fifth bit in bit j of qh
        qh |= (q[:, j] >> 4) << j
    return np.concatenate([_f16(d), _f16(dmin), _k4_scales(sc, m), qh, qs], axis=1)


def _q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 16, 16), 3, 4)
    codes = q.reshape(-1, 2, 4, 32)  # [half, shift, position]
    qs = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for j in range(4):
        qs |= codes[:, :, j] << (2 * j)
    return np.concatenate([sc | (m << 4), qs.reshape(-1, 64), _f16(d), _f16(dmin)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=-1) / 31
    d = (step.max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_div(step, d)), -128, 127).astype(np.int8)
    q = np.clip(np.round(_div(sub, (d * sc)[..., None])), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [half, quarter, position]
    low, high = q & 0xF, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d)], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=-1) / 4
    d = (step.max(axis=-1, keepdims=True) / 31).astype(np.float16).astype(np.float32)
    s = np.clip(np.round(_div(step, d)), 0, 31).astype(np.uint8)
    q = (np.clip(np.round(_div(sub, (d * s)[..., None])), -4, 3) + 4).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [half, shift, position]
    qs = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    hmask = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for half in range(2):
        for j in range(4):
            qs[:, half] |= (q[:, half, j] & 3) << (2 * j)
            hmask |= (q[:, half, j] >> 2) << (4 * half + j)
    s = s + 32  # stored biased by 32, six bits each, split 4 + 2
    scales = np.zeros((q.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (s[:, 0:4] & 0xF) | ((s[:, 8:12] & 0xF) << 4)
    scales[:, 4:8] = (s[:, 4:8] & 0xF) | ((s[:, 12:16] & 0xF) << 4)
    scales[:, 8:12] = (
        (s[:, 0:4] >> 4) | ((s[:, 4:8] >> 4) << 2) | ((s[:, 8:12] >> 4) << 4) | ((s[:, 12:16] >> 4) << 6)
    )
    return np.concatenate([hmask, qs.reshape(-1, 64), scales, _f16(d)], axis=1)


_K_QUANTIZERS = {Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}
# Relative RMS error a plain quantizer reaches on Gaussian data, with ~1.5x headroom. A wrong block
# layout or a transposed reshape gives errors near or above 1.
_TOLERANCE = {
    Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 0.01, Q.Q5_0: 0.06, Q.Q5_1: 0.06, Q.Q4_0: 0.12,
    Q.Q4_1: 0.12, Q.Q6_K: 0.03, Q.Q5_K: 0.06, Q.Q4_K: 0.12, Q.Q3_K: 0.27, Q.Q2_K: 0.45,
}  # fmt: skip


def _encode(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype in _K_QUANTIZERS:
        rows = values.reshape(-1, values.shape[-1])
        return _K_QUANTIZERS[qtype](rows).reshape(*values.shape[:-1], -1)
    return quantize(values, qtype)


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
        else:
            writer.add_tensor(name, _encode(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """Every weight as float32: packed ones through our block decoder."""
    return {
        name: weight.dequantize() if isinstance(weight, GGUFWeight) else weight
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
    # IQ4_NL: 32 values in 18 bytes; gguf-py can read it but we do not claim it.
    raw = {"blk.0.ffn_up.weight": (np.zeros((4, 18 * 2), dtype=np.uint8), Q.IQ4_NL)}
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight.*IQ4_NL.*supported: F32"):
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
