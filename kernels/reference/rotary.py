"""Plain-torch rotary position embedding (GPT-NeoX layout); the contract the Triton kernel matches."""

from __future__ import annotations

import torch
from torch import Tensor


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` [T, H, D] by the angles `cos`/`sin` [T, 1, D/2] or [T, D/2]; returns a new tensor.

    The angles (float32 from `RotaryEmbedding`) are cast to x's dtype first, as transformers does,
    so each product and the sum are rounded to that dtype: half-precision results match it too.
    """
    if cos.dim() == 2:  # [T, D/2]: one angle per token, shared by every head
        cos, sin = cos[:, None, :], sin[:, None, :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    # NeoX layout: dimension i pairs with i + D/2 (not with its neighbour, as in GPT-J).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
