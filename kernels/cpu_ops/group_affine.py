"""The CPU launch wrapper of `group_affine_gemm.c`; see `kvasir.kernels.reference.group_affine`."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from kvasir.kernels.cpu_ops import Signatures, load_library
from kvasir.kernels.reference.group_affine import GroupAffineWeight

# Weights per thread below which a call runs on fewer threads: each parallel region ends in a
# barrier, and on a busy machine a thread that is descheduled stalls the others at it (with two
# threads on a shared 2-core machine, small GEMVs ran 10x slower than on one).
WEIGHTS_PER_THREAD = 1 << 18

# (bits, group) -> the C function compiled for it.
LAYOUTS = {
    (4, 32): "group_affine_gemm_4bit_g32",
    (8, 32): "group_affine_gemm_8bit_g32",
    (8, 16): "group_affine_gemm_8bit_g16",
}


_GEMM_ARGS = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]
SIGNATURES: Signatures = {
    **{function: (None, _GEMM_ARGS) for function in LAYOUTS.values()},
    "group_affine_max_rows": (ctypes.c_int, []),
}


def library() -> ctypes.CDLL | None:
    """`group_affine_gemm.c` compiled (None where it cannot be; the torch reference runs then)."""
    return load_library("group_affine_gemm", SIGNATURES)


def max_rows() -> int:
    """The most rows of x one call takes (0 where the kernels are not built)."""
    compiled = library()
    return 0 if compiled is None else int(compiled.group_affine_max_rows())


def supports(x: Tensor, weight: GroupAffineWeight) -> bool:
    """Whether the C kernel runs this call: float32 on CPU, a compiled layout, few enough rows."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and (weight.bits, weight.group) in LAYOUTS
        and 0 < rows <= max_rows()
    )


def group_affine_linear(x: Tensor, weight: GroupAffineWeight) -> Tensor:
    """`x [.., K] @ W.T -> [.., N]` for float32 CPU tensors with at most `max_rows()` rows."""
    compiled = library()
    if compiled is None or not supports(x, weight):
        raise ValueError("the CPU group-affine kernel does not take this call (see `supports`)")
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
    flat = x.reshape(-1, k).contiguous()
    rows = flat.shape[0]
    sums = flat.view(rows, k // weight.group, weight.group).sum(dim=-1)
    out = torch.empty((rows, n), dtype=torch.float32)
    getattr(compiled, LAYOUTS[(weight.bits, weight.group)])(
        flat.data_ptr(),
        sums.data_ptr(),
        weight.codes.data_ptr(),
        weight.scale.data_ptr(),
        weight.offset.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        k,
        max(1, min(torch.get_num_threads(), n * k // WEIGHTS_PER_THREAD)),
    )
    return out.view(*x.shape[:-1], n)
