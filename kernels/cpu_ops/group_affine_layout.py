"""The tiled layout `group_affine_gemm.c` streams, built once at load from a `GroupAffineWeight`.

TILE = 16 rows of W sit side by side, one 32-bit vector lane per row. For tile t and group g the
codes are G/4 quads of 64 bytes: lane r of quad q holds the codes of inputs g*G + 4q .. 4q+3 of
row 16t + r. 4-bit codes pack two quads into 64 bytes: the low nibbles are quad c, the high
nibbles quad c + G/8. 5-bit codes (an 8-bit weight in groups of 32 whose codes all fit in five
bits: Q5_0, Q5_1, Q5_K) are the 4-bit layout of their low four bits followed by 64 bytes of fifth
bits: byte j of those (lane j / 4, byte j % 4 of a quad) holds in bit q the fifth bit of quad q's
byte j; 5 bits a weight instead of 8. Scales and offsets are [tiles, groups, 16], float16 where every value of
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
    [tiles, groups, 16]. `bits` is the tiled layout's: 4, 5 or 8."""

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


# Tiles laid out per pass: the layout's transient copies of the codes stay a few MiB whatever the
# weight's size (a 151,936-row table laid out at once held three copies of its 130 MiB of codes at
# the load's peak).
CHUNK_TILES = 256


def tile(weight: GroupAffineWeight) -> TiledWeight:
    """The row-major packed weight in the tiled layout (one copy; the input can then be dropped);
    8-bit codes in groups of 32 that all fit in five bits take the 5-bit layout."""
    n, k, group = weight.out_features, weight.in_features, weight.group
    tiles, groups = -(-n // TILE), k // group
    pad = tiles * TILE - n
    bits = 5 if weight.bits == 8 and group == 32 and int(weight.codes.max()) < 32 else weight.bits
    codes = torch.empty((tiles, groups * TILE * group * bits // 8), dtype=torch.uint8)
    for first in range(0, tiles, CHUNK_TILES):
        last = min(tiles, first + CHUNK_TILES)
        rows = slice(first * TILE, min(n, last * TILE))
        part = GroupAffineWeight(
            weight.codes[rows], weight.scale[rows], weight.offset[rows], weight.bits, group
        )
        codes[first:last] = _tile_codes(unpack_codes(part), bits, group, last - first)
    exact_in_half = all(torch.equal(v.half().float(), v) for v in (weight.scale, weight.offset))
    dtype = torch.float16 if exact_in_half else torch.float32
    return TiledWeight(
        codes=codes,
        scale=_tile_groups(weight.scale, tiles, pad).to(dtype),
        offset=_tile_groups(weight.offset, tiles, pad).to(dtype),
        bits=bits,
        group=group,
        out_features=n,
        in_features=k,
    )


def _tile_codes(codes: Tensor, bits: int, group: int, tiles: int) -> Tensor:
    """uint8 codes [rows, K] of `tiles` whole tiles (the last one's missing rows padded with zero
    codes) -> their tiled bytes [tiles, groups * 16 * G * bits / 8]."""
    pad = tiles * TILE - codes.shape[0]
    if pad:
        codes = F.pad(codes, (0, 0, 0, pad))
    groups = codes.shape[1] // group
    quads = codes.view(tiles, TILE, groups, group // 4, 4).permute(0, 2, 3, 1, 4)
    if bits == 5:  # the fifth bits of quad q in bit q of one 64-byte plane, then the 4-bit layout
        fifth = ((quads >> 4) << torch.arange(group // 4, dtype=torch.uint8).view(1, 1, -1, 1, 1)).sum(2)
        quads = quads & 0x0F
    if bits != 8:  # quads c and c + G/8 share bytes: low and high nibbles
        halves = quads.reshape(tiles, groups, 2, group // 8, TILE, 4)
        quads = halves[:, :, 0] | (halves[:, :, 1] << 4)
    if bits == 5:
        quads = torch.cat(
            [quads.reshape(tiles, groups, -1), fifth.to(torch.uint8).reshape(tiles, groups, -1)], 2
        )
    return quads.reshape(tiles, -1)


def _tile_groups(values: Tensor, tiles: int, pad: int) -> Tensor:
    """[N, groups] -> [tiles, groups, 16], rows padded with zeros."""
    padded = F.pad(values, (0, 0, 0, pad)) if pad else values
    return padded.view(tiles, TILE, -1).transpose(1, 2).contiguous()


def tiled_rows(weight: TiledWeight, rows: Tensor) -> GroupAffineWeight:
    """Rows `rows` (int64 [R]) of the weight, row-major packed (an embedding lookup); a 5-bit
    weight comes back with 8-bit codes."""
    bits, groups, quads = weight.bits, weight.in_features // weight.group, weight.group // 4
    per_group = TILE * weight.group * bits // 8
    stored = weight.codes.view(-1, groups, per_group)[rows // TILE]  # [R, groups, bytes]
    lane = (rows % TILE).view(-1, 1, 1, 1)
    chunks = quads if bits == 8 else quads // 2
    nibbles = stored[:, :, : 64 * chunks].view(len(rows), groups, chunks, TILE, 4)
    codes = nibbles.gather(3, lane.unsqueeze(-1).expand(-1, groups, chunks, 1, 4)).squeeze(3)
    if bits != 8:  # [R, groups, G/8, 4] bytes -> [R, groups, G/4, 4] codes
        codes = torch.cat([codes & 0x0F, codes >> 4], dim=2)
    if bits == 5:
        plane = stored[:, :, 64 * chunks :].view(len(rows), groups, 1, TILE, 4)
        plane = plane.gather(3, lane.unsqueeze(-1).expand(-1, groups, 1, 1, 4)).squeeze(3)
        codes = codes | (((plane >> torch.arange(quads, dtype=torch.uint8).view(1, 1, -1, 1)) & 1) << 4)
    packed_bits = 8 if bits == 5 else bits
    packed = pack_codes(codes.reshape(len(rows), weight.in_features), packed_bits, weight.group)
    return GroupAffineWeight(
        packed,
        weight.scale[rows // TILE, :, rows % TILE].float(),
        weight.offset[rows // TILE, :, rows % TILE].float(),
        packed_bits,
        weight.group,
    )


def untile(weight: TiledWeight) -> GroupAffineWeight:
    """Back to the row-major packed weight (prefill's dense path dequantizes it)."""
    return tiled_rows(weight, torch.arange(weight.out_features))
