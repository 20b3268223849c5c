"""The Triton `silu(gate) * up` against the torch reference.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py). silu's exp is not
torch's (numpy's in the interpreter, an approximate exp2 on a GPU), so float32 results differ by a
few ulps and a half-precision rounding of silu may rarely flip by one ulp; the interpreter's
float32 -> bfloat16 conversion truncates where torch rounds to nearest (one ulp per rounding point).
"""

from __future__ import annotations

import pytest
import torch

from kvasir.kernels.reference.activation import silu_and_mul as reference_silu_and_mul
from kvasir.kernels.triton_ops.activation import silu_and_mul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative tolerances in ulps (eps: the ulp of 1.0) of each dtype; see the module docstring.
RTOL = {
    torch.float32: 16 * torch.finfo(torch.float32).eps,
    torch.float16: 2 * torch.finfo(torch.float16).eps,
    torch.bfloat16: 3 * torch.finfo(torch.bfloat16).eps,
}


def make(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu(), expected, rtol=RTOL[expected.dtype], atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "width"), [(1, 64), (5, 100), (3, 2500)])
def test_matches_reference(dtype: torch.dtype, num_tokens: int, width: int) -> None:
    # 2500 columns take three programs per row, the last one masked.
    gate = make((num_tokens, width), dtype, seed=width, scale=4.0)  # deep into both tails of silu
    up = make((num_tokens, width), dtype, seed=width + 1)
    check(silu_and_mul(gate.to(DEVICE), up.to(DEVICE)), reference_silu_and_mul(gate, up))


def test_rounds_silu_to_the_dtype_before_the_product() -> None:
    # float16: the interpreter rounds like torch, so all but the rare exp-induced flips are identical.
    # Skipping the rounding of silu (one rounding instead of two) changes far more than 1% of them.
    gate = make((16, 512), torch.float16, seed=3, scale=3.0)
    up = make((16, 512), torch.float16, seed=4)
    out = silu_and_mul(gate.to(DEVICE), up.to(DEVICE)).cpu()
    same = (out == reference_silu_and_mul(gate, up)).float().mean().item()
    assert same >= 0.99, f"only {same:.1%} of the float16 results are bit-identical to the reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_halves_of_a_merged_projection_and_leading_dims(dtype: torch.dtype) -> None:
    merged = make((4, 2 * 96), dtype, seed=5, scale=2.0)  # a gate_up projection's output [T, 2I]
    gate, up = merged[:, :96], merged[:, 96:]
    check(silu_and_mul(gate.to(DEVICE), up.to(DEVICE)), reference_silu_and_mul(gate, up))
    gate3, up3 = make((2, 3, 40), dtype, seed=6), make((2, 3, 40), dtype, seed=7)
    check(silu_and_mul(gate3.to(DEVICE), up3.to(DEVICE)), reference_silu_and_mul(gate3, up3))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's exp(100)
def test_extremes() -> None:
    gate = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0, -0.0]])
    up = torch.full_like(gate, 2.0)
    out = silu_and_mul(gate.to(DEVICE), up.to(DEVICE)).cpu()
    assert torch.isfinite(out).all()
    check(out, reference_silu_and_mul(gate, up))


def test_no_tokens_launches_nothing() -> None:
    empty = torch.zeros(0, 64, device=DEVICE)
    assert silu_and_mul(empty, empty).shape == (0, 64)


@pytest.mark.parametrize(
    ("gate", "up", "message"),
    [
        (torch.zeros(2, 8), torch.zeros(2, 9), r"up \(torch.float32, \[2, 9\]\) must match gate"),
        (torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float16), "must match gate"),
        (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32), "gate must be float32"),
        (torch.zeros(8, 2).t(), torch.zeros(2, 8), "gate must have a contiguous last dimension"),
        (torch.zeros(2, 8), torch.zeros(8, 2).t(), "up must have a contiguous last dimension"),
        (torch.zeros(2, 8), torch.zeros(2, 8, device="meta"), "one device"),
        (torch.zeros(4, 3, 8)[:, :2], torch.zeros(4, 2, 8), "gate .* rows are not evenly spaced"),
    ],
)
def test_wrapper_rejects_bad_arguments(gate: torch.Tensor, up: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        silu_and_mul(gate, up)
