"""The int4 matmul: Triton kernel (GEMV rows and tl.dot tiles) against its torch reference, the
reference against float64 arithmetic, and torch's packed CPU kernel against the same weights.

Without a GPU the Triton kernel runs in Triton's interpreter (tests/conftest.py), with small tiles
and K split in two, so both the split and the masked edges are exercised. Tolerances: float32 sums
in another order (1e-5 relative); bfloat16/float16 activations round the dequantized weight once
(reference) or not at all (the GEMV kernel): a few 1e-3 relative of the output's norm.
"""

from __future__ import annotations

import pytest
import torch

from kvasir.kernels.int4_matmul import (
    cpu_group_size,
    int4_matmul_cpu,
    pack_for_cpu,
    pack_for_kernels,
)
from kvasir.kernels.reference.int4_matmul import dequantize_int4
from kvasir.kernels.reference.int4_matmul import int4_matmul as reference_int4_matmul
from kvasir.kernels.triton_ops.int4_matmul import block_k_for
from kvasir.kernels.triton_ops.int4_matmul import dequantize as triton_dequantize
from kvasir.kernels.triton_ops.int4_matmul import int4_matmul as triton_int4_matmul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def weight(n: int, k: int, group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K], scales [N, G], zeros uint8 [N, G]) drawn from a seed; zeros up to 16
    (GPTQ's original format reaches 16)."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=g) * 0.05 + 0.005
    zeros = torch.randint(0, 17, (n, groups), generator=g, dtype=torch.uint8)
    return codes, scales, zeros


def exact(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    groups = torch.arange(codes.shape[1]) // group_size
    w = (codes.double() - zeros.double()[:, groups]) * scales.double()[:, groups]
    return x.double() @ w.t()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double().cpu() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("m", "k", "n", "group_size"),
    [
        (1, 128, 64, 32),  # GEMV, two groups per K tile split
        (3, 96, 40, 32),  # GEMV rows; N not a multiple of the tile
        (5, 128, 64, 64),  # tl.dot, M masked
        (20, 160, 96, 32),  # tl.dot, several M tiles
        (2, 120, 64, 48),  # a partial last group (GPTQ with K % group_size != 0)
        (1, 64, 64, 64),  # one group over all of K (-1 in a checkpoint)
    ],
)
def test_triton_matches_reference(dtype: torch.dtype, m: int, k: int, n: int, group_size: int) -> None:
    codes, scales, zeros = weight(n, k, group_size, seed=m * k + n)
    qweight, s, z = pack_for_kernels(codes, scales, zeros, dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = reference_int4_matmul(x, qweight, s, z, group_size)
    actual = triton_int4_matmul(x.to(DEVICE), qweight.to(DEVICE), s.to(DEVICE), z.to(DEVICE), group_size)
    assert actual.dtype == dtype and actual.shape == (m, n)
    assert relative_error(actual, expected.float()) < RTOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_dequantize_matches_reference(dtype: torch.dtype) -> None:
    # The long-prompt path: the weight dequantized once, then a dense GEMM.
    codes, scales, zeros = weight(72, 96, 32, seed=5)
    packed = pack_for_kernels(codes, scales, zeros, dtype)
    expected = dequantize_int4(*packed, 32)
    actual = triton_dequantize(*(t.to(DEVICE) for t in packed), 32)
    torch.testing.assert_close(actual.cpu().float(), expected.float(), rtol=torch.finfo(dtype).eps, atol=0)


def test_reference_is_the_dequantized_product() -> None:
    codes, scales, zeros = weight(48, 96, 32, seed=0)
    qweight, s, z = pack_for_kernels(codes, scales, zeros, torch.float32)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(2))
    assert (
        relative_error(reference_int4_matmul(x, qweight, s, z, 32), exact(x, codes, scales, zeros, 32)) < 1e-6
    )
    # the packed layout: eight consecutive input rows per word
    assert torch.equal(
        dequantize_int4(qweight, s, z, 32), exact(torch.eye(96), codes, scales, zeros, 32).float()
    )


@pytest.mark.parametrize(("k", "group_size"), [(128, 32), (128, 64), (256, 128), (512, 256), (1024, 1024)])
def test_torch_cpu_kernel_runs_the_same_weight(k: int, group_size: int) -> None:
    # 1024 is a group larger than the CPU kernel's 256: run as four groups sharing one scale.
    codes, scales, zeros = weight(64, k, group_size, seed=k)
    packed, scale_and_zero, kernel_group = pack_for_cpu(codes, scales, zeros, group_size)
    assert kernel_group == min(group_size, 256)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    actual = int4_matmul_cpu(x, packed, scale_and_zero, kernel_group)
    assert actual.dtype == torch.float32
    # bfloat16 inside: activations and scales rounded to 8 bits of mantissa
    assert relative_error(actual, exact(x, codes, scales, zeros, group_size)) < 1e-2


def test_group_sizes_each_backend_can_tile() -> None:
    assert [cpu_group_size(g) for g in (32, 64, 128, 256, 512, 4096, 16, 48)] == [
        32,
        64,
        128,
        256,
        256,
        256,
        None,
        None,
    ]
    assert [block_k_for(g) for g in (16, 32, 48, 128, 4096, 8)] == [16, 32, 16, 128, 128, None]
    with pytest.raises(ValueError, match="cannot run groups of 16"):
        pack_for_cpu(*weight(8, 64, 16, seed=0), 16)


def test_bad_arguments_are_named() -> None:
    codes, scales, zeros = weight(16, 64, 32, seed=0)
    qweight, s, z = pack_for_kernels(codes, scales, zeros, torch.float32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="qweight must be int32"):
        reference_int4_matmul(torch.randn(2, 32), qweight, s, z, 32)
    with pytest.raises(ValueError, match="scales must be"):
        reference_int4_matmul(x, qweight, s[:1], z, 32)
    with pytest.raises(ValueError, match="zeros must have x's dtype"):
        reference_int4_matmul(x, qweight, s, z.half(), 32)
    with pytest.raises(ValueError, match="in_features divisible by 8"):
        pack_for_kernels(codes[:, :12], scales[:, :1], zeros[:, :1], torch.float32)
