"""The Triton rotary embedding against the torch reference (and the reference against the definition).

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py). float32 and float16 must
match bit for bit: the kernel rounds each product and sum where the reference's torch ops do. The
interpreter's float32 -> bfloat16 conversion truncates where torch rounds to nearest, so bfloat16
results may be off by about one ulp of the products (|x| <= ~4 here: 2**-7 * 4 each).
"""

from __future__ import annotations

import pytest
import torch

from kvasir.kernels.reference import rotary as reference
from kvasir.kernels.triton_ops.rotary import apply_rotary
from kvasir.runtime.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def angles(head_dim: int, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, 1, D/2] float32, exactly as the model looks them up."""
    table = RotaryEmbedding(head_dim, max_position=4096, base=10000.0)
    return table(torch.tensor(positions, dtype=torch.int64))


def make(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    exact = expected.dtype != torch.bfloat16 or DEVICE.type == "cuda"
    atol = 0.0 if exact else 3 * 2**-7 * expected.abs().max().item()
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "head_dim"), [(1, 4, 64), (5, 3, 128), (3, 20, 128), (4, 2, 6)]
)
def test_matches_reference(dtype: torch.dtype, num_tokens: int, num_heads: int, head_dim: int) -> None:
    # 20 heads of 128 need two programs per token (the second one half masked); D/2 = 3 is masked too.
    x = make((num_tokens, num_heads, head_dim), dtype, seed=head_dim + num_heads)
    cos, sin = angles(head_dim, [0, 1, 77, 4095, 9][:num_tokens])
    check(apply_rotary(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)), reference.apply_rotary(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_heads_of_a_fused_qkv_and_2d_angles(dtype: torch.dtype) -> None:
    # k as a view of a fused qkv output [T, Hq + 2 Hkv, D]: token stride (4 + 2 * 2) * 32, head stride 32.
    qkv = make((6, 8, 32), dtype, seed=5)
    k = qkv[:, 4:6]
    cos, sin = angles(32, [3, 1, 4, 1, 5, 9])
    # [T, D/2] angles whose rows are not contiguous with each other: every other row of a table.
    cos2d, sin2d = (
        torch.repeat_interleave(cos[:, 0], 2, dim=0)[::2],
        torch.repeat_interleave(sin[:, 0], 2, dim=0)[::2],
    )
    assert cos2d.stride(0) == 32 and cos2d.shape == (6, 16)
    expected = reference.apply_rotary(k, cos, sin)
    check(apply_rotary(k.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)), expected)
    check(apply_rotary(k.to(DEVICE), cos2d.to(DEVICE), sin2d.to(DEVICE)), expected)
    assert torch.equal(reference.apply_rotary(k, cos2d, sin2d), expected)


def test_reference_rotates_each_pair_by_its_angle() -> None:
    # NeoX layout: dimension i pairs with i + D/2; (x_i + j x_{i+D/2}) is multiplied by e^(j theta_i).
    x = make((3, 2, 8), torch.float64, seed=6)
    cos, sin = angles(8, [0, 5, 300])
    half = x[..., :4] + 1j * x[..., 4:]
    rotated = half * torch.complex(cos.double(), sin.double())
    expected = torch.cat((rotated.real, rotated.imag), dim=-1)
    torch.testing.assert_close(reference.apply_rotary(x, cos, sin), expected)
    # Position 0 is the identity.
    assert torch.equal(reference.apply_rotary(x, cos, sin)[0], x[0])


def test_no_tokens_launches_nothing() -> None:
    cos, sin = angles(16, [])
    out = apply_rotary(torch.zeros(0, 2, 16, device=DEVICE), cos.to(DEVICE), sin.to(DEVICE))
    assert out.shape == (0, 2, 16)


@pytest.mark.parametrize(
    ("x", "cos", "message"),
    [
        (torch.zeros(2, 3, 7), torch.zeros(2, 1, 3), "even head_dim"),
        (torch.zeros(2, 24), torch.zeros(2, 1, 12), r"x must be \[num_tokens, num_heads, head_dim\]"),
        (torch.zeros(2, 3, 8), torch.zeros(3, 1, 4), r"cos must be \[2, 1, 4\] or \[2, 4\]"),
        (torch.zeros(2, 3, 8), torch.zeros(2, 3, 4), r"cos must be \[2, 1, 4\] or \[2, 4\]"),
        (torch.zeros(2, 3, 8), torch.zeros(2, 1, 4, dtype=torch.int64), "cos must be float32"),
        (torch.zeros(2, 3, 8, dtype=torch.int32), torch.zeros(2, 1, 4), "x must be float32"),
        (
            torch.zeros(2, 8, 3).transpose(1, 2),
            torch.zeros(2, 1, 4),
            "x must have a contiguous last dimension",
        ),
        (
            torch.zeros(2, 3, 8),
            torch.zeros(2, 4, 2)[:, :, :1].transpose(1, 2),
            "cos must have a contiguous last",
        ),
        (torch.zeros(2, 3, 8), torch.zeros(2, 1, 4, device="meta"), "one device"),
    ],
)
def test_wrapper_rejects_bad_arguments(x: torch.Tensor, cos: torch.Tensor, message: str) -> None:
    sin = torch.zeros(cos.shape, dtype=torch.float32, device=cos.device)
    with pytest.raises(ValueError, match=message):
        apply_rotary(x, cos, sin)


def test_wrapper_rejects_sin_unlike_cos() -> None:
    with pytest.raises(ValueError, match=r"sin must be \[2, 1, 4\]"):
        apply_rotary(torch.zeros(2, 3, 8), torch.zeros(2, 1, 4), torch.zeros(2, 1, 5))
