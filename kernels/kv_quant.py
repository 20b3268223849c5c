"""The FP8 KV cache format: float8 e4m3 values with one scale per layer and tensor (K, V).

A stored value is `clamp(x / scale, -448, 448)` rounded to e4m3; attention reads it back as
`value * scale`. Half the bytes of a bf16 cache, so twice the tokens fit in the same memory.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
KV_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, FP8_DTYPE)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_fp8(x: Tensor, scale: float) -> Tensor:
    """`x / scale` saturated to the e4m3 range and rounded to it (the reference of `store_kv`)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def check_kv_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Scales must be positive and finite, and other than 1 only for an FP8 cache."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (math.isfinite(scale) and scale > 0.0):
            raise ValueError(f"{name} must be a positive finite number, got {scale}")
        if scale != 1.0 and not is_fp8(cache_dtype):
            raise ValueError(
                f"{name} is {scale}, but scales apply only to an fp8 KV cache (this one is {cache_dtype})"
            )
