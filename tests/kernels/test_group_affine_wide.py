"""The CPU group-affine GEMM's wide form (`TiledGemm.run_wide`): each group's float32 term summed
over the groups in float64. What tensor parallelism needs of it: a weight split along K on group
boundaries (as row-parallel layers split it among ranks), each part's float64 result added in
float64 and rounded to float32, gives the bits of the whole weight's result; in every version of
the kernel this CPU runs, with float and integer activations. The float32 form's running sums do
not (the last test shows it), which is what made two ranks' logits differ from one's."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvasir.kernels.cpu_ops import group_affine as cpu
from kvasir.kernels.cpu_ops.group_affine_layout import tile
from kvasir.kernels.reference.group_affine import (
    GroupAffineWeight,
    group_affine_linear,
    group_affine_linear_int,
    pack_codes,
)

LAYOUTS = [(4, 32), (8, 32), (8, 16), (5, 32)]
KERNELS = [kernel for kernel in cpu.KERNELS if cpu.runs_here(kernel)]
N, GROUPS_K = 37, 12  # a partial tile of 16 rows; K = 12 groups of 32 (24 of 16)

pytestmark = pytest.mark.skipif(
    cpu.library() is None, reason="no C compiler here: the CPU kernel is not built (the torch reference runs)"
)


def weight_parts(bits: int, group: int, cuts: list[int]) -> list[GroupAffineWeight]:
    """One random weight [N, 384]: whole (cuts [0, 384]) or its K columns cut at `cuts`."""
    k = GROUPS_K * 32
    g = torch.Generator().manual_seed(bits * group)
    codes = torch.randint(0, 2**bits, (N, k), generator=g, dtype=torch.uint8)
    scale = torch.rand((N, k // group), generator=g) * 0.02
    offset = torch.randn((N, k // group), generator=g) * 0.05
    stored = 8 if bits == 5 else bits
    return [
        GroupAffineWeight(
            pack_codes(codes[:, a:b].contiguous(), stored, group),
            scale[:, a // group : b // group].contiguous(),
            offset[:, a // group : b // group].contiguous(),
            stored,
            group,
        )
        for a, b in itertools.pairwise(cuts)
    ]


def split_sum(x: torch.Tensor, bits: int, group: int, cuts: list[int], kernel: str, act: int) -> torch.Tensor:
    parts = weight_parts(bits, group, cuts)
    return sum(
        (
            cpu.TiledGemm(tile(part), act, kernel=kernel).run_wide(x[:, a:b].contiguous())
            for part, a, b in zip(parts, cuts, cuts[1:], strict=False)
        ),
        torch.zeros((x.shape[0], N), dtype=torch.float64),
    )


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
@pytest.mark.parametrize("activation_bits", [0, 8, 16])
@pytest.mark.parametrize("rows", [1, 2, 5, 67])
def test_a_split_along_k_rounds_to_the_whole_sums_bits(
    bits: int, group: int, activation_bits: int, rows: int
) -> None:
    # 2 and 3 parts of unequal widths (a third, and a rank's 1 of 3 KV heads), all on 32-boundaries
    x = torch.randn(rows, GROUPS_K * 32, generator=torch.Generator().manual_seed(rows))
    (whole,) = weight_parts(bits, group, [0, GROUPS_K * 32])
    for kernel in KERNELS:
        if activation_bits == 0 and kernel in ("avx2", "avx_vnni"):
            continue  # float activations run the portable loops there
        gemm = cpu.TiledGemm(tile(whole), activation_bits, kernel=kernel)
        wide = gemm.run_wide(x)
        assert wide.dtype == torch.float64 and wide.shape == (rows, N)
        expected = (
            group_affine_linear_int(x, whole, activation_bits)
            if activation_bits
            else group_affine_linear(x, whole)
        )
        torch.testing.assert_close(wide.float(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
        for cuts in ([0, 128, 384], [0, 64, 192, 384]):
            parts = split_sum(x, bits, group, cuts, kernel, activation_bits)
            assert torch.equal(parts.float(), wide.float()), (kernel, cuts)


def test_the_float32_forms_running_sums_differ_when_split() -> None:
    """Why the wide form exists: the float32 form's parts, added, miss the whole sum's last bits."""
    x = torch.randn(67, GROUPS_K * 32, generator=torch.Generator().manual_seed(3))
    (whole,) = weight_parts(4, 32, [0, GROUPS_K * 32])
    first, second = weight_parts(4, 32, [0, 128, 384])
    split = cpu.TiledGemm(tile(first), 0).run(x[:, :128].contiguous()) + cpu.TiledGemm(tile(second), 0).run(
        x[:, 128:].contiguous()
    )
    assert not torch.equal(split, cpu.TiledGemm(tile(whole), 0).run(x))
