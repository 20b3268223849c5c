"""Group-quantized int4 weights times activations: `int4_matmul` (Triton on CUDA, the torch reference
elsewhere) and the packing each backend reads, made once at load.

Two layouts, one per backend:

- `pack_for_kernels`: the Triton kernel's (and its reference's) layout, `qweight` int32 [K / 8, N]
  with eight consecutive input rows per word, `scales` and `zeros` [G, N] in the model's dtype;
- `pack_for_cpu`: the layout of torch's own CPU kernel, `aten._weight_int4pack_mm_for_cpu`, which
  `int4_matmul_cpu` runs. That kernel takes group sizes 32..256 only; a larger group (AWQ/GPTQ's
  `-1`, one group for all of K) is the same weight with its scales repeated over 256-wide groups.
  It is fast with bfloat16 activations only (float32 takes a slow path), so float32 models convert
  the activations to bfloat16 and the result back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.int4_packing import pack_int32
from kvasir.kernels.reference import int4_matmul as reference

CPU_GROUP_SIZES = (256, 128, 64, 32)  # what aten._weight_int4pack_mm_for_cpu accepts
CPU_OFFSET = 8  # that kernel computes (q - 8) * scale + zero


def int4_matmul(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """x [M, K] @ W [K, N] -> [M, N], W in the layout of `pack_for_kernels`."""
    if use_triton(x.device):
        from kvasir.kernels.triton_ops.int4_matmul import int4_matmul as impl
    else:
        impl = reference.int4_matmul
    return impl(x, qweight, scales, zeros, group_size)


def pack_for_kernels(
    codes: Tensor, scales: Tensor, zeros: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """codes uint8 [N, K], scales and zeros [N, G] -> (qweight [K/8, N], scales [G, N], zeros [G, N])."""
    if codes.shape[1] % 8:
        raise ValueError(f"the int4 kernels need in_features divisible by 8, got {codes.shape[1]}")
    qweight = pack_int32(codes.t(), dim=0)
    return qweight.contiguous(), scales.t().to(dtype).contiguous(), zeros.t().to(dtype).contiguous()


def cpu_group_size(group_size: int) -> int | None:
    """The group size torch's CPU kernel runs a weight quantized in groups of `group_size` with, or
    None when it cannot (groups smaller than 32, or not a multiple of one it takes)."""
    return next((size for size in CPU_GROUP_SIZES if group_size % size == 0), None)


def pack_for_cpu(codes: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> tuple[Tensor, Tensor, int]:
    """codes uint8 [N, K], scales and zeros [N, G] -> (packed weight, scales-and-zeros, its group size)
    for `int4_matmul_cpu`. Raises ValueError when the group size does not fit the kernel."""
    kernel_group = cpu_group_size(group_size)
    in_features = codes.shape[1]
    if kernel_group is None or in_features % group_size:
        raise ValueError(
            f"torch's CPU int4 kernel cannot run groups of {group_size} over {in_features} inputs"
        )
    repeat = group_size // kernel_group
    scale = scales.float().repeat_interleave(repeat, dim=1)  # [N, K / kernel_group]
    zero = zeros.float().repeat_interleave(repeat, dim=1)
    # (q - z) * s == (q - 8) * s + (8 - z) * s
    scale_and_zero = torch.stack([scale.t(), ((CPU_OFFSET - zero) * scale).t()], dim=-1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    return packed, scale_and_zero.to(torch.bfloat16).contiguous(), kernel_group


def int4_matmul_cpu(x: Tensor, packed: Tensor, scale_and_zero: Tensor, group_size: int) -> Tensor:
    """x [M, K] @ W -> [M, N] in x's dtype, through torch's CPU kernel (bfloat16 inside)."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group_size, scale_and_zero)
    return out.to(x.dtype)
