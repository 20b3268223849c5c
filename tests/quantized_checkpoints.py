"""Tiny AWQ, GPTQ and FP8 checkpoints, written from a float one by the formats' published packing.

This module is the tests' independent reference for the formats: it quantizes with plain
round-to-nearest (min/max per group), packs with the loops the formats' own writers use (AutoAWQ's
`WQLinear_GEMM.from_linear`, AutoGPTQ's `QuantLinear.pack`) and dequantizes with their published
readers, written here element by element over numpy words, not with Kvasir's unpacking code.

`make_quantized_checkpoint(src, dst, method, ...)` writes the quantized checkpoint to `dst`
(config.json with `quantization_config`, every decoder projection quantized, everything else
copied) and `dst/reference`, a float32 checkpoint of the same model whose projections are the
quantized weights dequantized here: what a correct loader must compute.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: field i of a word holds column AWQ_ORDER[i] of eight
FP8_MAX = 448.0
# The decoder projections every format quantizes (embedding, norms and LM head stay float).
PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


# --- 4-bit round-to-nearest -------------------------------------------------------------------


def quantize_rtn(
    weight: torch.Tensor, g_idx: np.ndarray, num_groups: int, sym: bool
) -> tuple[np.ndarray, ...]:
    """Asymmetric (or symmetric: zero 8) min/max 4-bit quantization of `weight` [out, in] over the
    groups `g_idx` [in] -> (codes [out, in], zeros [out, G], scales [out, G] float16)."""
    w = weight.double().numpy()
    out_features = w.shape[0]
    zeros = np.zeros((out_features, num_groups), dtype=np.int64)
    scales = np.zeros((out_features, num_groups), dtype=np.float16)
    codes = np.zeros(w.shape, dtype=np.int64)
    for g in range(num_groups):
        cols = np.nonzero(g_idx == g)[0]
        block = w[:, cols]
        if sym:
            scale = np.abs(block).max(axis=1) / 7.5
            zero = np.full(out_features, 8)
        else:
            lo, hi = np.minimum(block.min(axis=1), 0.0), np.maximum(block.max(axis=1), 0.0)
            scale = (hi - lo) / 15.0
            zero = np.clip(np.round(-lo / scale), 0, 15).astype(np.int64)
        scale16 = scale.astype(np.float16)
        scales[:, g] = scale16
        zeros[:, g] = zero
        codes[:, cols] = np.clip(np.round(block / scale16.astype(np.float64)[:, None]) + zero[:, None], 0, 15)
    return codes, zeros, scales


def act_order_g_idx(in_features: int, group_size: int, seed: int) -> np.ndarray:
    """GPTQ act-order's g_idx: inputs visited in a random order, each run of `group_size` visits a group."""
    visit = np.random.default_rng(seed).permutation(in_features)
    g_idx = np.empty(in_features, dtype=np.int32)
    g_idx[visit] = np.arange(in_features) // group_size
    return g_idx


# --- AWQ (AutoAWQ "gemm") ---------------------------------------------------------------------


