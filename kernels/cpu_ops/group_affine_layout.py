"""The tiled layout `group_affine_gemm.c` streams, built once at load from a `GroupAffineWeight`.

TILE = 16 rows of W sit side by side, one 32-bit vector lane per row. For tile t and group g the
codes are G/4 quads of 64 bytes: lane r of quad q holds the codes of inputs g*G + 4q .. 4q+3 of
row 16t + r. 4-bit codes pack two quads into 64 bytes: the low nibbles are quad c, the high
nibbles quad c + G/8. Scales and offsets are [tiles, groups, 16], float16 where every value of
both is exact in float16 (Q4_0, Q4_1 and Q8_0 store theirs so: a fifth fewer bytes to stream for
4-bit codes), float32 otherwise (the K-quants' products of two scales). Rows are padded with zero
codes up to whole tiles. An embedding lookup reads the same bytes (`tiled_rows`), so a tied
LM head and the embedding keep one table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from kvasir.kernels.reference.group_affine import GroupAffineWeight, pack_codes, unpack_codes

TILE = 16


@dataclass(frozen=True)
class TiledWeight:
    """codes uint8 [tiles, groups * 16 * G * bits / 8]; scale, offset float16 or float32
    [tiles, groups, 16]."""

    codes: Tensor
    scale: Tensor
    offset: Tensor
    bits: int
    group: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))


def tile(weight: GroupAffineWeight) -> TiledWeight:
    """The row-major packed weight in the tiled layout (one copy; the input can then be dropped)."""
    n, k, bits, group = weight.out_features, weight.in_features, weight.bits, weight.group
    tiles, groups = -(-n // TILE), k // group
    pad = tiles * TILE - n
    codes = unpack_codes(weight)
    if pad:  # no copy where the rows are whole tiles (a large table: the load's peak memory)
        codes = F.pad(codes, (0, 0, 0, pad))
    quads = codes.view(tiles, TILE, groups, group // 4, 4).permute(0, 2, 3, 1, 4)
    if bits == 4:  # quads c and c + G/8 share bytes: low and high nibbles
        halves = quads.reshape(tiles, groups, 2, group // 8, TILE, 4)
        quads = halves[:, :, 0] | (halves[:, :, 1] << 4)
    exact_in_half = all(torch.equal(v.half().float(), v) for v in (weight.scale, weight.offset))
    dtype = torch.float16 if exact_in_half else torch.float32
    return TiledWeight(
        codes=quads.reshape(tiles, -1).contiguous(),
        scale=_tile_groups(weight.scale, tiles, pad).to(dtype),
        offset=_tile_groups(weight.offset, tiles, pad).to(dtype),
        bits=bits,
        group=group,
        out_features=n,
        in_features=k,
    )


def _tile_groups(values: Tensor, tiles: int, pad: int) -> Tensor:
    """[N, groups] -> [tiles, groups, 16], rows padded with zeros."""
    padded = F.pad(values, (0, 0, 0, pad)) if pad else values
    return padded.view(tiles, TILE, -1).transpose(1, 2).contiguous()


def tiled_rows(weight: TiledWeight, rows: Tensor) -> GroupAffineWeight:
    """Rows `rows` (int64 [R]) of the weight, row-major packed (an embedding lookup)."""
    groups, quads = weight.in_features // weight.group, weight.group // 4
    chunks = quads if weight.bits == 8 else quads // 2
    codes = weight.codes.view(-1, groups, chunks, TILE, 4)[rows // TILE, :, :, rows % TILE, :]
    if weight.bits == 4:  # [R, groups, G/8, 4] bytes -> [R, groups, G/4, 4] codes
        codes = torch.cat([codes & 0x0F, codes >> 4], dim=2)
    packed = pack_codes(codes.reshape(len(rows), weight.in_features), weight.bits, weight.group)
    return GroupAffineWeight(
        packed,
        weight.scale[rows // TILE, :, rows % TILE].float(),
        weight.offset[rows // TILE, :, rows % TILE].float(),
        weight.bits,
        weight.group,
    )


def untile(weight: TiledWeight) -> GroupAffineWeight:
    """Back to the row-major packed weight (prefill's dense path dequantizes it)."""
    return tiled_rows(weight, torch.arange(weight.out_features))
