"""Plain-torch LoRA shrink and expand, one row at a time: the contract the other paths match.

For a projection of `n` slices (q/k/v: 3, gate/up: 2, o and down: 1) over a pool of `S` slots of
rank `R`:
- `a` [S, n*R, in]: slot s's A matrices of its slices stacked (slice i in rows i*R..(i+1)*R);
- `b` [S, n*R, out]: slot s's B matrices transposed and block-diagonal: rows i*R..(i+1)*R hold
  slice i's B^T in its output columns (the merged projection's slice) and zeros elsewhere, so one
  product adds every slice into its own columns; an adapter of rank r < R is zero-padded, which
  adds exact zeros.
`lora_shrink` returns y [A, n*R] float32, row i for batch row `rows.sorted_rows[i]`:
`y[i] = scalings[s] * (A_s @ x[row])`. `lora_expand` adds `y[i] @ b_s` into `out[row]` in place;
rows without an adapter (slot -1) are never touched.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvasir.kernels.lora_rows import LoRARows


def lora_shrink(x: Tensor, a: Tensor, scalings: Tensor, rows: LoRARows) -> Tensor:
    """x [T, in] -> y [A, n*R] float32 (see the module docstring)."""
    y = torch.zeros(rows.num_rows, a.shape[1], dtype=torch.float32, device=x.device)
    for i, row in enumerate(rows.sorted_rows.tolist()):
        slot = int(rows.token_slots[row])
        y[i] = scalings[slot].float() * (a[slot].float() @ x[row].float())
    return y


def lora_expand(out: Tensor, y: Tensor, b: Tensor, rows: LoRARows) -> None:
    """out[row] += y[i] @ b[slot of row] for every row with an adapter (in place)."""
    for i, row in enumerate(rows.sorted_rows.tolist()):
        slot = int(rows.token_slots[row])
        out[row] += (y[i] @ b[slot].float()).to(out.dtype)
