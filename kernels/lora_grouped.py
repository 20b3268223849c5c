"""LoRA shrink and expand on the CPU (plain torch), in one of two layouts chosen per step.

- Grouped (`LoRARows.dense` false): the groups of `LoRARows` are contiguous runs of the shrink's
  output, so each adapter present costs one `mm` in the shrink (its batch rows gathered, or sliced
  when they are one range) and one in the expand (added back with one `index_add_`, or in place on
  a slice): a prefill chunk of one adapter is two products per projection, whatever its length.
- Dense (`LoRARows.dense` true, small batches with several adapters): one product of every row
  with the whole pool's A, a mask that keeps each row's own slot (times its scaling) and zeroes the
  rest, and one product with the whole pool's B. A decode step is then 4 calls per projection
  instead of about 5 per adapter; the pool's other slots cost flops (rank x slots, small next to
  the base GEMM at these batch sizes), not calls, which dominate a CPU step this small. Rows
  without an adapter add exact zeros.
Same result as `kvasir.kernels.reference.lora`; y's layout is each strategy's own (only
`lora_expand` reads it): [A, n*R] grouped, [T, S*n*R] dense. The pool's dtype (`--lora-dtype`) may
differ from the activations': the products run in float32, every operand upcast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvasir.kernels.lora_rows import LoRARows


def lora_shrink(x: Tensor, a: Tensor, scalings: Tensor, rows: LoRARows) -> Tensor:
    """x [T, in] -> y float32: [A, n*R] grouped, [T, S*n*R] dense."""
    if rows.dense_mask is not None:
        slots, width = a.shape[0], a.shape[1]
        weight = a.view(slots * width, a.shape[2])
        y = torch.mm(x.float(), weight.t().float())  # .float() of a float32 tensor is itself
        y.view(-1, slots, width).mul_(rows.dense_mask * scalings.view(1, slots, 1))
        return y
    y = torch.empty(rows.num_rows, a.shape[1], dtype=torch.float32, device=x.device)
    for group in rows.groups:
        if group.rows_range is not None:
            xg = x[group.rows_range[0] : group.rows_range[1]]
        else:
            xg = x.index_select(0, rows.sorted_rows[group.start : group.end])
        torch.mm(xg.float(), a[group.slot].float().t(), out=y[group.start : group.end])
        y[group.start : group.end].mul_(scalings[group.slot])
    return y


def lora_expand(out: Tensor, y: Tensor, b: Tensor, rows: LoRARows) -> None:
    """out[rows] += y @ b[slot], in place: one product for the batch (dense) or per group."""
    if rows.dense_mask is not None:
        weight = b.view(b.shape[0] * b.shape[1], b.shape[2]).float()
        if out.dtype == torch.float32:
            out.addmm_(y, weight)
        else:
            out.add_((y @ weight).to(out.dtype))
        return
    for group in rows.groups:
        weight = b[group.slot].float()
        delta = (y[group.start : group.end] @ weight).to(out.dtype)
        if group.rows_range is not None:
            out[group.rows_range[0] : group.rows_range[1]].add_(delta)
        else:
            out.index_add_(0, rows.sorted_rows[group.start : group.end], delta)
