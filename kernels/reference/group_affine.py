"""Plain-torch GEMM over group-affine quantized weights; the contract the CPU and Triton kernels match.

A `GroupAffineWeight` holds a [N, K] weight as integer codes with one scale and one offset per
group of `group` consecutive inputs: `W[n, k] = scale[n, k // group] * code[n, k] + offset[n, k // group]`.
Codes of 4 bits are packed two per byte: within each group, byte j holds element j in its low
nibble and element j + group/2 in its high nibble (GGUF's Q4_0 order). 8-bit codes are one per byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

CODE_BITS = (4, 8)


@dataclass(frozen=True)
class GroupAffineWeight:
    """Codes uint8 [N, K * bits / 8], scale and offset float32 [N, K / group]."""

    codes: Tensor
    scale: Tensor
    offset: Tensor
    bits: int
    group: int

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[1]) * 8 // self.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))

    def to(self, device: torch.device) -> GroupAffineWeight:
        return GroupAffineWeight(
            self.codes.to(device), self.scale.to(device), self.offset.to(device), self.bits, self.group
        )


def pack_codes(codes: Tensor, bits: int, group: int) -> Tensor:
    """uint8 codes [N, K] (each < 2**bits) -> the stored layout [N, K * bits / 8]."""
    if bits == 8:
        return codes.contiguous()
    rows, cols = codes.shape
    grouped = codes.reshape(rows, cols // group, 2, group // 2)
    return (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


def unpack_codes(weight: GroupAffineWeight) -> Tensor:
    """The stored layout -> uint8 codes [N, K]."""
    if weight.bits == 8:
        return weight.codes
    rows = weight.out_features
    grouped = weight.codes.reshape(rows, -1, 1, weight.group // 2)
    return torch.cat([grouped & 0x0F, grouped >> 4], dim=2).reshape(rows, weight.in_features)


def dequantize(weight: GroupAffineWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The [N, K] weight, computed in float32 and cast to `dtype`."""
    rows, cols = weight.out_features, weight.in_features
    codes = unpack_codes(weight).reshape(rows, cols // weight.group, weight.group).float()
    values = codes * weight.scale[..., None] + weight.offset[..., None]
    return values.reshape(rows, cols).to(dtype)


def group_affine_linear(x: Tensor, weight: GroupAffineWeight) -> Tensor:
    """`x [.., K] @ W.T -> [.., N]` in x's dtype (the weight dequantized to it, then one GEMM)."""
    return F.linear(x, dequantize(weight, x.dtype))
