"""GGUF block encoders for tests: gguf-py quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 but not the K-quants
nor IQ4_NL/IQ4_XS.

`encode(values, qtype)` -> the raw blocks [.., bytes per row] of `values` [.., row] in `qtype`.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

Q = GGMLQuantizationType


# Each follows ggml's block layout (ggml-quants.c dequantize_row_q*_K) with a plain min/max fit.


def _f16(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _affine(sub: np.ndarray, levels: int, scale_bits: int) -> tuple[np.ndarray, ...]:
    """x ~ d*sc*q - dmin*m per sub-block, q in [0, levels], sc and m on `scale_bits` bits."""
    low = np.minimum(sub.min(axis=-1), 0.0)
    step = (sub.max(axis=-1) - low) / levels
    top = (1 << scale_bits) - 1
    d = (step.max(axis=-1, keepdims=True) / top).astype(np.float16).astype(np.float32)
    dmin = ((-low).max(axis=-1, keepdims=True) / top).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_div(step, d)), 0, top).astype(np.uint8)
    m = np.clip(np.round(_div(-low, dmin)), 0, top).astype(np.uint8)
    q = np.round(_div(sub + (dmin * m)[..., None], (d * sc)[..., None]))
    return d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def _k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 8, 32), 15, 6)
    pairs = q.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16(d), _f16(dmin), _k4_scales(sc, m), qs], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 8, 32), 31, 6)
    low = (q & 0xF).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):  # sub-block j keeps its fifth bit in bit j of qh
        qh |= (q[:, j] >> 4) << j
    return np.concatenate([_f16(d), _f16(dmin), _k4_scales(sc, m), qh, qs], axis=1)


def _q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 16, 16), 3, 4)
    codes = q.reshape(-1, 2, 4, 32)  # [half, shift, position]
    qs = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for j in range(4):
        qs |= codes[:, :, j] << (2 * j)
    return np.concatenate([sc | (m << 4), qs.reshape(-1, 64), _f16(d), _f16(dmin)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=-1) / 31
    d = (step.max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_div(step, d)), -128, 127).astype(np.int8)
    q = np.clip(np.round(_div(sub, (d * sc)[..., None])), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [half, quarter, position]
    low, high = q & 0xF, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d)], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=-1) / 4
    d = (step.max(axis=-1, keepdims=True) / 31).astype(np.float16).astype(np.float32)
    s = np.clip(np.round(_div(step, d)), 0, 31).astype(np.uint8)
    q = (np.clip(np.round(_div(sub, (d * s)[..., None])), -4, 3) + 4).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [half, shift, position]
    qs = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    hmask = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for half in range(2):
        for j in range(4):
            qs[:, half] |= (q[:, half, j] & 3) << (2 * j)
            hmask |= (q[:, half, j] >> 2) << (4 * half + j)
    s = s + 32  # stored biased by 32, six bits each, split 4 + 2
    scales = np.zeros((q.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (s[:, 0:4] & 0xF) | ((s[:, 8:12] & 0xF) << 4)
    scales[:, 4:8] = (s[:, 4:8] & 0xF) | ((s[:, 12:16] & 0xF) << 4)
    scales[:, 8:12] = (
        (s[:, 0:4] >> 4) | ((s[:, 4:8] >> 4) << 2) | ((s[:, 8:12] >> 4) << 4) | ((s[:, 12:16] >> 4) << 6)
    )
    return np.concatenate([hmask, qs.reshape(-1, 64), scales, _f16(d)], axis=1)


# ggml's kvalues_iq4nl: the 16 levels IQ4_NL and IQ4_XS index.
_IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _iq4_indices(sub: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The nearest level's index for each value of `sub` [.., 32] at `step` [..] per run of 32,
    packed as ggml does: value i in the low nibble of byte i, value 16 + i in its high nibble."""
    target = _div(sub, np.broadcast_to(step[..., None], sub.shape))
    idx = np.abs(target[..., None] - _IQ4_LEVELS).argmin(axis=-1).astype(np.uint8)
    return idx[..., :16] | (idx[..., 16:] << 4)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 32)
    d = (np.abs(sub).max(axis=-1) / 127).astype(np.float16).astype(np.float32)
    return np.concatenate([_f16(d), _iq4_indices(sub, d)], axis=1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 8, 32)
    step = np.abs(sub).max(axis=-1) / 127
    d = (step.max(axis=-1, keepdims=True) / 31).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_div(step, d)), -32, 31).astype(np.int16) + 32  # stored biased by 32
    qs = _iq4_indices(sub, d * (sc - 32)).reshape(-1, 128)
    low = (sc & 0xF).astype(np.uint8).reshape(-1, 4, 2)
    high = sum(((sc[:, j] >> 4) & 3).astype(np.uint16) << (2 * j) for j in range(8))
    scales_h = np.asarray(high, dtype=np.uint16).reshape(-1, 1).view(np.uint8)
    return np.concatenate([_f16(d), scales_h, low[:, :, 0] | (low[:, :, 1] << 4), qs], axis=1)


_K_QUANTIZERS = {
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs,
}  # fmt: skip


def encode(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype in _K_QUANTIZERS:
        rows = values.reshape(-1, values.shape[-1])
        return _K_QUANTIZERS[qtype](rows).reshape(*values.shape[:-1], -1)
    return quantize(values, qtype)
