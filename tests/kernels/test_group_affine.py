"""The group-affine GEMM (GGUF blocks repacked at load): the C kernel (its AVX-512 and portable
versions) and the Triton kernel (Triton's interpreter without a GPU) against the torch reference,
which dequantizes and runs one dense GEMM. All in float32 with exact-ish operands, so the only
difference is the order of the sums."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvasir.kernels.cpu_ops import clear_cache
from kvasir.kernels.cpu_ops import group_affine as cpu
from kvasir.kernels.reference.group_affine import (
    GroupAffineWeight,
    dequantize,
    group_affine_linear,
    pack_codes,
    unpack_codes,
)
from kvasir.kernels.triton_ops.group_affine import group_affine_linear as triton_linear

LAYOUTS = [(4, 32), (8, 32), (8, 16)]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_weight(n: int, k: int, bits: int, group: int, seed: int) -> GroupAffineWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand((n, k // group), generator=g) * 0.02
    offset = torch.randn((n, k // group), generator=g) * 0.05
    return GroupAffineWeight(pack_codes(codes, bits, group), scale, offset, bits, group)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
def test_packing_round_trips_and_dequantizes_as_declared(bits: int, group: int) -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 2**bits, (6, 4 * group), generator=g, dtype=torch.uint8)
    weight = make_weight(6, 4 * group, bits, group, seed=1)
    weight = GroupAffineWeight(pack_codes(codes, bits, group), weight.scale, weight.offset, bits, group)
    assert torch.equal(unpack_codes(weight), codes)
    assert weight.codes.shape == (6, 4 * group * bits // 8)
    k = 3 * group + 5  # an element of the fourth group
    expected = weight.scale[2, 3] * codes[2, k].float() + weight.offset[2, 3]
    assert dequantize(weight)[2, k] == expected
    if bits == 4:  # byte j of a group: element j low, element j + group/2 high
        byte = weight.codes[2, 3 * group // 2 + 5].item()
        assert (byte & 0xF, byte >> 4) == (codes[2, k].item(), codes[2, k + group // 2].item())


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
@pytest.mark.parametrize(("rows", "groups"), [(1, 8), (5, 8), (16, 8), (64, 8), (7, 25)])
def test_cpu_kernel_matches_reference(bits: int, group: int, rows: int, groups: int) -> None:
    # 37 rows of W: a partial tile of four; 7 rows of x: a partial tile of four; 25 groups of 32:
    # K = 800, not a multiple of the kernel's 256-value chunk.
    if cpu.library() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built (the torch reference runs)")
    weight = make_weight(37, groups * group, bits, group, seed=rows)
    x = torch.randn(rows, groups * group, generator=torch.Generator().manual_seed(9))
    assert cpu.supports(x, weight)
    close(cpu.group_affine_linear(x, weight), group_affine_linear(x, weight))


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
def test_portable_c_version_matches_reference(bits: int, group: int) -> None:
    # On an AVX-512 machine the dispatcher never runs the portable loops; call them directly.
    library = cpu.library()
    if library is None:
        pytest.skip("no C compiler here: the CPU kernel is not built")
    weight = make_weight(19, 4 * group, bits, group, seed=3)
    x = torch.randn(3, 4 * group, generator=torch.Generator().manual_seed(4))
    sums = x.view(3, -1, group).sum(-1).contiguous()
    out = torch.empty(3, 19)
    function = library.group_affine_gemm_portable
    function.argtypes = [ctypes.c_int] * 2 + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    function(bits, group, x.data_ptr(), sums.data_ptr(), weight.codes.data_ptr(), weight.scale.data_ptr(),
             weight.offset.data_ptr(), out.data_ptr(), 3, 19, 4 * group, 1)  # fmt: skip
    close(out, group_affine_linear(x, weight))


def test_cpu_kernel_declines_what_it_does_not_take() -> None:
    weight = make_weight(8, 64, 4, 32, seed=0)
    assert not cpu.supports(torch.randn(2, 64, dtype=torch.bfloat16), weight)
    assert not cpu.supports(torch.randn(cpu.max_rows() + 1, 64), weight)  # prefill: the reference


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
@pytest.mark.parametrize(("rows", "n", "groups"), [(1, 40, 3), (7, 33, 2), (20, 64, 4)])
def test_triton_kernel_matches_reference(bits: int, group: int, rows: int, n: int, groups: int) -> None:
    # Shapes cover partial tiles on every axis (rows and n not multiples of the tiles, K not of 32
    # for group 16 with an odd group count).
    k = groups * group
    weight = make_weight(n, k, bits, group, seed=n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = triton_linear(x.to(DEVICE), weight.to(DEVICE))
    assert got.shape == (rows, n) and got.dtype == torch.float32
    close(got, group_affine_linear(x, weight))


def test_triton_wrapper_names_the_bad_argument() -> None:
    weight = make_weight(8, 64, 4, 32, seed=0)
    with pytest.raises(ValueError, match="x has 32 features, the weight takes 64"):
        triton_linear(torch.randn(2, 32, device=DEVICE), weight.to(DEVICE))
    with pytest.raises(ValueError, match="x must be float32, float16 or bfloat16"):
        triton_linear(torch.ones(2, 64, dtype=torch.int32, device=DEVICE), weight.to(DEVICE))


def test_without_a_usable_cache_folder_the_reference_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvasir.kernels.group_affine import group_affine_linear as dispatched

    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no-such-folder")
    clear_cache()
    try:
        weight = make_weight(8, 64, 4, 32, seed=0)
        x = torch.randn(2, 64)
        assert cpu.library() is None and not cpu.supports(x, weight)
        assert "CPU kernels unavailable" in caplog.text
        torch.testing.assert_close(dispatched(x, weight), group_affine_linear(x, weight))
    finally:
        clear_cache()  # the next test builds (or finds) the library again
