"""The C decoder stack's LoRA terms (`lora_projection`, the function the stack calls after each
GEMM) against the row-by-row torch reference, on random shapes: ranks below the pool's, slots no
row uses, base rows mixed in, groups longer than the C row tile (a prefill chunk), no adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvasir.kernels.cpu_ops import decoder_stack
from kvasir.kernels.cpu_ops.decoder_stack import lora_projection
from kvasir.kernels.cpu_ops.decoder_stack_lora import LoRAPool
from kvasir.kernels.lora_rows import LoRARows
from kvasir.kernels.reference import lora as reference

pytestmark = pytest.mark.skipif(
    decoder_stack.library() is None, reason="no C compiler: the stack is not built"
)

NUM_SLOTS = 5
SLOT_PATTERNS = {
    "mixed": [2, -1, 0, 2, 1, -1, 0, 2, 4, 4, -1, 1, 2],  # slot 3 is in the pool, in no row
    "prefill-chunks": [-1] * 3 + [1] * 19 + [-1] * 2 + [4] * 9 + [0],  # groups over the 8-row tile
    "one-row": [-1, -1, 3],
    "no-adapter": [-1, -1, -1, -1],
}


def _pool(in_features: int, slices: tuple[int, ...], rank: int, ranks: list[int], seed: int):
    """a, b in the reference's layout, each slot's adapter of rank ranks[slot] zero-padded to `rank`."""
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(NUM_SLOTS, len(slices) * rank, in_features)
    b = torch.zeros(NUM_SLOTS, len(slices) * rank, sum(slices))
    offset = 0
    for index, size in enumerate(slices):
        for slot, r in enumerate(ranks):
            first = index * rank
            a[slot, first : first + r] = torch.randn(r, in_features, generator=g) / in_features**0.5
            b[slot, first : first + r, offset : offset + size] = torch.randn(r, size, generator=g)
        offset += size
    scalings = torch.rand(NUM_SLOTS, generator=g) * 2 + 0.1
    pool = LoRAPool(layers=({},), rank=rank, scalings=scalings, ranks=torch.tensor(ranks, dtype=torch.int32))
    return a, b, pool


@pytest.mark.parametrize("pattern", list(SLOT_PATTERNS))
@pytest.mark.parametrize("seed", range(4))
def test_lora_projection_matches_the_reference(pattern: str, seed: int) -> None:
    g = torch.Generator().manual_seed(1000 + seed)
    # Random sizes, most not multiples of the 16-float vectors (the scalar tails run too).
    in_features = int(torch.randint(8, 200, (1,), generator=g))
    slices = tuple(int(n) for n in torch.randint(1, 150, (1 + seed % 3,), generator=g))
    rank = (4, 8, 16, 12)[seed]
    ranks = [int(r) for r in torch.randint(1, rank + 1, (NUM_SLOTS,), generator=g)]
    ranks[0] = rank  # one slot at the pool's rank
    a, b, pool = _pool(in_features, slices, rank, ranks, seed)
    slots = SLOT_PATTERNS[pattern]
    x = torch.randn(len(slots), in_features, generator=g)
    out = torch.randn(len(slots), sum(slices), generator=g)
    rows = LoRARows.build(np.array(slots), x.device)

    expected = out.clone()
    reference.lora_expand(expected, reference.lora_shrink(x, a, pool.scalings, rows), b, rows)
    ours = out.clone()
    lora_projection(ours, x, a, b, slices, pool, rows)

    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    base_rows = [row for row, slot in enumerate(slots) if slot < 0]
    assert torch.equal(ours[base_rows], out[base_rows])  # rows without an adapter: untouched


def test_lora_projection_checks_its_arguments() -> None:
    a, b, pool = _pool(16, (8, 8), 4, [4] * NUM_SLOTS, 0)
    rows = LoRARows.build(np.array([0, -1]), torch.device("cpu"))
    x, out = torch.randn(2, 16), torch.zeros(2, 16)
    with pytest.raises(ValueError, match="b must be a contiguous float32"):
        lora_projection(out, x, a, b[:, :, :8].contiguous(), (8, 8), pool, rows)
    with pytest.raises(ValueError, match="the step has 3"):
        lora_projection(torch.zeros(3, 16), torch.randn(3, 16), a, b, (8, 8), pool, rows)
    bad = LoRARows.build(np.array([NUM_SLOTS, -1]), torch.device("cpu"))
    with pytest.raises(ValueError, match="outside the pool"):
        lora_projection(out, x, a, b, (8, 8), pool, bad)
