"""The C decoder stack's LoRA terms (`lora_projection`, the function the stack calls after each
GEMM) against the row-by-row torch reference, on random shapes: ranks below the pool's, slots no
row uses, base rows mixed in, groups longer than the C row tile (a prefill chunk), no adapter; with
a float32 pool and a bfloat16 one (`--lora-dtype bfloat16`), whose reference is the same bfloat16
weights upcast (the C code widens them exactly and sums in float32, so the tolerance is the same)."""

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


def _pool(
    in_features: int,
    slices: tuple[int, ...],
    rank: int,
    ranks: list[int],
    seed: int,
    dtype: torch.dtype = torch.float32,
):
    """a, b in the reference's layout and `dtype`, each slot's adapter of rank ranks[slot]
    zero-padded to `rank`."""
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
    ranks_tensor = torch.tensor(ranks, dtype=torch.int32)
    pool = LoRAPool(layers=({},), rank=rank, scalings=scalings, ranks=ranks_tensor, dtype=dtype)
    return a.to(dtype), b.to(dtype), pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pattern", list(SLOT_PATTERNS))
@pytest.mark.parametrize("seed", range(4))
def test_lora_projection_matches_the_reference(pattern: str, seed: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1000 + seed)
    # Random sizes, most not multiples of the 16-float vectors (the scalar tails run too).
    in_features = int(torch.randint(8, 200, (1,), generator=g))
    slices = tuple(int(n) for n in torch.randint(1, 150, (1 + seed % 3,), generator=g))
    rank = (4, 8, 16, 12)[seed]
    ranks = [int(r) for r in torch.randint(1, rank + 1, (NUM_SLOTS,), generator=g)]
    ranks[0] = rank  # one slot at the pool's rank
    a, b, pool = _pool(in_features, slices, rank, ranks, seed, dtype)
    slots = SLOT_PATTERNS[pattern]
    x = torch.randn(len(slots), in_features, generator=g)
    out = torch.randn(len(slots), sum(slices), generator=g)
    rows = LoRARows.build(np.array(slots), x.device)

    expected = out.clone()  # the reference upcasts a bfloat16 pool's weights to float32
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


def test_a_bfloat16_pool_is_read_as_bfloat16() -> None:
    """The C code reads the pool's dtype, not float32 bytes: a float32 tensor in a bfloat16 pool is
    refused, and bfloat16 weights of every sign and exponent widen exactly to the floats they are."""
    a, b, pool = _pool(16, (8, 8), 4, [4] * NUM_SLOTS, 0, torch.bfloat16)
    rows = LoRARows.build(np.array([0, -1]), torch.device("cpu"))
    with pytest.raises(ValueError, match="a must be a contiguous bfloat16"):
        lora_projection(torch.zeros(2, 16), torch.randn(2, 16), a.float(), b, (8, 8), pool, rows)
    # 512 bit patterns spread over all 65536, as signed 16-bit words; finite, normal, |v| < 2^100.
    bits = torch.arange(0, 1 << 16, 61)
    values = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16)
    magnitude = values.float().abs()
    wide = values[(magnitude > 2.0**-100) & (magnitude < 2.0**100)][: 8 * 64].reshape(8, 64)
    # Slot 0: A = those values (8 rows: 4 per slice); B^T = identity blocks, so each output column
    # is one row of A dotted with x. x = one-hot rows: row t picks column t of A.
    a = torch.zeros(NUM_SLOTS, 8, 64, dtype=torch.bfloat16)
    a[0] = wide
    b = torch.zeros(NUM_SLOTS, 8, 16, dtype=torch.bfloat16)
    b[0, :4, :4] = torch.eye(4)
    b[0, 4:, 8:12] = torch.eye(4)
    rows = LoRARows.build(np.zeros(64, dtype=np.int64), torch.device("cpu"))
    out = torch.zeros(64, 16)
    lora_projection(out, torch.eye(64), a, b, (8, 8), pool, rows)
    expected = torch.zeros(64, 16)
    expected[:, :4] = pool.scalings[0] * wide[:4].float().t()
    expected[:, 8:12] = pool.scalings[0] * wide[4:].float().t()
    assert torch.equal(out, expected)
