"""GEMM over group-affine quantized weights (GGUF blocks repacked at load), dispatched three ways.

On CUDA (or `KVASIR_KERNELS=triton`) the Triton kernel reads the row-major packed weight. On a CPU
with a C compiler the weight is tiled once at load (`cpu_ops.group_affine_layout`) and every
float32 call runs the C kernel, decode steps and prompts alike (so a token's arithmetic does not
depend on what it is batched with), in one of three arithmetics: x rounded per block of 32 values
to 16 bits (two int8 limbs) or to int8 (as llama.cpp does) and integer dot products, or float32
activations (the dequantized weight's GEMM up to the order of the sums). A decode step is bound by
reading the weights, which the C kernel reads packed; a prompt chunk is bound by arithmetic, where
the integer dot products beat dequantizing the weight for a dense GEMM (measured 8-20x on a
3072 x 576 weight at 64 and 256 rows). Otherwise (other dtypes, no C compiler) the torch
reference dequantizes the weight and runs one dense GEMM."""

from __future__ import annotations

import torch
from torch import Tensor

from kvasir.kernels.cpu_ops import group_affine as cpu
from kvasir.kernels.cpu_ops.group_affine_layout import TiledWeight, untile
from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.reference import group_affine as reference
from kvasir.kernels.reference.group_affine import GroupAffineWeight


def group_affine_linear(x: Tensor, weight: GroupAffineWeight) -> Tensor:
    """`x [.., K] @ W.T -> [.., N]` in x's dtype, float activations."""
    if use_triton(x.device):
        from kvasir.kernels.triton_ops.group_affine import group_affine_linear as impl
    else:
        impl = reference.group_affine_linear
    return impl(x, weight)


def tiles_on(device: torch.device, bits: int, group: int) -> bool:
    """Whether a weight on `device` is tiled for the C kernel (a CPU with the kernel built)."""
    return device.type == "cpu" and not use_triton(device) and cpu.takes_layout(bits, group)


class TiledLinear:
    """`x [.., K] @ W.T -> [.., N]` with a tiled weight: the C kernel for float32 x (activations
    rounded to `activation_bits`, 0 for float), the float reference for other dtypes."""

    def __init__(self, weight: TiledWeight, activation_bits: int) -> None:
        self.weight = weight
        self.gemm = cpu.TiledGemm(weight, activation_bits)

    def __call__(self, x: Tensor) -> Tensor:
        if self.gemm.accepts(x):
            return self.gemm.run(x)
        return reference.group_affine_linear(x, untile(self.weight))

    def wide(self, x: Tensor) -> Tensor:
        """The product in float64, summed over the groups in float64 (`TiledGemm.run_wide`; the
        reference computes it in float64 throughout)."""
        if self.gemm.accepts(x):
            return self.gemm.run_wide(x)
        return reference.group_affine_linear(x.double(), untile(self.weight))


def describe_backend(device_type: str, bits: int, group: int, activation_bits: int) -> str:
    """Which implementation decode steps on `device_type` run, for the startup log."""
    device = torch.device(device_type)
    if use_triton(device):
        return "Triton"
    if tiles_on(device, bits, group):
        if not activation_bits:
            return "C kernel, float32 activations"
        return f"C kernel, int{activation_bits} activations, {cpu.kernel_isa()}"
    return "torch reference"
