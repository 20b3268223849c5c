"""The CPU launch wrapper of `group_affine_gemm.c` (weights in `group_affine_layout`'s tiles).

`tiled_linear(x, weight, activation_bits)` runs one of three arithmetics (see the C file): x
rounded to 8 or 16 bits per block of 32 (the twin is
`kvasir.kernels.reference.group_affine.group_affine_linear_int`) or float activations, 0 bits
(the twin is `group_affine_linear`, the dequantized weight's GEMM).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from kvasir.kernels.cpu_ops import Signatures, load_library
from kvasir.kernels.cpu_ops.group_affine_layout import TiledWeight

# Weights per thread below which a call runs on fewer threads: each parallel region ends in a
# barrier, and on a busy machine a thread that is descheduled stalls the others at it (with two
# threads on a shared 2-core machine, small GEMVs ran 10x slower than on one).
WEIGHTS_PER_THREAD = 1 << 18

# (bits, group) the C kernel takes.
LAYOUTS = ((4, 32), (8, 32), (8, 16))
# Integer activations share one step per block of this many inputs.
ACTIVATION_BLOCK = 32
# 0: float32 activations; 8 or 16: rounded to that many bits per block.
ACTIVATION_BITS = (0, 8, 16)

_GEMM_ARGS = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
SIGNATURES: Signatures = {
    "group_affine_tiled_gemm": (ctypes.c_int, _GEMM_ARGS),
    "group_affine_tiled_gemm_portable": (ctypes.c_int, _GEMM_ARGS),
    "group_affine_max_rows": (ctypes.c_int, []),
    "group_affine_vectorized": (ctypes.c_int, []),
}


def library() -> ctypes.CDLL | None:
    """`group_affine_gemm.c` compiled (None where it cannot be; the torch reference runs then)."""
    return load_library("group_affine_gemm", SIGNATURES)


def max_rows() -> int:
    """The most rows of x one call takes (0 where the kernels are not built)."""
    compiled = library()
    return 0 if compiled is None else int(compiled.group_affine_max_rows())


def takes_layout(bits: int, group: int) -> bool:
    return (bits, group) in LAYOUTS and library() is not None


def supports(x: Tensor, weight: TiledWeight, activation_bits: int) -> bool:
    """Whether the C kernel runs this call: float32 on CPU, few enough rows, whole blocks of 32
    for integer activations."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and 0 < rows <= max_rows()
        and activation_bits in ACTIVATION_BITS
        and (activation_bits == 0 or weight.in_features % ACTIVATION_BLOCK == 0)
    )


def tiled_linear(x: Tensor, weight: TiledWeight, activation_bits: int, *, portable: bool = False) -> Tensor:
    """`x [.., K] @ W.T -> [.., N]` for float32 CPU tensors with at most `max_rows()` rows;
    `portable` runs the plain C loops instead of the vector kernels (tests)."""
    compiled = library()
    if compiled is None or not supports(x, weight, activation_bits):
        raise ValueError("the CPU group-affine kernel does not take this call (see `supports`)")
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
    flat = x.reshape(-1, k).contiguous()
    rows = flat.shape[0]
    out = torch.empty((rows, n), dtype=torch.float32)
    function = compiled.group_affine_tiled_gemm_portable if portable else compiled.group_affine_tiled_gemm
    status = function(
        weight.bits,
        weight.group,
        activation_bits,
        flat.data_ptr(),
        weight.codes.data_ptr(),
        weight.scale.data_ptr(),
        weight.offset.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        k,
        max(1, min(torch.get_num_threads(), n * k // WEIGHTS_PER_THREAD)),
    )
    if status == -2:
        raise MemoryError("the CPU group-affine kernel could not allocate its activation buffers")
    if status != 0:
        raise ValueError(
            f"the CPU group-affine kernel refused {weight.bits}-bit codes in groups of {weight.group}"
        )
    return out.view(*x.shape[:-1], n)
