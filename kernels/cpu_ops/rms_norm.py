"""The CPU launch wrapper of `rms_norm.c`; see `kvasir.kernels.reference.norm` for the contract."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from kvasir.kernels.cpu_ops import Signatures, load_library

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
SIGNATURES: Signatures = {"rms_norm": (None, [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, ctypes.c_float])}


def library() -> ctypes.CDLL | None:
    """`rms_norm.c` compiled (None where it cannot be; the torch reference runs then)."""
    return load_library("rms_norm", SIGNATURES)


def supports(x: Tensor, weight: Tensor) -> bool:
    """Whether the C kernel takes the call: float32 on CPU with a float32 weight of x's last size."""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.dim() == 1
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[0]
        and weight.is_contiguous()
        and library() is not None
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * (x / sqrt(mean(x^2) + eps))` over the last dimension of `x` [..., D]."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Normalise `x + residual`; returns (the normalised sum, the sum itself: the new residual)."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x ({x.dtype} {list(x.shape)}), got {residual.dtype} {list(residual.shape)}"
        )
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor | None]:
    if not supports(x, weight):
        raise ValueError("the CPU RMSNorm kernel does not take this call (see `supports`)")
    return launch(x, residual, weight, eps)


def launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor | None]:
    """`rms_norm` / `fused_add_rms_norm` without their checks, for a caller that has checked
    `supports` and the residual's shape and dtype (the dispatcher: one check per call, not two)."""
    compiled = library()
    assert compiled is not None  # `supports` said so
    dim = x.shape[-1]
    rows = _rows(x, dim)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is None:
        compiled.rms_norm(
            rows.data_ptr(),
            rows.stride(0),
            None,
            0,
            weight.data_ptr(),
            out.data_ptr(),
            None,
            rows.shape[0],
            dim,
            eps,
        )
        return out, None
    residual_rows = _rows(residual, dim)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    compiled.rms_norm(
        rows.data_ptr(),
        rows.stride(0),
        residual_rows.data_ptr(),
        residual_rows.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        summed.data_ptr(),
        rows.shape[0],
        dim,
        eps,
    )
    return out, summed


def _rows(x: Tensor, dim: int) -> Tensor:
    """x as [rows, dim] with unit stride along dim (a view where possible; the model's are 2-D)."""
    rows = x if x.dim() == 2 else x.reshape(-1, dim)
    return rows if rows.stride(1) == 1 or dim == 1 else rows.contiguous()
