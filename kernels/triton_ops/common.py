"""Small helpers the Triton launch wrappers share."""

from __future__ import annotations

import torch

from kvasir.kernels.dispatch import interpreter_enabled

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Softmax runs in the log2 domain (exp2 is one instruction): the scale is premultiplied by log2(e).
LOG2E = 1.4426950408889634


def check_float_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {dtype}")


def gpu_tiles(t: torch.Tensor) -> bool:
    """Whether a launch picks the GPU's tile sizes: on CUDA. Triton's interpreter gets small tiles,
    so CPU tests iterate over several of them."""
    return t.is_cuda


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the attention kernels upcast their `tl.dot` operands to float32.

    float32 inputs always do (with IEEE precision, not TF32, so the result matches the reference).
    bfloat16 does in Triton's interpreter only: numpy has no bfloat16 and the interpreter's bf16 dot
    returns garbage, so CPU tests exercise the same kernel with exact operands. On a GPU, half types
    go to the tensor cores as they are.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreter_enabled())
