"""Batched LoRA (never merged into the base weights): the shrink `x @ A^T` and the expand `@ B^T`
of every adapter in a step, over a stacked pool of adapter slots.

Dispatched like the other ops: the Triton kernels on CUDA (or `KVASIR_KERNELS=triton`), and
elsewhere the grouped torch path (`kvasir.kernels.lora_grouped`), which runs one matrix multiply
per adapter present. `kvasir.kernels.reference.lora` holds the contract (one row at a time), for
the tests; `kvasir.kernels.lora_rows.LoRARows` the step's row grouping every path reads.
"""

from __future__ import annotations

from torch import Tensor

from kvasir.kernels import lora_grouped
from kvasir.kernels.checks import check_lora_expand, check_lora_shrink
from kvasir.kernels.dispatch import use_triton
from kvasir.kernels.lora_rows import LoRARows


def lora_shrink(x: Tensor, a: Tensor, scalings: Tensor, rows: LoRARows) -> Tensor:
    """x [T, in], a [S, n*R, in], scalings [S] -> y [A, n*R] float32, row i for batch row
    `rows.sorted_rows[i]`: its slot's scaling times its slot's A applied to it."""
    if use_triton(x.device):
        from kvasir.kernels.triton_ops.lora import lora_shrink as impl
    else:
        check_lora_shrink(x, a, scalings, rows)
        impl = lora_grouped.lora_shrink
    return impl(x, a, scalings, rows)


def lora_expand(out: Tensor, y: Tensor, b: Tensor, rows: LoRARows) -> None:
    """Add each adapter row's `y @ b[slot]` into `out` [T, out] in place (b block-diagonal over a
    merged projection's slices, see the reference); rows without an adapter are left untouched."""
    if use_triton(out.device):
        from kvasir.kernels.triton_ops.lora import lora_expand as impl
    else:
        check_lora_expand(out, y, b, rows)
        impl = lora_grouped.lora_expand
    impl(out, y, b, rows)
