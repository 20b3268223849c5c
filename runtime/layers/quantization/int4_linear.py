"""4-bit checkpoint weights (AWQ, GPTQ) as the loader hands them over, and the kernels they run with.

`Int4CheckpointWeight` is the `QuantizedWeight` both formats share: the checkpoint's own tensors,
kept as stored until the layer builds its kernel; each format says how to read them into an
`Int4Weight` (`to_int4`).

`build_int4_linear` repacks an `Int4Weight` once, for the device the model runs on:

- CUDA (or `KVASIR_KERNELS=triton`): Kvasir's Triton dequant-GEMM, `kvasir.kernels.int4_matmul`;
- CPU: torch's packed int4 kernel (`aten._weight_int4pack_mm_for_cpu`), bfloat16 inside;
- anything those cannot tile (groups under 32 on CPU, under 16 or in_features not a multiple of 8
  for Triton): the weight dequantized once into a dense GEMM, said so in `describe()` (and so in the
  startup log and `/metrics`).

A GPTQ act-order weight carries `input_perm`: its kernels read `x[:, input_perm]` (one gather of the
activations per call) so that the weight's groups stay runs of `group_size` columns.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.int4_matmul import (
    cpu_group_size,
    int4_matmul,
    int4_matmul_cpu,
    pack_for_cpu,
    pack_for_kernels,
)
from kvasir.kernels.triton_ops.common import FLOAT_DTYPES
from kvasir.runtime.layers.quantization.int4 import Int4Weight, stack_outputs
from kvasir.runtime.layers.quantization.weights import DenseLinear, LinearKernel, QuantizedWeight

MIN_TRITON_GROUP = 16


class Int4CheckpointWeight(QuantizedWeight):
    """One AWQ or GPTQ linear weight: its checkpoint tensors (`tensors`), read on demand."""

    def __init__(self, tensors: dict[str, Tensor], group_size: int) -> None:
        self.tensors = tensors
        self.group_size = group_size

    @abstractmethod
    def to_int4(self, device: torch.device | None = None) -> Int4Weight:
        """The weight unpacked (on `device`: unpacking on a GPU takes moments, on a CPU seconds)."""

    def tensors_on(self, device: torch.device | None) -> dict[str, Tensor]:
        return {name: tensor.to(device) for name, tensor in self.tensors.items()}

    @property
    def scheme(self) -> str:
        return f"int4 g{self.group_size}"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.to_int4().dequantize(dtype)

    @property
    def merge_key(self) -> Hashable:
        return (self.method, self.scheme)

    @classmethod
    def build_linear(
        cls, parts: Sequence[QuantizedWeight], device: torch.device, dtype: torch.dtype
    ) -> LinearKernel:
        weights = [part.to_int4(device) for part in parts if isinstance(part, Int4CheckpointWeight)]
        if len(weights) != len(parts):
            raise TypeError(f"{cls.__name__}.build_linear got parts of other formats")
        label = f"{cls.method} {parts[0].scheme}"
        return build_int4_linear(stack_outputs(weights), label, device, dtype)


def build_int4_linear(
    weight: Int4Weight, label: str, device: torch.device, dtype: torch.dtype
) -> LinearKernel:
    """The kernel `weight` runs with on `device` (activations in `dtype`); `label` names the format
    (`awq int4 g128`) for `describe()`."""
    weight = _on(weight, device)
    triton_fits = weight.group_size % MIN_TRITON_GROUP == 0 and weight.in_features % 8 == 0
    if use_triton(device) and triton_fits and dtype in FLOAT_DTYPES:
        return Int4TritonLinear(weight, label, dtype)
    cpu_fits = cpu_group_size(weight.group_size) is not None and weight.in_features % weight.group_size == 0
    if device.type == "cpu" and cpu_fits:
        return Int4CpuLinear(weight, label)
    reason = (
        "no int4 kernel for this group size or shape"
        if device.type == "cpu" or triton_fits
        else "Triton is off"
    )
    return DenseLinear(weight.dequantize(dtype), f"{label} (dequantized to {_name(dtype)} at load: {reason})")


class _Int4Linear(LinearKernel):
    """What both int4 kernels share: 2-D rows in the weight's input order (act-order's gather)."""

    input_perm: Tensor | None

    def __init__(self, weight: Int4Weight, label: str) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.register_buffer("input_perm", weight.input_perm)
        self._label = label

    @abstractmethod
    def matmul(self, rows: Tensor) -> Tensor:
        """rows [T, in] (already in the weight's input order) -> [T, out]."""

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.input_perm is not None:
            rows = rows.index_select(1, self.input_perm)
        return self.matmul(rows).reshape(*x.shape[:-1], self.out_features)


class Int4TritonLinear(_Int4Linear):
    """x @ W.T through the Triton int4 kernels; the weight stays 4-bit in memory."""

    qweight: Tensor
    scales: Tensor
    zeros: Tensor

    def __init__(self, weight: Int4Weight, label: str, dtype: torch.dtype) -> None:
        super().__init__(weight, label)
        self.group_size = weight.group_size
        qweight, scales, zeros = pack_for_kernels(weight.codes, weight.scales, weight.zeros, dtype)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)

    def matmul(self, rows: Tensor) -> Tensor:
        return int4_matmul(rows.contiguous(), self.qweight, self.scales, self.zeros, self.group_size)

    def describe(self) -> str:
        return f"{self._label} (Triton int4 GEMM)"


class Int4CpuLinear(_Int4Linear):
    """x @ W.T through torch's packed CPU int4 kernel (bfloat16 activations inside)."""

    packed: Tensor
    scale_and_zero: Tensor

    def __init__(self, weight: Int4Weight, label: str) -> None:
        super().__init__(weight, label)
        packed, scale_and_zero, group_size = pack_for_cpu(
            weight.codes, weight.scales, weight.zeros, weight.group_size
        )
        self.kernel_group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_zero", scale_and_zero)

    def matmul(self, rows: Tensor) -> Tensor:
        return int4_matmul_cpu(rows, self.packed, self.scale_and_zero, self.kernel_group_size)

    def describe(self) -> str:
        return f"{self._label} (torch int4 packed, cpu)"


def _on(weight: Int4Weight, device: torch.device) -> Int4Weight:
    return Int4Weight(
        codes=weight.codes.to(device),
        scales=weight.scales.to(device),
        zeros=weight.zeros.to(device),
        group_size=weight.group_size,
        input_perm=None if weight.input_perm is None else weight.input_perm.to(device),
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