def _pack_columns(values: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    """[rows, cols] 4-bit values -> int32 [rows, cols / 8]: word j, field i = column 8j + order[i]."""
    rows, cols = values.shape
    packed = np.zeros((rows, cols // 8), dtype=np.uint32)
    for col in range(cols // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + order[i]].astype(np.uint32) << np.uint32(4 * i)
    return packed.view(np.int32)


def pack_awq(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray) -> dict[str, torch.Tensor]:
    """AutoAWQ's layout: qweight [in, out/8], qzeros [G, out/8], scales [G, out] float16."""
    return {
        "qweight": torch.from_numpy(_pack_columns(codes.T, AWQ_ORDER)),
        "qzeros": torch.from_numpy(_pack_columns(zeros.T, AWQ_ORDER)),
        "scales": torch.from_numpy(np.ascontiguousarray(scales.T)),
    }


def dequantize_awq(tensors: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """AutoAWQ's reader, element by element: W [out, in] float64."""
    qweight = tensors["qweight"].numpy().view(np.uint32)
    qzeros = tensors["qzeros"].numpy().view(np.uint32)
    scales = tensors["scales"].numpy().astype(np.float64)
    in_features, words = qweight.shape
    w = np.zeros((in_features, words * 8))
    for k in range(in_features):
        g = k // group_size
        for j in range(words):
            for i in range(8):
                n = 8 * j + AWQ_ORDER[i]
                q = (int(qweight[k, j]) >> (4 * i)) & 0xF
                z = (int(qzeros[g, j]) >> (4 * i)) & 0xF
                w[k, n] = (q - z) * scales[g, n]
    return torch.from_numpy(w.T.copy())


# --- GPTQ (AutoGPTQ) --------------------------------------------------------------------------


def pack_gptq(
    codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray, v1: bool
) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: qweight [in/8, out] (eight input rows per word), qzeros [G, out/8] (minus
    one in the original format), scales [G, out] float16, g_idx [in] int32."""
    intweight = codes.T.astype(np.uint32)  # [in, out]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j] << np.uint32(4 * j)
    stored_zeros = (zeros.T - (1 if v1 else 0)) & 0xF  # v1 stores zero - 1 (a zero of 0 wraps to 15)
    return {
        "qweight": torch.from_numpy(qweight.view(np.int32)),
        "qzeros": torch.from_numpy(_pack_columns(stored_zeros, tuple(range(8)))),
        "scales": torch.from_numpy(np.ascontiguousarray(scales.T)),
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
    }


def dequantize_gptq(tensors: dict[str, torch.Tensor], v1: bool) -> torch.Tensor:
    """AutoGPTQ's reader, element by element (v1 adds one to every stored zero): W [out, in] float64."""
    qweight = tensors["qweight"].numpy().view(np.uint32)
    qzeros = tensors["qzeros"].numpy().view(np.uint32)
    scales = tensors["scales"].numpy().astype(np.float64)
    g_idx = tensors["g_idx"].numpy()
    words, out_features = qweight.shape
    w = np.zeros((words * 8, out_features))
    for k in range(words * 8):
        g = int(g_idx[k])
        for n in range(out_features):
            q = (int(qweight[k // 8, n]) >> (4 * (k % 8))) & 0xF
            z = ((int(qzeros[g, n // 8]) >> (4 * (n % 8))) & 0xF) + (1 if v1 else 0)
            w[k, n] = (q - z) * scales[g, n]
    return torch.from_numpy(w.T.copy())


# --- FP8 ----------------------------------------------------------------------------------------


def quantize_fp8(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 weight, float32 scale: [out, 1] per channel or a scalar per tensor)."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max()
    scale = (amax / FP8_MAX).float()
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_config(kind: str, per_channel: bool, static: bool) -> dict[str, Any]:
    """`quantization_config` as AutoFP8/vLLM (`fp8`) or llm-compressor (`compressed-tensors`) writes it."""
    if kind == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static}
    activations["strategy"] = "tensor" if static else "token"
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "dynamic": False,
                    "strategy": "channel" if per_channel else "tensor",
                },
                "input_activations": activations,
            }
        },
    }


# --- checkpoints --------------------------------------------------------------------------------


def make_quantized_checkpoint(
    src: Path,
    dst: Path,
    method: str,
    *,
    group_size: int = 32,
    sym: bool = False,
    act_order: bool = False,
    v1: bool = True,
    fp8_kind: str = "fp8",
    per_channel: bool = False,
    static: bool = False,
) -> Path:
    """Quantize the float checkpoint `src` into `dst` (method `awq`, `gptq` or `fp8`); also write
    `dst/reference` (see the module docstring). Returns `dst`."""
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for index, (name, weight) in enumerate(sorted(tensors.items())):
        if not PROJECTION.fullmatch(name):
            out[name] = reference[name] = weight
            continue
        prefix = name.removesuffix(".weight")
        in_features = weight.shape[1]
        size = in_features if group_size == -1 else group_size
        if method == "fp8":
            q, scale = quantize_fp8(weight, per_channel)
            out[name], out[f"{prefix}.weight_scale"] = q, scale
            if static:
                # A calibrated-looking input scale: each projection its own.
                out[f"{prefix}.input_scale"] = torch.tensor(0.02 + 0.005 * (index % 5), dtype=torch.float32)
            reference[name] = (q.double() * scale.double()).float()
            continue
        g_idx = (
            act_order_g_idx(in_features, size, seed=index)
            if act_order
            else np.arange(in_features, dtype=np.int32) // size
        )
        num_groups = -(-in_features // size)
        codes, zeros, scales = quantize_rtn(weight, g_idx, num_groups, sym)
        if method == "awq":
            packed = pack_awq(codes, zeros, scales)
            reference[name] = dequantize_awq(packed, size).float()
        elif method == "gptq":
            packed = pack_gptq(codes, zeros, scales, g_idx, v1)
            reference[name] = dequantize_gptq(packed, v1).float()
        else:
            raise ValueError(f"unknown method {method!r}")
        out.update({f"{prefix}.{key}": value for key, value in packed.items()})
    if method == "awq":
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        }
    elif method == "gptq":
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": sym,
            "checkpoint_format": "gptq" if v1 else "gptq_v2",
        }
    else:
        config["quantization_config"] = fp8_config(fp8_kind, per_channel, static)
    _write(src, dst, out, config)
    float_config = {k: v for k, v in config.items() if k != "quantization_config"}
    _write(src, dst / "reference", reference, float_config)
    return dst


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for extra in src.iterdir():
        if extra.is_file() and extra.name not in ("model.safetensors", "config.json"):
            shutil.copy(extra, dst / extra.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
