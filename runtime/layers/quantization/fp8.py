"""FP8 (e4m3) weights: the checkpoints vLLM reads (`fp8`, `compressed-tensors`) and `--quantization fp8`.

Per linear layer an FP8 checkpoint holds `weight` float8_e4m3fn [out, in] and `weight_scale`
float32, one per tensor (a scalar or [1]) or one per output channel ([out] or [out, 1]):

    W[n, k] = weight[n, k] * weight_scale[n]       (the per-tensor scale broadcast to every row)

and, when its activations are quantized statically, `input_scale` (a scalar): the kernel then
quantizes `x / input_scale` instead of measuring each token. Kvasir keeps one scale per row
(`Fp8Weight.scale` [out]) in every case: a per-tensor scale broadcast is the same weight, and
stacked projections (q/k/v with three per-tensor scales) become one per-row vector without
requantizing anything.

`quantize_weight` is `--quantization fp8` on a bf16/fp16/fp32 checkpoint: one scale per output row,
`amax(|row|) / 448`, as vLLM's dynamic FP8 does (it keeps one per tensor; per row is at least as
accurate and runs through the same row-scaled GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
TENSOR_NAMES = ("weight", "weight_scale", "input_scale")


@dataclass(frozen=True)
class Fp8Config:
    """What an FP8 checkpoint declares about its linear layers. (Layers it leaves unquantized, its
    `ignored_layers` / `ignore`, are stored as float tensors: the loader passes them on as such.)"""

    static_activations: bool  # per-tensor `input_scale` in the checkpoint, else per-token at run time

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Fp8Config:
        """`quant_method` `fp8` (vLLM/AutoFP8) or `compressed-tensors` with float8 weights."""
        method = config.get("quant_method")
        if method == "fp8":
            return cls._from_fp8(config)
        if method == "compressed-tensors":
            return cls._from_compressed_tensors(config)
        raise ValueError(f"quantization_config.quant_method {method!r} is not an FP8 method")

    @classmethod
    def _from_fp8(cls, config: dict[str, Any]) -> Fp8Config:
        if config.get("weight_block_size") is not None:
            raise ValueError(
                "quantization_config.weight_block_size is set: block-scaled FP8 (DeepSeek style) "
                "is not supported, only per-tensor and per-channel scales"
            )
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                f"quantization_config.activation_scheme must be 'dynamic' or 'static', got {scheme!r}"
            )
        return cls(static_activations=scheme == "static")

    @classmethod
    def _from_compressed_tensors(cls, config: dict[str, Any]) -> Fp8Config:
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config.config_groups must be a non-empty object")
        static: set[bool] = set()
        for name, group in groups.items():
            where = f"quantization_config.config_groups.{name}"
            targets = group.get("targets") or []
            if "Linear" not in targets:
                raise ValueError(f"{where}.targets must include 'Linear', got {targets!r}")
            weights = group.get("weights") or {}
            _check_float8(weights, f"{where}.weights")
            strategy = weights.get("strategy", "tensor")
            if strategy not in ("tensor", "channel"):
                raise ValueError(
                    f"{where}.weights.strategy is {strategy!r}: only 'tensor' and 'channel' FP8 "
                    "scales are supported"
                )
            activations = group.get("input_activations")
            if activations is None:  # weight-only (W8A16): run with per-token activation scales
                static.add(False)
                continue
            _check_float8(activations, f"{where}.input_activations")
            dynamic = bool(activations.get("dynamic", True))
            act_strategy = activations.get("strategy", "token" if dynamic else "tensor")
            if dynamic and act_strategy not in ("token", "tensor"):
                raise ValueError(
                    f"{where}.input_activations.strategy is {act_strategy!r}; "
                    "dynamic activation scales must be per 'token' or per 'tensor'"
                )
            if not dynamic and act_strategy != "tensor":
                raise ValueError(
                    f"{where}.input_activations.strategy is {act_strategy!r}; "
                    "static activation scales must be per 'tensor'"
                )
            static.add(not dynamic)
        if len(static) > 1:
            raise ValueError(
                "quantization_config.config_groups mix static and dynamic activation scales; "
                "one scheme for all layers is supported"
            )
        return cls(static_activations=static.pop())


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight with one scale per output row, and the static input scale if it has one."""

    weight: Tensor  # float8_e4m3fn [out_features, in_features]
    scale: Tensor  # float32 [out_features]
    input_scale: Tensor | None = None  # float32 scalar tensor: static activation quantization

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 2:
            raise ValueError(
                f"an FP8 weight must be float8_e4m3fn [out, in], got {self.weight.dtype} {list(self.weight.shape)}"
            )
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.weight.shape[0],):
            raise ValueError(
                f"weight_scale must be float32 [{self.weight.shape[0]}], got {self.scale.dtype} "
                f"{list(self.scale.shape)}"
            )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype)


def fp8_from_checkpoint(weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None) -> Fp8Weight:
    """One layer's checkpoint tensors -> `Fp8Weight`; raises ValueError naming the tensor at fault."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be float8_e4m3fn in an FP8 checkpoint, got {weight.dtype}")
    out_features = weight.shape[0]
    scale = weight_scale.float()
    if scale.numel() == 1:
        scale = scale.reshape(1).expand(out_features)
    elif tuple(scale.shape) in ((out_features,), (out_features, 1)):
        scale = scale.reshape(out_features)
    else:
        raise ValueError(
            f"weight_scale must hold one value or one per output row ({out_features}), "
            f"got shape {list(weight_scale.shape)}"
        )
    _check_scales("weight_scale", scale)
    if input_scale is not None:
        if input_scale.numel() != 1:
            raise ValueError(
                f"input_scale must be one value (per tensor), got shape {list(input_scale.shape)}"
            )
        input_scale = input_scale.float().reshape(())
        _check_scales("input_scale", input_scale)
    return Fp8Weight(weight=weight, scale=scale.contiguous(), input_scale=input_scale)


def quantize_weight(weight: Tensor) -> Fp8Weight:
    """A full-precision weight [out, in] -> FP8 with one scale per row (`--quantization fp8`)."""
    w = weight.float()
    amax = w.abs().amax(dim=1).clamp(min=1e-12)  # an all-zero row keeps a usable scale
    scale = amax / FP8_MAX
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(weight=q, scale=scale)


def stack_outputs(parts: list[Fp8Weight]) -> Fp8Weight:
    """Stack projections that read one input; their static input scales become the largest (vLLM's
    choice: no part's activations then saturate)."""
    input_scales = [p.input_scale for p in parts]
    if any(s is None for s in input_scales) and not all(s is None for s in input_scales):
        raise ValueError("stacked projections must all have an input_scale or none")
    input_scale = (
        None if input_scales[0] is None else torch.stack([s for s in input_scales if s is not None]).max()
    )
    return Fp8Weight(
        weight=torch.cat([p.weight for p in parts]),
        scale=torch.cat([p.scale for p in parts]),
        input_scale=input_scale,
    )


def _check_float8(scheme: dict[str, Any], where: str) -> None:
    if scheme.get("num_bits") != 8 or scheme.get("type") != "float":
        raise ValueError(
            f"{where} must be 8-bit 'float' (FP8), got num_bits={scheme.get('num_bits')!r} "
            f"type={scheme.get('type')!r}"
        )


def _check_scales(name: str, scale: Tensor) -> None:
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise ValueError(f"{name} must be positive and finite")
