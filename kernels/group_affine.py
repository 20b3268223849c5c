"""GEMM over group-affine quantized weights (GGUF blocks repacked at load), dispatched three ways.

On CUDA (or `KVASIR_KERNELS=triton`) the Triton kernel; on CPU the C kernel for float32 decode
batches (`kvasir.kernels.cpu_ops`, up to 64 rows), since a decode step is bound by reading
the weights and the C kernel reads them packed; otherwise (prefill chunks, other dtypes, no C
compiler) the torch reference, which dequantizes the weight and runs one dense GEMM (a prefill
step is bound by arithmetic, so the dequantization is a small share of it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvasir.kernels.cpu_ops import group_affine as cpu
from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.reference import group_affine as reference
from kvasir.kernels.reference.group_affine import GroupAffineWeight


def group_affine_linear(x: Tensor, weight: GroupAffineWeight) -> Tensor:
    """`x [.., K] @ W.T -> [.., N]` in x's dtype."""
    if use_triton(x.device):
        from kvasir.kernels.triton_ops.group_affine import group_affine_linear as impl
    elif cpu.supports(x, weight):
        impl = cpu.group_affine_linear
    else:
        impl = reference.group_affine_linear
    return impl(x, weight)


def describe_backend(weight: GroupAffineWeight, device_type: str) -> str:
    """Which implementation decode steps on `device_type` run, for the startup log."""
    if use_triton(torch.device(device_type)):
        return "Triton"
    if cpu.max_rows() and (weight.bits, weight.group) in cpu.LAYOUTS:
        return "C kernel (torch reference for prefill)"
    return "torch reference"
