"""Which rows of a step run which LoRA adapter slot: built once per step, read by every LoRA op.

The batch's rows stay in the scheduler's order; the LoRA ops work on the rows that have an
adapter, grouped by slot (`sorted_rows`, a stable sort): the shrink's output row i belongs to
batch row `sorted_rows[i]`, and each group of one slot is a contiguous run of it. So the CPU path
runs one matrix multiply per adapter present (not per token), and the Triton kernels one segment
per adapter (S-LoRA's / Punica's SGMV layout). Everything is derived on the host, from the step's
per-row slots, before the layers run: no layer reads a tensor back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class LoRAGroup:
    """One slot's run of `sorted_rows`: [start, end), and the batch rows it covers when they are
    one contiguous range (`rows_range`), which lets the CPU path slice instead of gathering."""

    slot: int
    start: int
    end: int
    rows_range: tuple[int, int] | None


@dataclass(frozen=True)
class LoRARows:
    """The step's row -> slot mapping in the layouts the LoRA ops read (tensors on the device)."""

    token_slots: Tensor  # [T] int32: each batch row's slot, -1 for a row without an adapter
    sorted_rows: Tensor  # [A] int64: the A rows with an adapter, grouped by slot (stable)
    seg_starts: Tensor  # [G+1] int32: group g is sorted_rows[seg_starts[g]:seg_starts[g+1]]
    seg_slots: Tensor  # [G] int32: group g's slot
    groups: tuple[LoRAGroup, ...]  # the same groups, on the host
    max_group_rows: int  # the longest group (the Triton launch's grid is sized from it)
    # [T, S, 1] float32 one-hot of each row's slot (zeros for a row without one) when the CPU
    # path runs this step dense (`kvasir.kernels.lora_grouped`); None: grouped.
    dense_mask: Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Batch rows with an adapter (the shrink's output rows)."""
        return self.groups[-1].end if self.groups else 0

    @classmethod
    def build(cls, token_slots: np.ndarray, device: torch.device, dense_slots: int | None = None) -> LoRARows:
        """From each batch row's slot (-1: none), on the host; the tensors are moved to `device`.
        `dense_slots`: the pool's slot count, to lay the step out dense for the CPU path."""
        slots = np.asarray(token_slots, dtype=np.int64)
        active = np.flatnonzero(slots >= 0)
        order = active[np.argsort(slots[active], kind="stable")]
        sorted_slots = slots[order]
        # Where the slot changes along the sorted rows: the group boundaries.
        cuts = np.flatnonzero(np.diff(sorted_slots)) + 1 if len(order) else np.zeros(0, np.int64)
        starts = (
            np.concatenate(([0], cuts, [len(order)])).astype(np.int64)
            if len(order)
            else np.zeros(1, np.int64)
        )
        groups = []
        for g in range(len(starts) - 1):
            start, end = int(starts[g]), int(starts[g + 1])
            rows = order[start:end]
            contiguous = int(rows[-1]) - int(rows[0]) == end - start - 1
            groups.append(
                LoRAGroup(
                    int(sorted_slots[start]),
                    start,
                    end,
                    (int(rows[0]), int(rows[-1]) + 1) if contiguous else None,
                )
            )
        return cls(
            token_slots=torch.from_numpy(slots.astype(np.int32)).to(device),
            sorted_rows=torch.from_numpy(order.astype(np.int64)).to(device),
            seg_starts=torch.from_numpy(starts.astype(np.int32)).to(device),
            seg_slots=torch.tensor([group.slot for group in groups], dtype=torch.int32).to(device),
            groups=tuple(groups),
            max_group_rows=max((group.end - group.start for group in groups), default=0),
            dense_mask=None if dense_slots is None else _one_hot(slots, dense_slots, device),
        )


def _one_hot(slots: np.ndarray, num_slots: int, device: torch.device) -> Tensor:
    mask = np.zeros((len(slots), num_slots, 1), dtype=np.float32)
    active = np.flatnonzero(slots >= 0)
    mask[active, slots[active], 0] = 1.0
    return torch.from_numpy(mask).to(device)
