"""The Triton RMSNorm (plain and fused with the residual add) against the torch reference.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py). Tolerances, in units of
the dtype's ulp: float32 rows are summed in another order than torch's (a few ulps of the mean
square); the interpreter's float32 -> bfloat16 conversion truncates where torch rounds to nearest,
so each bfloat16 rounding point may land one ulp off.
"""

from __future__ import annotations

import pytest
import torch

from kvasir.kernels.reference import norm as reference
from kvasir.kernels.triton_ops import norm as triton_norm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5


def ulps(dtype: torch.dtype, n: float) -> float:
    """A relative tolerance of `n` ulps: |a - b| <= n * eps * |b| (eps: the ulp of 1.0)."""
    return n * torch.finfo(dtype).eps


# The normalised output: two rounding points (the normalised value, its product with the weight)
# plus the float32 mean square, which the kernel sums in a different order.
OUT_RTOL = {torch.float32: ulps(torch.float32, 8), torch.float16: ulps(torch.float16, 2)}
OUT_RTOL[torch.bfloat16] = ulps(torch.bfloat16, 3)


def make(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(dtype)


def weight(dim: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return (1 + 0.5 * torch.randn(dim, generator=g)).to(dtype)


def check_out(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu(), expected, rtol=OUT_RTOL[expected.dtype], atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "dim"), [(1, 64), (5, 100), (3, 896), (2, 4096), (9, 1)])
def test_rms_norm_matches_reference(dtype: torch.dtype, num_tokens: int, dim: int) -> None:
    x, w = make((num_tokens, dim), dtype, seed=dim), weight(dim, dtype)
    check_out(triton_norm.rms_norm(x.to(DEVICE), w.to(DEVICE), EPS), reference.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_tokens", "dim"), [(1, 64), (7, 100), (4, 896)])
def test_fused_add_rms_norm_returns_both_values(dtype: torch.dtype, num_tokens: int, dim: int) -> None:
    x, residual = make((num_tokens, dim), dtype, seed=1), make((num_tokens, dim), dtype, seed=2)
    w = weight(dim, dtype)
    out, summed = triton_norm.fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), w.to(DEVICE), EPS)
    expected_out, expected_sum = reference.fused_add_rms_norm(x, residual, w, EPS)
    # The sum is one rounding: exact, or one ulp off where the interpreter truncates bfloat16.
    sum_rtol = ulps(dtype, 1) if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(summed.cpu(), expected_sum, rtol=sum_rtol, atol=0)
    # The normalised output is checked against the reference applied to the kernel's own sum, so a
    # one-ulp difference in the sum is not counted twice; `out` must not alias `summed`.
    check_out(out, reference.rms_norm(summed.cpu(), w, EPS))
    if dtype != torch.bfloat16:
        check_out(out, expected_out)
    assert out.data_ptr() != summed.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_bit_identical_when_the_mean_square_is_exact(dtype: torch.dtype) -> None:
    # Small integers: every sum of squares is exact whatever the order, so the kernel must round
    # exactly where the reference does (normalised value to the dtype, then times the weight).
    g = torch.Generator().manual_seed(8)
    x = torch.randint(-3, 4, (6, 64), generator=g).to(dtype)
    residual = torch.randint(-3, 4, (6, 64), generator=g).to(dtype)
    w = weight(64, dtype)
    out = triton_norm.rms_norm(x.to(DEVICE), w.to(DEVICE), EPS)
    torch.testing.assert_close(out.cpu(), reference.rms_norm(x, w, EPS), rtol=0, atol=0)
    out, summed = triton_norm.fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), w.to(DEVICE), EPS)
    expected_out, expected_sum = reference.fused_add_rms_norm(x, residual, w, EPS)
    torch.testing.assert_close(out.cpu(), expected_out, rtol=0, atol=0)
    torch.testing.assert_close(summed.cpu(), expected_sum, rtol=0, atol=0)


