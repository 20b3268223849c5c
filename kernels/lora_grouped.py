"""LoRA shrink and expand grouped by adapter (the CPU path): one matrix multiply per adapter present.

Plain torch (no C): the groups of `LoRARows` are contiguous runs of the shrink's output, so the
shrink writes each group's rows in one `mm` (gathering its batch rows, or slicing them when they are
one range) and the expand adds each group's [rows, out] product back with one `index_add_` (or an
in-place add on a slice). A decode step of batch 8 over 4 adapters is 4 products per projection,
not 8. Same contract as `kvasir.kernels.reference.lora`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvasir.kernels.lora_rows import LoRARows


def lora_shrink(x: Tensor, a: Tensor, scalings: Tensor, rows: LoRARows) -> Tensor:
    """x [T, in] -> y [A, n*R] float32, one product per group."""
    y = torch.empty(rows.num_rows, a.shape[1], dtype=torch.float32, device=x.device)
    for group in rows.groups:
        if group.rows_range is not None:
            xg = x[group.rows_range[0] : group.rows_range[1]]
        else:
            xg = x.index_select(0, rows.sorted_rows[group.start : group.end])
        weight = a[group.slot]
        if xg.dtype != torch.float32:
            xg, weight = xg.float(), weight.float()
        torch.mm(xg, weight.t(), out=y[group.start : group.end])
        y[group.start : group.end].mul_(scalings[group.slot])
    return y


def lora_expand(out: Tensor, y: Tensor, b: Tensor, slice_sizes: tuple[int, ...], rows: LoRARows) -> None:
    """out[rows of group, slice i] += y[group, slice i] @ B_s,i^T, one add per group (in place)."""
    rank = b.shape[2]
    for group in rows.groups:
        yg = y[group.start : group.end]
        weight = b[group.slot] if b.dtype == torch.float32 else b[group.slot].float()
        if len(slice_sizes) == 1:
            delta = yg @ weight.t()
        else:
            parts, offset = [], 0
            for index, size in enumerate(slice_sizes):
                parts.append(yg[:, index * rank : (index + 1) * rank] @ weight[offset : offset + size].t())
                offset += size
            delta = torch.cat(parts, dim=1)
        delta = delta.to(out.dtype)
        if group.rows_range is not None:
            out[group.rows_range[0] : group.rows_range[1]].add_(delta)
        else:
            out.index_add_(0, rows.sorted_rows[group.start : group.end], delta)
