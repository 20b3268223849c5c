"""Triton `silu(gate) * up`; see `kvasir.kernels.reference.activation`.

A 2-D grid: rows (tokens) on axis 0, which allows 2**31 of them, blocks of `BLOCK` columns on axis 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvasir.kernels.checks import check_same_device
from kvasir.kernels.triton_ops.common import check_float_dtype

# Columns per program: 14336 (Llama 3 8B) takes 14 programs a token, so even one token spreads.
MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    width,
    stride_gate,
    stride_up,
    BLOCK: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < width
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up + cols, mask=valid, other=0.0).to(tl.float32)
    # silu in float32, rounded to the dtype, then the product rounded again: torch's two ops.
    # IEEE division (Triton's default is approximate on GPUs) keeps float32 within an ulp of torch.
    silu = tl.div_rn(g, 1.0 + tl.exp(-g)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (silu * u).to(dtype), mask=valid)


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up` for two tensors of one shape [..., I] ([T, I] in the model); returns a new tensor."""
    _check(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    width = gate.shape[-1]
    stride_gate, stride_up = _row_stride("gate", gate), _row_stride("up", up)
    block = min(triton.next_power_of_2(width), MAX_BLOCK)
    _silu_and_mul_kernel[(out.numel() // width, triton.cdiv(width, block))](
        gate,
        up,
        out,
        width,
        stride_gate,
        stride_up,
        BLOCK=block,
        num_warps=4 if block >= 1024 else 2 if block >= 256 else 1,
    )
    return out


def _row_stride(name: str, t: Tensor) -> int:
    """The distance between consecutive rows of `t` [..., I] flattened to [rows, I], without a copy."""
    if t.dim() == 1:
        return 0
    try:
        return t.view(-1, t.shape[-1]).stride(0)
    except RuntimeError:
        raise ValueError(
            f"{name} {list(t.shape)} with strides {t.stride()}: its rows are not evenly spaced; "
            "pass a contiguous tensor"
        ) from None


def _check(gate: Tensor, up: Tensor) -> None:
    check_float_dtype("gate", gate.dtype)
    if gate.dim() == 0:
        raise ValueError("gate must have at least one dimension")
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(
            f"up ({up.dtype}, {list(up.shape)}) must match gate ({gate.dtype}, {list(gate.shape)})"
        )
    for name, t in (("gate", gate), ("up", up)):
        if t.stride(-1) != 1 and t.numel() > 0:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    check_same_device(gate=gate, up=up)
