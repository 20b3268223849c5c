"""GGUF block types decoded into one shape every kernel reads: integer codes with a scale and an
offset per group, `w = scale * code + offset`.

Each type below is read from ggml's block layout (block sizes, byte order and bit positions as
ggml-quants.c's dequantize_row_* lay them out); the result is exact: `scale * code + offset` is
the value ggml's dequantization gives, up to float32 rounding of the scale product.

| type | block | codes | group | scale, offset |
|---|---|---|---|---|
| Q4_0 | 32 values, 18 bytes | 4 bit | 32 | d, -8d |
| Q4_1 | 32, 20 | 4 bit | 32 | d, m |
| Q8_0 | 32, 34 | 8 bit (q + 128) | 32 | d, -128d |
| Q4_K | 256, 144 | 4 bit | 32 | d*sc, -dmin*m |
| Q5_K | 256, 176 | 5 bit (stored in 8) | 32 | d*sc, -dmin*m |
| Q6_K | 256, 210 | 6 bit (stored in 8) | 16 | d*sc, -32*d*sc |
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# type -> (values per block, bytes per block, code bits as stored for the kernels, group size)
BLOCK_TYPES = {
    "Q4_0": (32, 18, 4, 32),
    "Q4_1": (32, 20, 4, 32),
    "Q8_0": (32, 34, 8, 32),
    "Q4_K": (256, 144, 4, 32),
    "Q5_K": (256, 176, 8, 32),
    "Q6_K": (256, 210, 8, 16),
}


# Where each type keeps its float16 fields in a block (d, and dmin or m): its only floats, so a NaN
# or infinite weight can only come from them.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


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


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32 [blocks, 1]."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[.., 16j] bytes -> [.., 32j] codes: low nibbles first, then high nibbles (ggml's order)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 2:18]), d, -8.0 * d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    return _nibbles(blocks[:, 4:20]), _f16(blocks, 0), _f16(blocks, 2)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    d = _f16(blocks, 0)
    codes = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128.0 * d


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4)."""
    low, high = packed[:, 0:4], packed[:, 4:8]
    tail = packed[:, 8:12]
    scales = np.concatenate([low & 63, (tail & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([high & 63, (tail >> 4) | ((high >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales(blocks[:, 4:16])
    # Four runs of 32 bytes; each holds sub-block 2j in its low nibbles and 2j+1 in its high ones.
    codes = _nibbles(blocks[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 256)
    return codes, d * scales, -dmin * mins


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales(blocks[:, 4:16])
    high_bits = blocks[:, 16:48]  # bit j of byte l: the fifth bit of value l of sub-block j
    low = _nibbles(blocks[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    fifth = (high_bits[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    codes = (low | (fifth << 4)).reshape(-1, 256)
    return codes, d * scales, -dmin * mins


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    ql = blocks[:, 0:128].reshape(-1, 2, 64)  # per half of 128 values
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)  # one per 16 values
    d = _f16(blocks, 208)
    quarters = [
        (ql[:, :, 0:32] & 0x0F) | ((qh & 3) << 4),
        (ql[:, :, 32:64] & 0x0F) | (((qh >> 2) & 3) << 4),
        (ql[:, :, 0:32] >> 4) | (((qh >> 4) & 3) << 4),
        (ql[:, :, 32:64] >> 4) | (((qh >> 6) & 3) << 4),
    ]
    codes = np.stack(quarters, axis=2).reshape(-1, 256)  # [block, half, quarter, 32]
    step = d * scales
    return codes, step, -32.0 * step


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
