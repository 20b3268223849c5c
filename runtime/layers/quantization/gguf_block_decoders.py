"""Decoders of GGUF's 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) into
group-affine codes: `(codes, scale, offset)` per block, `w = scale * code + offset`.

Each reads ggml's block layout (ggml-quants.c's dequantize_row_*). Signed values are stored with a
bias that makes them unsigned codes (the kernels multiply unsigned codes with signed activations),
and the bias moves into the offset: `d * q == d * (q + b) - b * d`. Both products are exact in
float32 (an 11-bit float16 scale times a code of at most 8 bits), so the result is the value ggml's
dequantization gives. The helpers are shared with the 256-value types (`gguf_superblock_decoders`).
"""

from __future__ import annotations

import numpy as np

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]

# IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl): non-linear, so they are not codes of an
# affine map themselves; the level (plus 128, unsigned) is the code, and the scale stays affine.
IQ4_LEVELS = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16
)
IQ4_CODES = (IQ4_LEVELS + 128).astype(np.uint8)


def f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32 [blocks, 1]."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def nibbles(packed: np.ndarray) -> np.ndarray:
    """[.., 16j] bytes -> [.., 32j] codes: low nibbles first, then high nibbles (ggml's order)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def bit_planes(packed: np.ndarray, count: int) -> np.ndarray:
    """uint8 [blocks, bytes] -> [blocks, count, bytes]: plane j holds bit j of each byte."""
    return (packed[:, None, :] >> np.arange(count, dtype=np.uint8)[None, :, None]) & 1


def _q4_0(blocks: np.ndarray) -> Decoded:
    d = f16(blocks, 0)
    return nibbles(blocks[:, 2:18]), d, -8.0 * d


def _q4_1(blocks: np.ndarray) -> Decoded:
    return nibbles(blocks[:, 4:20]), f16(blocks, 0), f16(blocks, 2)


def _fifth_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5_0/Q5_1: the 32-bit little-endian mask at `start` -> bit i of value i, [blocks, 32]."""
    planes = bit_planes(blocks[:, start : start + 4], 8)  # [blocks, bit, byte]
    return planes.transpose(0, 2, 1).reshape(-1, 32)  # value 8 * byte + bit


def _q5_0(blocks: np.ndarray) -> Decoded:
    d = f16(blocks, 0)
    codes = nibbles(blocks[:, 6:22]) | (_fifth_bits(blocks, 2) << 4)
    return codes, d, -16.0 * d


def _q5_1(blocks: np.ndarray) -> Decoded:
    codes = nibbles(blocks[:, 8:24]) | (_fifth_bits(blocks, 4) << 4)
    return codes, f16(blocks, 0), f16(blocks, 2)


def _q8_0(blocks: np.ndarray) -> Decoded:
    d = f16(blocks, 0)
    # q + 128 for a two's-complement byte q is the byte with its top bit flipped: no int16 copy
    # (a 150k-token Q8_0 table is 136 M values, and this runs while the file's pages are resident).
    return blocks[:, 2:34] ^ np.uint8(0x80), d, -128.0 * d


def _iq4_nl(blocks: np.ndarray) -> Decoded:
    d = f16(blocks, 0)
    return IQ4_CODES[nibbles(blocks[:, 2:18])], d, -128.0 * d


# type -> decoder of uint8 [blocks, bytes per block] -> codes [blocks, 32], scale and offset [blocks, 1]
DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "IQ4_NL": _iq4_nl}
