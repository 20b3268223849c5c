"""Rotary position embedding (GPT-NeoX layout), with Llama 3 and linear rope scaling as in transformers.

The cos/sin table lives here; the rotation itself, `apply_rotary`, is the op in `kvasir.kernels`
(a Triton kernel on CUDA, the torch reference elsewhere), re-exported for the model files.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from kvasir.kernels import apply_rotary

__all__ = ["RotaryEmbedding", "apply_rotary"]


class RotaryEmbedding(nn.Module):
    """The cos/sin table of every position up to `max_position`, computed once, in float32."""

    cos: Tensor
    sin: Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        inv_freq = _scaled_inv_freq(_inv_freq(head_dim, base), scaling)
        # Same float32 ops, in the same order, as transformers' LlamaRotaryEmbedding.forward,
        # so the table is bit-identical to what it computes on the fly.
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin [T, 1, D/2] (float32) for `positions` [T]; looked up once per step for all layers."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def _inv_freq(head_dim: int, base: float) -> Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base**exponents)


def _scaled_inv_freq(inv_freq: Tensor, scaling: dict[str, Any] | None) -> Tensor:
    """Apply a Hugging Face `rope_scaling` dict ("llama3" or "linear"; None or "default": none)."""
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        # Interpolating positions by 1/factor is the same as dividing every frequency by factor.
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (llama3, linear)")


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    missing = [
        key
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if key not in scaling
    ]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {', '.join(missing)}")
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
