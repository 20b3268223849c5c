"""GGUF block types decoded into one shape every kernel reads: integer codes with a scale and an
offset per group, `w = scale * code + offset`.

The decoders (`gguf_block_decoders` for the 32-value types, `gguf_superblock_decoders` for the
256-value ones) read ggml's block layouts; the result is exact: `scale * code + offset` is the
value ggml's (and gguf-py's) dequantization gives, bit for bit in float32 (tested on random bytes).
Codes the kernels have no narrower layout for are stored in 8 bits: the CPU kernel and the Triton
kernel read 4-bit codes in groups of 32 and 8-bit codes in groups of 32 or 16.

| type | block | codes | group | scale, offset |
|---|---|---|---|---|
| Q4_0 | 32 values, 18 bytes | 4 bit | 32 | d, -8d |
| Q4_1 | 32, 20 | 4 bit | 32 | d, m |
| Q5_0 | 32, 22 | 5 bit (stored in 8) | 32 | d, -16d |
| Q5_1 | 32, 24 | 5 bit (stored in 8) | 32 | d, m |
| Q8_0 | 32, 34 | 8 bit (q + 128) | 32 | d, -128d |
| IQ4_NL | 32, 18 | level + 128 (stored in 8) | 32 | d, -128d |
| Q2_K | 256, 84 | 2 bit (stored in 8) | 16 | d*sc, -dmin*m |
| Q3_K | 256, 110 | 3 bit (stored in 8) | 16 | d*sc, -4*d*sc |
| Q4_K | 256, 144 | 4 bit | 32 | d*sc, -dmin*m |
| Q5_K | 256, 176 | 5 bit (stored in 8) | 32 | d*sc, -dmin*m |
| Q6_K | 256, 210 | 6 bit (stored in 8) | 16 | d*sc, -32*d*sc |
| IQ4_XS | 256, 136 | level + 128 (stored in 8) | 32 | d*sc, -128*d*sc |

IQ4_NL and IQ4_XS map a 4-bit index to one of 16 non-linear levels (-127 .. 113); the level
itself, biased to be unsigned, is the code, so the affine form stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvasir.runtime.layers.quantization import gguf_block_decoders as block_decoders
from kvasir.runtime.layers.quantization import gguf_superblock_decoders as superblock_decoders

# type -> (values per block, bytes per block, code bits as stored for the kernels, group size)
BLOCK_TYPES = {
    "Q4_0": (32, 18, 4, 32),
    "Q4_1": (32, 20, 4, 32),
    "Q5_0": (32, 22, 8, 32),
    "Q5_1": (32, 24, 8, 32),
    "Q8_0": (32, 34, 8, 32),
    "IQ4_NL": (32, 18, 8, 32),
    "Q2_K": (256, 84, 8, 16),
    "Q3_K": (256, 110, 8, 16),
    "Q4_K": (256, 144, 4, 32),
    "Q5_K": (256, 176, 8, 32),
    "Q6_K": (256, 210, 8, 16),
    "IQ4_XS": (256, 136, 8, 32),
}
_DECODERS = {**block_decoders.DECODERS, **superblock_decoders.DECODERS}


# Where each type keeps its float16 fields in a block (d, and dmin or m): its only floats, so a NaN
# or infinite weight can only come from them.
F16_FIELDS = {
    **{"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,)},
    **{"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)},
}


def first_nonfinite_scale(type_name: str, raw: np.ndarray) -> int | None:
    """The index of the first block of `raw` (uint8 [rows, bytes per row]) whose float16 scale or
    offset is NaN or infinite, else None. Reads one byte per field and block: a float16 is
    non-finite when its five exponent bits, bits 2-6 of its high (second) byte, are all set."""
    if type_name not in BLOCK_TYPES:
        raise ValueError(f"GGUF type {type_name} has no packed kernel; supported: {', '.join(BLOCK_TYPES)}")
    block_bytes = BLOCK_TYPES[type_name][1]
    blocks = raw.reshape(-1, block_bytes)
    bad = np.zeros(len(blocks), dtype=bool)
    for start in F16_FIELDS[type_name]:
        bad |= (blocks[:, start + 1] & 0x7C) == 0x7C
    found = np.flatnonzero(bad)
    return int(found[0]) if len(found) else None


@dataclass(frozen=True)
class AffineGroups:
    """`w[n, k] = scale[n, k // group] * codes[n, k] + offset[n, k // group]`."""

    codes: np.ndarray  # uint8 [rows, cols], each < 2**bits
    scale: np.ndarray  # float32 [rows, cols // group]
    offset: np.ndarray  # float32 [rows, cols // group]
    bits: int
    group: int

    def dequantize(self) -> np.ndarray:
        rows, cols = self.codes.shape
        grouped = self.codes.reshape(rows, cols // self.group, self.group).astype(np.float32)
        values = grouped * self.scale[..., None] + self.offset[..., None]
        return values.reshape(rows, cols)


def decode_blocks(type_name: str, raw: np.ndarray) -> AffineGroups:
    """`raw` uint8 [rows, bytes per row] of one GGUF tensor of `type_name` -> its affine groups."""
    if type_name not in BLOCK_TYPES:
        raise ValueError(f"GGUF type {type_name} has no packed kernel; supported: {', '.join(BLOCK_TYPES)}")
    per_block, block_bytes, bits, group = BLOCK_TYPES[type_name]
    rows, row_bytes = raw.shape
    if row_bytes % block_bytes:
        raise ValueError(f"{type_name}: a row of {row_bytes} bytes is not whole blocks of {block_bytes}")
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)
    codes, scale, offset = _DECODERS[type_name](blocks)
    cols = row_bytes // block_bytes * per_block
    return AffineGroups(
        codes=codes.reshape(rows, cols),
        scale=scale.reshape(rows, cols // group).astype(np.float32),
        offset=offset.reshape(rows, cols // group).astype(np.float32),
        bits=bits,
        group=group,
    )
