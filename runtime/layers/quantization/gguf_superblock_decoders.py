"""Decoders of GGUF's 256-value super-block types (the K-quants Q2_K..Q6_K, and IQ4_XS) into
group-affine codes: `(codes [blocks, 256], scale and offset [blocks, 256 / group])`.

Each reads ggml's block layout (ggml-quants.c's dequantize_row_*) with its sub-block scales: the
group's scale is the product of the float16 super-block scale and the small integer sub-block
scale, exact in float32 (at most 11 + 8 bits), and its product with a code stays within float32's
24 bits, so `scale * code + offset` is ggml's value. Signed codes get an unsigned bias whose cost
moves into the offset, as in `gguf_block_decoders`.
"""

from __future__ import annotations

import numpy as np

from kvasir.runtime.layers.quantization.gguf_block_decoders import (
    IQ4_CODES,
    Decoded,
    bit_planes,
    f16,
    nibbles,
)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4)."""
    low, high = packed[:, 0:4], packed[:, 4:8]
    tail = packed[:, 8:12]
    scales = np.concatenate([low & 63, (tail & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([high & 63, (tail >> 4) | ((high >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _crumbs(packed: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K: [blocks, 64] bytes -> [blocks, 256] 2-bit codes. Each half of 128 values reads 32
    bytes four times, two bits further each time (bits 0-1 give values 0-31, bits 2-3 32-63, ...)."""
    halves = packed.reshape(-1, 2, 1, 32)
    return ((halves >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3).reshape(-1, 256)


def _q2_k(blocks: np.ndarray) -> Decoded:
    scales, d, dmin = blocks[:, 0:16], f16(blocks, 80), f16(blocks, 82)  # one scale byte per 16 values
    codes = _crumbs(blocks[:, 16:80])
    return codes, d * (scales & 0x0F).astype(np.float32), -dmin * (scales >> 4).astype(np.float32)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K: 12 bytes -> sixteen signed 6-bit scales: the low four bits are the nibbles of bytes 0-7
    (all low nibbles, then all high ones), the top two come two bits at a time from bytes 8-11."""
    low = nibbles(packed[:, 0:8])
    high = ((packed[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]) & 3).reshape(
        -1, 16
    )
    return (low | (high << 4)).astype(np.float32) - 32.0


def _q3_k(blocks: np.ndarray) -> Decoded:
    # Value i of a half h, 32-run s: two low bits from the crumbs; its third bit is bit 4h + s of
    # hmask byte i % 32, and ggml subtracts 4 where that bit is clear: code = low + 4 * bit, minus 4.
    high = bit_planes(blocks[:, 0:32], 8).reshape(-1, 256)
    codes = _crumbs(blocks[:, 32:96]) | (high << 2)
    step = f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108])
    return codes, step, -4.0 * step


def _q4_k(blocks: np.ndarray) -> Decoded:
    d, dmin = f16(blocks, 0), f16(blocks, 2)
    scales, mins = _k_scales(blocks[:, 4:16])
    # Four runs of 32 bytes; each holds sub-block 2j in its low nibbles and 2j+1 in its high ones.
    codes = nibbles(blocks[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 256)
    return codes, d * scales, -dmin * mins


def _q5_k(blocks: np.ndarray) -> Decoded:
    d, dmin = f16(blocks, 0), f16(blocks, 2)
    scales, mins = _k_scales(blocks[:, 4:16])
    fifth = bit_planes(blocks[:, 16:48], 8)  # bit j of byte l: the fifth bit of value l of sub-block j
    low = nibbles(blocks[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    codes = (low | (fifth << 4)).reshape(-1, 256)
    return codes, d * scales, -dmin * mins


def _q6_k(blocks: np.ndarray) -> Decoded:
    ql = blocks[:, 0:128].reshape(-1, 2, 64)  # per half of 128 values
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)  # one per 16 values
    d = f16(blocks, 208)
    quarters = [
        (ql[:, :, 0:32] & 0x0F) | ((qh & 3) << 4),
        (ql[:, :, 32:64] & 0x0F) | (((qh >> 2) & 3) << 4),
        (ql[:, :, 0:32] >> 4) | (((qh >> 4) & 3) << 4),
        (ql[:, :, 32:64] >> 4) | (((qh >> 6) & 3) << 4),
    ]
    codes = np.stack(quarters, axis=2).reshape(-1, 256)  # [block, half, quarter, 32]
    step = d * scales
    return codes, step, -32.0 * step


def _iq4_xs(blocks: np.ndarray) -> Decoded:
    # d, then the eight 6-bit signed sub-block scales (low nibbles in bytes 4-7, two high bits each
    # in the 16-bit word at byte 2), then 32 bytes of level indices per two sub-blocks.
    high_word = blocks[:, 2:4].copy().view(np.uint16)
    high = ((high_word >> np.arange(0, 16, 2, dtype=np.uint16)[None, :]) & 3).astype(np.uint8)
    low = np.stack([blocks[:, 4:8] & 0x0F, blocks[:, 4:8] >> 4], axis=2).reshape(-1, 8)
    step = f16(blocks, 0) * ((low | (high << 4)).astype(np.float32) - 32.0)
    codes = IQ4_CODES[nibbles(blocks[:, 8:136].reshape(-1, 8, 16)).reshape(-1, 256)]
    return codes, step, -128.0 * step


# type -> decoder of uint8 [blocks, bytes per block]
DECODERS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_XS": _iq4_xs}
