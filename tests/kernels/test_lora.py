"""The LoRA shrink/expand paths (grouped torch, Triton in the interpreter) against the row-by-row
reference, and the reference against the definition: x @ (scaling * B A)^T, per slice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvasir.kernels import lora as lora_dispatch
from kvasir.kernels import lora_grouped
from kvasir.kernels.lora_rows import LoRARows
from kvasir.kernels.reference import lora as reference
from kvasir.kernels.triton_ops import lora as triton_lora

# (in_features, slice sizes): a q/k/v projection with GQA widths, gate/up, and a one-slice o/down.
PROJECTIONS = [(32, (32, 16, 16)), (24, (40, 40)), (48, (20,))]
SLOT_PATTERNS = {
    "mixed": [2, -1, 0, 2, 1, -1, 0, 2, 3, 3, -1, 1, 2],
    "one-adapter-contiguous": [-1, 1, 1, 1, 1, -1],
    "no-adapter": [-1, -1, -1],
    "long-group": [0] * 37 + [3] * 5,  # more rows than one Triton tile (16)
}
NUM_SLOTS, RANK = 4, 8


def _pool(in_features: int, sizes: tuple[int, ...], dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(NUM_SLOTS, len(sizes) * RANK, in_features, generator=g) / in_features**0.5
    # b block-diagonal: slice i's rows (i*R..) hold its B^T in its own columns only.
    b = torch.zeros(NUM_SLOTS, len(sizes) * RANK, sum(sizes))
    offset = 0
    for index, size in enumerate(sizes):
        b[:, index * RANK : (index + 1) * RANK, offset : offset + size] = torch.randn(
            NUM_SLOTS, RANK, size, generator=g
        )
        offset += size
    # Slot 1 holds a rank-3 adapter, zero-padded as the slot pool pads it.
    for index in range(len(sizes)):
        a[1, index * RANK + 3 : (index + 1) * RANK] = 0
        b[1, index * RANK + 3 : (index + 1) * RANK] = 0
    scalings = torch.tensor([0.5, 2.0, 1.0, 0.25])
    return a.to(dtype), b.to(dtype), scalings


def _case(
    pattern: str,
    projection: tuple[int, tuple[int, ...]],
    dtype: torch.dtype,
    seed: int = 0,
    dense: bool = False,
):
    in_features, sizes = projection
    slots = SLOT_PATTERNS[pattern]
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(len(slots), in_features, generator=g).to(dtype)
    out = torch.randn(len(slots), sum(sizes), generator=g).to(dtype)
    return (
        x,
        out,
        *_pool(in_features, sizes, dtype, seed),
        sizes,
        LoRARows.build(np.array(slots), x.device, NUM_SLOTS if dense else None),
    )


def _run(module, x, out, a, b, scalings, sizes, rows):
    result = out.clone()
    module.lora_expand(result, module.lora_shrink(x, a, scalings, rows), b, rows)
    return result


@pytest.mark.parametrize("pattern", list(SLOT_PATTERNS))
@pytest.mark.parametrize("projection", PROJECTIONS, ids=lambda p: f"in{p[0]}-slices{len(p[1])}")
def test_reference_is_the_definition(pattern: str, projection) -> None:
    # The paths accumulate in float32 (y is float32): the definition is computed in float64.
    x, out, a, b, scalings, sizes, rows = _case(pattern, projection, torch.float32)
    x, out, a, b = x.double(), out.double(), a.double(), b.double()
    expected = out.clone()
    for row, slot in enumerate(SLOT_PATTERNS[pattern]):
        if slot < 0:
            continue
        offset = 0
        for index, size in enumerate(sizes):
            a_i = a[slot, index * RANK : (index + 1) * RANK]
            b_i = b[slot, index * RANK : (index + 1) * RANK, offset : offset + size].t()
            expected[row, offset : offset + size] += scalings[slot].double() * (b_i @ (a_i @ x[row]))
            offset += size
    actual = _run(reference, x.float(), out.float(), a.float(), b.float(), scalings, sizes, rows)
    torch.testing.assert_close(actual, expected.float(), rtol=1e-5, atol=1e-5)


PATHS = {"grouped": (lora_grouped, False), "dense": (lora_grouped, True), "triton": (triton_lora, False)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pattern", list(SLOT_PATTERNS))
@pytest.mark.parametrize("projection", PROJECTIONS, ids=lambda p: f"in{p[0]}-slices{len(p[1])}")
def test_matches_reference(path: str, dtype: torch.dtype, pattern: str, projection) -> None:
    module, dense = PATHS[path]
    x, out, a, b, scalings, sizes, rows = _case(pattern, projection, dtype, dense=dense)
    reference_rows = LoRARows.build(np.array(SLOT_PATTERNS[pattern]), x.device)
    expected = _run(reference, x, out, a, b, scalings, sizes, reference_rows)
    actual = _run(module, x, out, a, b, scalings, sizes, rows)
    # bfloat16: one rounding of the product may differ (the interpreter truncates to bfloat16).
    tol = (1e-5, 4e-5) if dtype == torch.float32 else (2e-2, 0.15)
    torch.testing.assert_close(actual, expected, rtol=tol[0], atol=tol[1])
    # Rows without an adapter are untouched, bit for bit.
    untouched = torch.tensor(SLOT_PATTERNS[pattern]) < 0
    assert torch.equal(actual[untouched], out[untouched])


def test_rows_group_by_slot_stably() -> None:
    rows = LoRARows.build(np.array([2, -1, 0, 2, 1, -1, 0]), torch.device("cpu"))
    assert rows.sorted_rows.tolist() == [2, 6, 4, 0, 3]
    assert [(g.slot, g.start, g.end) for g in rows.groups] == [(0, 0, 2), (1, 2, 3), (2, 3, 5)]
    assert rows.seg_starts.tolist() == [0, 2, 3, 5] and rows.seg_slots.tolist() == [0, 1, 2]
    assert rows.max_group_rows == 2 and rows.num_rows == 5
    # One group over consecutive rows is sliced, not gathered.
    contiguous = LoRARows.build(np.array([-1, 1, 1, 1]), torch.device("cpu"))
    assert contiguous.groups[0].rows_range == (1, 4)


@pytest.mark.parametrize("module", [lora_grouped, triton_lora], ids=["grouped", "triton"])
def test_launch_checks_name_the_argument(module) -> None:
    x, out, a, b, scalings, _, rows = _case("mixed", PROJECTIONS[0], torch.float32)
    from kvasir.kernels import lora as dispatch

    shrink = dispatch.lora_shrink if module is lora_grouped else module.lora_shrink
    expand = dispatch.lora_expand if module is lora_grouped else module.lora_expand
    with pytest.raises(ValueError, match="a must be"):
        shrink(x, a[:, :, :-1].contiguous(), scalings, rows)
    with pytest.raises(ValueError, match="scalings must be"):
        shrink(x, a, scalings.double(), rows)
    with pytest.raises(ValueError, match="rows map"):
        shrink(x[:-1], a, scalings, rows)
    y = shrink(x, a, scalings, rows)
    with pytest.raises(ValueError, match="y must be"):
        expand(out, y[:-1], b, rows)
    with pytest.raises(ValueError, match="b must be"):
        expand(out, y, b.double(), rows)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("pattern", ["mixed", "long-group"])
def test_a_pool_of_another_dtype_is_upcast(path: str, pool_dtype: torch.dtype, pattern: str) -> None:
    """`--lora-dtype bfloat16` (or float16) with float32 activations, as a CPU step the C stack
    declines runs it: the paths compute in float32 on the pool's weights upcast, so they match the
    reference on those weights to float32 rounding."""
    module, dense = PATHS[path]
    x, out, a, b, scalings, sizes, rows = _case(pattern, PROJECTIONS[0], torch.float32, dense=dense)
    a, b = a.to(pool_dtype), b.to(pool_dtype)
    reference_rows = LoRARows.build(np.array(SLOT_PATTERNS[pattern]), x.device)
    expected = _run(reference, x, out, a.float(), b.float(), scalings, sizes, reference_rows)
    dispatch_or_triton = lora_dispatch if module is lora_grouped else module
    actual = _run(dispatch_or_triton, x, out, a, b, scalings, sizes, rows)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=4e-5)