def test_leading_dims_and_strided_rows() -> None:
    # Qwen3's per-head norm sees q [T, H, D]; a slice of a fused qkv output is strided on T and H.
    qkv = make((6, 5, 32), torch.float32, seed=3)
    q = qkv[:, 1:4]  # [6, 3, 32]: token stride 160, head stride 32
    w = weight(32, torch.float32)
    check_out(triton_norm.rms_norm(q.to(DEVICE), w.to(DEVICE), EPS), reference.rms_norm(q, w, EPS))
    wide = make((5, 300), torch.float16, seed=4)
    x, residual = wide[:, :100], wide[:, 150:250]  # rows 300 apart, last dim contiguous
    w16 = weight(100, torch.float16)
    out, summed = triton_norm.fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), w16.to(DEVICE), EPS)
    expected_out, expected_sum = reference.fused_add_rms_norm(x, residual, w16, EPS)
    check_out(out, expected_out)
    torch.testing.assert_close(summed.cpu(), expected_sum, rtol=0, atol=0)
    four_d = make((2, 3, 4, 16), torch.float32, seed=5)
    w4 = weight(16, torch.float32)
    check_out(
        triton_norm.rms_norm(four_d.to(DEVICE), w4.to(DEVICE), EPS), reference.rms_norm(four_d, w4, EPS)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_longer_than_one_block_are_read_in_chunks(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same loop a row longer than MAX_BLOCK takes, at a size the interpreter runs quickly.
    monkeypatch.setattr(triton_norm, "MAX_BLOCK", 64)
    x, residual, w = make((3, 200), dtype, seed=6), make((3, 200), dtype, seed=7), weight(200, dtype)
    check_out(triton_norm.rms_norm(x.to(DEVICE), w.to(DEVICE), EPS), reference.rms_norm(x, w, EPS))
    out, summed = triton_norm.fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), w.to(DEVICE), EPS)
    torch.testing.assert_close(summed.cpu(), x + residual, rtol=ulps(dtype, 1), atol=0)
    check_out(out, reference.rms_norm(summed.cpu(), w, EPS))


def test_large_values_do_not_overflow_half_precision() -> None:
    # x^2 overflows float16 (max 65504): the sum of squares must be taken in float32.
    x = torch.full((2, 64), 1000.0, dtype=torch.float16)
    w = torch.ones(64, dtype=torch.float16)
    out = triton_norm.rms_norm(x.to(DEVICE), w.to(DEVICE), EPS).cpu()
    assert torch.isfinite(out).all()
    check_out(out, reference.rms_norm(x, w, EPS))


def test_no_tokens_launches_nothing() -> None:
    w = weight(64, torch.float32).to(DEVICE)
    empty = torch.zeros(0, 64, device=DEVICE)
    assert triton_norm.rms_norm(empty, w, EPS).shape == (0, 64)
    out, summed = triton_norm.fused_add_rms_norm(empty, empty, w, EPS)
    assert out.shape == summed.shape == (0, 64)


@pytest.mark.parametrize(
    ("x", "residual", "w", "message"),
    [
        (torch.zeros(2, 8), None, torch.zeros(8, dtype=torch.float16), "weight must have x's dtype"),
        (torch.zeros(2, 8), None, torch.zeros(6), r"weight must be \[8\]"),
        (torch.zeros(2, 8), None, torch.zeros(2, 8), r"weight must be \[8\]"),
        (
            torch.zeros(2, 8, dtype=torch.int32),
            None,
            torch.zeros(8),
            "x must be float32, float16 or bfloat16",
        ),
        (torch.zeros(8, 2).t(), None, torch.zeros(8), "x must have a contiguous last dimension"),
        (torch.zeros(2, 8), torch.zeros(3, 8), torch.zeros(8), "residual .* must match x"),
        (
            torch.zeros(2, 8),
            torch.zeros(2, 8, dtype=torch.float16),
            torch.zeros(8),
            "residual .* must match x",
        ),
        (torch.zeros(2, 8), None, torch.zeros(8, device="meta"), "one device"),
        (torch.zeros(2, 8), torch.zeros(2, 8, device="meta"), torch.zeros(8), "one device"),
        (torch.zeros(4, 3, 2, 8)[:, :2], None, torch.zeros(8), "leading dimensions"),
    ],
)
def test_wrapper_rejects_bad_arguments(
    x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        if residual is None:
            triton_norm.rms_norm(x, w, EPS)
        else:
            triton_norm.fused_add_rms_norm(x, residual, w, EPS)


def test_wrapper_rejects_negative_eps() -> None:
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        triton_norm.rms_norm(torch.zeros(2, 8), torch.zeros(8), -1.0)
