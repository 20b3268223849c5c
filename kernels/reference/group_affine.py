"""Plain-torch GEMM over group-affine quantized weights; the contract the CPU and Triton kernels match.

A `GroupAffineWeight` holds a [N, K] weight as integer codes with one scale and one offset per
group of `group` consecutive inputs: `W[n, k] = scale[n, k // group] * code[n, k] + offset[n, k // group]`.
Codes of 4 bits are packed two per byte: within each group, byte j holds element j in its low
nibble and element j + group/2 in its high nibble (GGUF's Q4_0 order). 8-bit codes are one per byte.

Two arithmetics: float activations (`group_affine_linear`: the dequantized weight's GEMM), and
integer activations (`group_affine_linear_int`: x first rounded per block of 32 values to int8, as
llama.cpp runs its quantized types, or to 16 bits as two int8 limbs, so the CPU kernel can sum
each group's products in int32).
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


# Activations share one int8 step per block of this many values.
ACTIVATION_BLOCK = 32


ACTIVATION_BITS = (8, 16)


def round_activations(x: Tensor, bits: int = 8) -> Tensor:
    """float32 x [.., K] (K a multiple of 32) rounded per block of 32 and back, the operations and
    their float32 rounding exactly as the C kernel does them. 8 bits: `step * q1` with
    `step = amax / 127`, `q1 = round(x * (127 / amax))` (half to even). 16 bits: a second int8
    limb for the remainder, `q2 = round((x - q1 * step) * (127 / amax * 254))` (clamped to
    +-127), and the value `(step / 254) * (254 * q1 + q2)`."""
    if x.dtype != torch.float32 or x.shape[-1] % ACTIVATION_BLOCK:
        raise ValueError(f"x must be float32 with a multiple of {ACTIVATION_BLOCK} features")
    if bits not in ACTIVATION_BITS:
        raise ValueError(f"activation bits must be one of {ACTIVATION_BITS}, got {bits}")
    blocks = x.reshape(*x.shape[:-1], -1, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # Tensor by tensor: torch divides by a Python scalar as a multiply by its reciprocal, which can
    # differ from C's division in the last bit, and so move a value across a rounding boundary.
    limit = torch.full_like(amax, 127.0)
    inverse = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))
    step = amax / limit
    first = torch.round(blocks * inverse)
    if bits == 8:
        return (first * step).reshape(x.shape)
    second = torch.round((blocks - first * step) * (inverse * 254.0)).clamp(-127, 127)
    return ((first * 254 + second) * (step / torch.full_like(step, 254.0))).reshape(x.shape)


def group_affine_linear_int(x: Tensor, weight: GroupAffineWeight, bits: int) -> Tensor:
    """`x [.., K] @ W.T` with x rounded first (`round_activations`), float32: the exact product of
    W and the rounded x, which the C kernel's int32 sums compute up to float rounding."""
    return F.linear(round_activations(x, bits), dequantize(weight, torch.float32))
