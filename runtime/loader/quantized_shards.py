"""A rank's slice of a quantized projection's stored tensors (AWQ, GPTQ, FP8), from its logical one.

The model names the slice of each weight in logical [out, in] coordinates (`TensorShard`); a
quantized checkpoint stores a projection as several tensors laid out differently, so each
component is cut where it holds those rows or columns, and stays packed:

| format | component | stored as | column-parallel (out rows) | row-parallel (in columns) |
|---|---|---|---|---|
| AWQ | qweight | [in, out/8] | dim 1, /8 | dim 0 |
| AWQ | qzeros | [in/g, out/8] | dim 1, /8 | dim 0, /g |
| AWQ, GPTQ | scales | [in/g, out] | dim 1 | dim 0, /g |
| GPTQ | qweight | [in/8, out] | dim 1 | dim 0, /8 |
| GPTQ | qzeros | [in/g, out/8] | dim 1, /8 | dim 0, /g |
| GPTQ | g_idx | [in] | whole | dim 0, group indices shifted to the rank's first group |
| FP8 | weight | [out, in] | dim 0 | dim 1 |
| FP8 | weight_scale | [out, 1] or one value | dim 0 (per channel) | whole |
| FP8 | input_scale | one value | whole | whole |

A split that would cut an int32 word of eight 4-bit values, or a quantization group, cannot be
kept packed: it is refused (ModelLoadError) naming the tensor and the sizes, with the advice to
choose a size that divides them. With group size -1 (one group over all inputs) the scales and
zero points are held whole. GPTQ act-order (`desc_act`) scatters a rank's inputs over every group,
so its row-parallel layers are refused at a size above 1.
"""

from __future__ import annotations

import torch

from kvasir.kernels.int4_packing import PACK
from kvasir.runtime.parallel.partition import TensorShard

# The stored tensors each format splits a projection into (`P.<suffix>`); any other tensor is
# stored as itself and sliced as its own name says.
COMPONENTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "fp8": ("weight", "weight_scale", "input_scale"),
}


def component_shard(
    method: str, suffix: str, logical: TensorShard, group_size: int, stored_shape: tuple[int, ...]
) -> TensorShard | None:
    """The slice of the stored component `suffix` that holds `logical`; None: read it whole.
    ValueError when the split cuts a packed word or a quantization group."""
    s, e = logical.start, logical.stop
    if method == "fp8":
        if suffix == "weight":
            return logical
        per_channel = suffix == "weight_scale" and len(stored_shape) >= 1 and stored_shape[0] > 1
        return TensorShard(0, s, e) if per_channel and logical.dim == 0 else None
    if logical.dim == 0:  # output rows: the stored columns
        if suffix == "g_idx":
            return None
        if suffix == "qzeros" or (method == "awq" and suffix == "qweight"):
            return TensorShard(1, *_divided(s, e, PACK, "an int32 word of 8 packed values"))
        return TensorShard(1, s, e)
    # input columns: the stored rows
    if suffix == "g_idx" or (method == "awq" and suffix == "qweight"):
        return TensorShard(0, s, e)
    if suffix == "qweight":  # GPTQ packs 8 inputs per int32
        return TensorShard(0, *_divided(s, e, PACK, "an int32 word of 8 packed values"))
    if group_size == -1:
        return None  # one group over all inputs: every rank reads the same scales and zeros
    return TensorShard(0, *_divided(s, e, group_size, f"a quantization group of {group_size} inputs"))


def localize_g_idx(
    g_idx: torch.Tensor, logical: TensorShard, group_size: int, desc_act: bool
) -> torch.Tensor:
    """GPTQ's group index of each of a row-parallel rank's inputs, counted from its first group."""
    if logical.dim == 0:
        return g_idx
    if desc_act:
        raise ValueError(
            "GPTQ act-order (desc_act) spreads each rank's inputs over every group: its row-parallel "
            "layers cannot be split; serve it with --tensor-parallel-size 1"
        )
    first = logical.start // group_size if group_size > 0 else 0
    return g_idx - first


def _divided(start: int, stop: int, unit: int, what: str) -> tuple[int, int]:
    if start % unit or stop % unit:
        raise ValueError(
            f"this rank's slice [{start}, {stop}) would cut {what}; choose a "
            "--tensor-parallel-size that divides the layer into whole ones"
        )
    return start // unit, stop // unit
