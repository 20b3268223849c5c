"""The CPU C RMSNorm (`kvasir.kernels.cpu_ops.rms_norm`) against the torch reference.

The kernel sums the squares in another order than torch: a few float32 ulps of the mean square,
so outputs agree within 8 ulps; the residual sum is one float32 add in both, so it is exact.
"""

from __future__ import annotations

import pytest
import torch

from kvasir.kernels import norm as dispatched
from kvasir.kernels.cpu_ops import rms_norm as cpu
from kvasir.kernels.reference import norm as reference

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler: the CPU kernels are not built")

RTOL = 8 * torch.finfo(torch.float32).eps
EPS = 1e-5


def make(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("shape", [(1, 576), (5, 100), (3, 7), (2, 3, 64), (9, 1), (0, 64)])
def test_rms_norm_matches_reference(shape: tuple[int, ...]) -> None:
    x, w = make(*shape, seed=1), 1 + 0.5 * make(shape[-1], seed=2)
    out = cpu.rms_norm(x, w, EPS)
    torch.testing.assert_close(out, reference.rms_norm(x, w, EPS), rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("shape", [(1, 576), (4, 100), (2, 3, 64)])
def test_fused_add_matches_reference(shape: tuple[int, ...]) -> None:
    x, residual, w = make(*shape, seed=3), make(*shape, seed=4), 1 + 0.5 * make(shape[-1], seed=5)
    out, summed = cpu.fused_add_rms_norm(x, residual, w, EPS)
    expected_out, expected_sum = reference.fused_add_rms_norm(x, residual, w, EPS)
    torch.testing.assert_close(summed, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, expected_out, rtol=RTOL, atol=1e-7)


def test_strided_rows_are_read_in_place() -> None:
    """The model hands views (a residual that is a slice of a wider buffer): rows a stride apart."""
    wide = make(3, 80, seed=6)
    x, residual, w = make(3, 64, seed=7), wide[:, 8:72], torch.ones(64)
    out, summed = cpu.fused_add_rms_norm(x, residual, w, EPS)
    expected_out, expected_sum = reference.fused_add_rms_norm(x, residual, w, EPS)
    torch.testing.assert_close(summed, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, expected_out, rtol=RTOL, atol=1e-7)


def test_float32_on_cpu_dispatches_to_the_kernel_and_others_to_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVASIR_KERNELS", "torch")
    calls: list[str] = []
    real_launch = cpu.launch
    monkeypatch.setattr(cpu, "launch", lambda *args: calls.append("cpu") or real_launch(*args))
    dispatched.rms_norm(make(2, 8, seed=8), torch.ones(8), EPS)
    dispatched.rms_norm(make(2, 8, seed=8).double(), torch.ones(8, dtype=torch.float64), EPS)
    dispatched.fused_add_rms_norm(make(2, 8, seed=8), make(2, 8, seed=7), torch.ones(8), EPS)
    assert calls == ["cpu", "cpu"]


def test_mismatched_residual_is_rejected() -> None:
    with pytest.raises(ValueError, match="residual must match x"):
        cpu.fused_add_rms_norm(make(2, 8, seed=9), make(3, 8, seed=9), torch.ones(8), EPS)
    assert not cpu.supports(make(2, 8, seed=9), torch.ones(9))
