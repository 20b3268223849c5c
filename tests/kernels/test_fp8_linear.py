"""FP8 linear layers: the per-token quantizer (Triton against torch), the Triton FP8 GEMM against
the exact scaled product, and the GPU path (`scaled_mm_linear`: Triton GEMM for decode batches,
`torch._scaled_mm` beyond) against the float32 reference.

`torch._scaled_mm` also runs on CPU (slowly), so the GPU's code path is checked here on the very
operands it receives. On CPU the Triton quantizer runs in the interpreter, whose e4m3 rounding
differs from torch's in known ways (see `assert_interpreter_rounding`): the GEMM is then checked
on the interpreter's operands, the quantizer separately.
"""

from __future__ import annotations

import pytest
import torch

from kvasir.kernels.fp8_linear import scaled_mm_linear
from kvasir.kernels.reference.fp8_linear import FP8_DTYPE, MIN_SCALE, fp8_linear, quantize_per_token
from kvasir.kernels.triton_ops.fp8_gemm import fp8_gemm
from kvasir.kernels.triton_ops.fp8_quant import quantize_per_token as triton_quantize_per_token
from tests.kernels.test_kv_fp8 import assert_interpreter_rounding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]).bfloat16()  # rows of any size
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
    w_scale = torch.rand(n, generator=g) * 1e-3 + 1e-4
    return x, w, w_scale


@pytest.mark.parametrize(("m", "k"), [(1, 64), (7, 100), (4, 4096), (2, 20000)])
def test_per_token_quantizer_matches_reference(m: int, k: int) -> None:
    # 20000 columns is longer than one program keeps in registers: the two-pass path.
    x, _, _ = make(m, k, 16, seed=k)
    q, scale = triton_quantize_per_token(x.to(DEVICE))
    q_ref, scale_ref = quantize_per_token(x)
    torch.testing.assert_close(scale.cpu(), scale_ref, rtol=0, atol=0)
    if DEVICE.type == "cuda":
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    else:
        assert_interpreter_rounding(q.float(), q_ref.float())


def test_an_all_zero_row_gets_the_floor_scale() -> None:
    q, scale = triton_quantize_per_token(torch.zeros(2, 32, dtype=torch.bfloat16, device=DEVICE))
    assert scale.cpu().eq(MIN_SCALE).all() and q.float().eq(0).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_scaled_mm_path_matches_reference(bias: bool, static: bool) -> None:
    x, w, w_scale = make(5, 64, 48, seed=int(bias) + 2 * int(static))
    b = torch.randn(48, generator=torch.Generator().manual_seed(9)).bfloat16() if bias else None
    input_scale = torch.tensor(0.02) if static else None
    args = [t if t is None else t.to(DEVICE) for t in (x, w, w_scale, input_scale, b)]
    actual = scaled_mm_linear(*args).cpu()  # type: ignore[arg-type]
    if static or DEVICE.type == "cuda":
        expected = fp8_linear(x, w, w_scale, input_scale, b)
    else:  # the interpreter's activations, through the reference's arithmetic
        xq, x_scale = triton_quantize_per_token(x)
        expected = (
            (xq.float() * x_scale) @ (w.float() * w_scale[:, None]).t() + (b.float() if b is not None else 0)
        ).bfloat16()
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=1e-2, atol=1e-2 * float(expected.float().abs().max())
    )


def test_reference_quantizes_activations_per_token() -> None:
    # Against a float computation of the same function: per-row e4m3 rounding of x.
    x, w, w_scale = make(6, 32, 16, seed=4)
    amax = x.float().abs().amax(dim=1, keepdim=True)
    xq = (x.float() / (amax / 448)).to(FP8_DTYPE).float() * (amax / 448)
    expected = xq @ (w.float() * w_scale[:, None]).t()
    torch.testing.assert_close(fp8_linear(x, w, w_scale, None, None).float(), expected, rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 128, 48), (20, 96, 40), (64, 256, 96), (5, 200, 33)])
def test_triton_fp8_gemm_matches_the_scaled_product(m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m + k + n)
    a = (torch.randn(m, k, generator=g) * 50).clamp(-448, 448).to(FP8_DTYPE)
    b = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(FP8_DTYPE)
    a_scale, b_scale = torch.rand(m, 1, generator=g) * 1e-2, torch.rand(1, n, generator=g) * 1e-2
    actual = fp8_gemm(*(t.to(DEVICE) for t in (a, b, a_scale, b_scale)))
    a_scaled, b_scaled = a.double() * a_scale.double(), b.double() * b_scale.double().t()
    expected = a_scaled @ b_scaled.t()
    assert actual.dtype == torch.bfloat16
    # One bfloat16 rounding of the result (a whole ulp, 2^-7: the interpreter truncates), plus the
    # accumulation's error, bounded by the sum of |products|: Hopper's FP8 tensor cores add with
    # fewer than float32's bits (about 14, DeepSeek-V3 measured), which an H200 run showed here at
    # 1e-3 of the largest output for K=256 where outputs nearly cancel.
    magnitude = a_scaled.abs() @ b_scaled.abs().t()
    error = (actual.cpu().double() - expected).abs()
    assert (error <= 2**-7 * expected.abs() + 2**-10 * magnitude).all()
