"""Eight 4-bit codes per int32 word: the packing every int4 format and kernel here uses.

Field i of a word sits at bits 4i..4i+3. Formats differ in which of eight consecutive values each
field holds (`order`) and along which dimension the eight are consecutive.
"""

from __future__ import annotations

import torch
from torch import Tensor

CODE_MASK = 15
PACK = 8  # codes per int32 word


def unpack_int32(packed: Tensor, dim: int, order: tuple[int, ...] | None = None) -> Tensor:
    """The eight 4-bit fields of each int32 word, laid out along `dim` (8x longer), as uint8.

    Field i sits at bits 4*i..4*i+3. `order[i]` is the position, within each run of eight, of the
    value held by field i (None: field i holds position i, GPTQ's order).
    """
    if packed.dtype != torch.int32:
        raise ValueError(f"packed 4-bit weights must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    fields = (packed.unsqueeze(-1) >> shifts) & CODE_MASK  # [..., 8], field index last
    if order is not None:
        fields = fields[..., _inverse(order)]  # position j holds field inverse[j]
    dim = dim % packed.dim()
    fields = fields.movedim(-1, dim + 1)  # the eight values right after the packed dimension
    shape = list(packed.shape)
    shape[dim] *= PACK
    return fields.reshape(shape).to(torch.uint8)


def pack_int32(codes: Tensor, dim: int, order: tuple[int, ...] | None = None) -> Tensor:
    """The inverse of `unpack_int32`: runs of eight 4-bit codes along `dim` into one int32 each."""
    dim = dim % codes.dim()
    if codes.shape[dim] % PACK:
        raise ValueError(f"dimension {dim} ({codes.shape[dim]}) is not a multiple of {PACK}")
    shape = list(codes.shape)
    shape[dim : dim + 1] = [shape[dim] // PACK, PACK]
    fields = codes.to(torch.int32).reshape(shape).movedim(dim + 1, -1)  # [..., 8] positions last
    if order is not None:
        fields = fields[..., list(order)]  # field i holds position order[i]
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int32)
    # Sum of disjoint bit fields: exact in int32, the sign bit included (wraps like the OR would).
    return (fields << shifts).sum(dim=-1, dtype=torch.int32)


def _inverse(order: tuple[int, ...]) -> list[int]:
    inverse = [0] * len(order)
    for field, position in enumerate(order):
        inverse[position] = field
    return inverse
