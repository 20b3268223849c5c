"""The one form every 4-bit checkpoint format is read into: codes, scales and zero points per group.

A weight `W` [out_features, in_features] is stored as 4-bit codes `q` (0..15) with, for each output
row and each group of `group_size` consecutive input columns, a scale `s` and a zero point `z`:

    W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]          g(k) = k // group_size

AWQ and GPTQ differ only in how they pack `q` and `z` into int32 words and, for GPTQ with
act-order, in the order of the input columns: `input_perm` then says which input feature each
column of `codes` holds (a kernel reads `x[:, input_perm]`), so that every group stays a run of
`group_size` consecutive columns, which is what the kernels index. `awq.py` and `gptq.py` turn the
checkpoints' tensors into this form; the kernels repack it once, at load, into the layout they read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvasir.kernels.int4_packing import PACK


@dataclass(frozen=True)
class Int4Weight:
    """A group-quantized 4-bit weight, unpacked: one uint8 per code (a load-time form, not a resident one)."""

    codes: Tensor  # uint8 [out_features, in_features], values 0..15
    scales: Tensor  # float [out_features, num_groups]
    zeros: Tensor  # uint8 [out_features, num_groups]: 0..15 (16 in GPTQ's original format, see gptq.py)
    group_size: int
    # int64 [in_features]: column k of `codes` multiplies input feature input_perm[k]; None = identity.
    input_perm: Tensor | None = None

    def __post_init__(self) -> None:
        out_features, in_features = self.codes.shape
        num_groups = -(-in_features // self.group_size)
        if self.codes.dtype != torch.uint8:
            raise ValueError(f"codes must be uint8, got {self.codes.dtype}")
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if tuple(t.shape) != (out_features, num_groups):
                raise ValueError(
                    f"{name} must be [{out_features}, {num_groups}] for {in_features} inputs in groups "
                    f"of {self.group_size}, got {list(t.shape)}"
                )
        if self.zeros.dtype != torch.uint8:
            raise ValueError(f"zeros must be uint8, got {self.zeros.dtype}")
        if self.input_perm is not None and tuple(self.input_perm.shape) != (in_features,):
            raise ValueError(f"input_perm must be [{in_features}], got {list(self.input_perm.shape)}")

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[1])

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """W [out_features, in_features] in the checkpoint's input order (the permutation undone)."""
        groups = torch.arange(self.in_features, device=self.codes.device) // self.group_size
        scales = self.scales.float()[:, groups]
        zeros = self.zeros.float()[:, groups]
        w = (self.codes.float() - zeros) * scales
        if self.input_perm is not None:
            unpermuted = torch.empty_like(w)
            unpermuted[:, self.input_perm] = w
            w = unpermuted
        return w.to(dtype)


def stack_outputs(parts: list[Int4Weight]) -> Int4Weight:
    """Stack layers that read the same input (q/k/v, gate/up) along their outputs."""
    first = parts[0]
    for part in parts[1:]:
        if part.group_size != first.group_size or part.in_features != first.in_features:
            raise ValueError("stacked projections must share in_features and group_size")
        if (part.input_perm is None) != (first.input_perm is None) or (
            part.input_perm is not None
            and first.input_perm is not None
            and not torch.equal(part.input_perm, first.input_perm)
        ):
            raise ValueError(
                "stacked projections must share their input order (GPTQ act-order g_idx must be equal)"
            )
    return Int4Weight(
        codes=torch.cat([p.codes for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        zeros=torch.cat([p.zeros for p in parts]),
        group_size=first.group_size,
        input_perm=first.input_perm,
    )


def check_group_tensors(
    qweight: Tensor, qzeros: Tensor, scales: Tensor, *, num_groups: int, out_features: int, group_size: int
) -> None:
    """AWQ's and GPTQ's per-group tensors: zero points packed eight to an int32 along the outputs,
    finite floating-point scales, one row of each per group; a mismatch names the tensor and both
    shapes. (A NaN scale would load and make every output it touches NaN; FP8's are checked too.)"""
    expected = {"qzeros": (num_groups, out_features // PACK), "scales": (num_groups, out_features)}
    for name, tensor in (("qzeros", qzeros), ("scales", scales)):
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"{name} must be {list(expected[name])} for qweight {list(qweight.shape)} in groups of "
                f"{group_size}, got {list(tensor.shape)}"
            )
    if not scales.is_floating_point():
        raise ValueError(f"scales must be floating point, got {scales.dtype}")
    finite = torch.isfinite(scales)
    if not bool(finite.all()):
        group, column = (int(i) for i in torch.nonzero(~finite)[0])
        raise ValueError(
            f"scales hold a NaN or infinite value (group {group}, output {column}): the checkpoint is corrupt"
        )
