"""The group-affine GEMM (GGUF blocks repacked at load): the C kernel (its vector and portable
versions, on the tiled layout, with float and with int8 activations) and the Triton kernel
(Triton's interpreter without a GPU) against their torch twins: the dequantized weight's GEMM, and
the same after rounding x to int8 as the kernel does. All in float32, so the only difference is
the order of the sums."""

from __future__ import annotations

import pytest
import torch

from kvasir.kernels.cpu_ops import clear_cache, group_affine_layout
from kvasir.kernels.cpu_ops import group_affine as cpu
from kvasir.kernels.cpu_ops.group_affine_layout import TILE, tile, tiled_rows, untile
from kvasir.kernels.reference.group_affine import (
    GroupAffineWeight,
    dequantize,
    group_affine_linear,
    group_affine_linear_int,
    pack_codes,
    round_activations,
    unpack_codes,
)
from kvasir.kernels.triton_ops.group_affine import group_affine_linear as triton_linear

# (5, 32): an 8-bit weight whose codes fit in five bits (Q5_0, Q5_1, Q5_K), which `tile` narrows.
LAYOUTS = [(4, 32), (8, 32), (8, 16), (5, 32)]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The C code's versions this CPU can run: the best (AVX512-VNNI here), AVX-VNNI (Intel client CPUs)
# and AVX2 (Zen 2/3, most laptops; every x86-64 build carries both) and the portable loops (any
# other CPU).
KERNELS = [kernel for kernel in cpu.KERNELS if cpu.runs_here(kernel)]


def make_weight(n: int, k: int, bits: int, group: int, seed: int) -> GroupAffineWeight:
    """Random codes of `bits` bits; 5-bit ones stored row-major in 8 bits, as the GGUF types are."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand((n, k // group), generator=g) * 0.02
    offset = torch.randn((n, k // group), generator=g) * 0.05
    stored = 8 if bits == 5 else bits
    return GroupAffineWeight(pack_codes(codes, stored, group), scale, offset, stored, group)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
def test_packing_round_trips_and_dequantizes_as_declared(bits: int, group: int) -> None:
    bits = 8 if bits == 5 else bits  # 5-bit codes exist only tiled
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
def test_tiled_layout_round_trips_and_looks_up_rows(bits: int, group: int) -> None:
    # 37 rows: two whole tiles of 16 and a partial one, padded with zero codes.
    weight = half_exact(make_weight(37, 4 * group, bits, group, seed=2))
    tiled = tile(weight)
    assert tiled.scale.dtype == torch.float16 and tiled.bits == bits
    assert tiled.codes.shape == (3, 4 * group * TILE * bits // 8)
    back = untile(tiled)
    assert torch.equal(back.codes, weight.codes) and torch.equal(back.scale, weight.scale)
    assert torch.equal(back.offset, weight.offset)
    rows = torch.tensor([36, 0, 17, 17])
    torch.testing.assert_close(dequantize(tiled_rows(tiled, rows)), dequantize(weight)[rows], rtol=0, atol=0)
    # Lane r of quad q of group g holds codes g*G + 4q .. 4q+3 of row 16t + r (4-bit: quad c in the
    # low nibbles of chunk c, quad c + G/8 in the high ones).
    codes = unpack_codes(weight)
    group_bytes = TILE * group * bits // 8
    stored = tiled.codes[1].view(4, group_bytes)[2]  # tile 1, group 2
    lane = stored[: 64 * (group // 4 if bits == 8 else group // 8)].view(-1, TILE, 4)[1, 3]  # chunk 1, row 19
    if bits == 8:
        assert lane.tolist() == codes[19, 2 * group + 4 : 2 * group + 8].tolist()
    else:
        assert (lane & 0x0F).tolist() == (codes[19, 2 * group + 4 : 2 * group + 8] & 0x0F).tolist()
        high = 2 * group + group // 2 + 4
        assert (lane >> 4).tolist() == (codes[19, high : high + 4] & 0x0F).tolist()
    if bits == 5:  # plane byte (row 19, byte b): bit q is the fifth bit of code 4q + b
        plane = stored[-64:].view(TILE, 4)[3]
        for b in range(4):
            fifth = [(codes[19, 2 * group + 4 * q + b].item() >> 4) for q in range(group // 4)]
            assert plane[b].item() == sum(bit << q for q, bit in enumerate(fifth))


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
def test_tiled_layout_built_in_passes_equals_one_pass(
    bits: int, group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `tile` lays a large weight out a few tiles at a time (its load-time peak): with passes of two
    # tiles, 37 rows take two passes, the second ending in the partial tile, and give the same bytes.
    weight = make_weight(37, 4 * group, bits, group, seed=5)
    whole = tile(weight)
    monkeypatch.setattr(group_affine_layout, "CHUNK_TILES", 2)
    passes = tile(weight)
    assert passes.bits == whole.bits == bits
    for name in ("codes", "scale", "offset"):
        assert torch.equal(getattr(passes, name), getattr(whole, name)), name


def test_activation_rounding_is_int8_or_int16_per_block_of_32() -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    x[1, 32:] = 0.0  # an all-zero block stays zero
    rounded = round_activations(x, 8)
    step = x.view(3, 2, 32).abs().amax(-1, keepdim=True) / 127
    q = (rounded.view(3, 2, 32) / step.clamp_min(1e-30)).nan_to_num()
    torch.testing.assert_close(q, q.round(), rtol=0, atol=1e-4)
    assert q.round().abs().max() == 127 and torch.equal(rounded[1, 32:], x[1, 32:])
    assert ((rounded - x).view(3, 2, 32).abs() <= step / 2 * (1 + 1e-6)).all()
    # 16 bits: integer multiples of step / 254, within half of that (and a float32 rounding) of x.
    fine = round_activations(x, 16).view(3, 2, 32)
    units = (fine / (step / 254).clamp_min(1e-30)).nan_to_num()
    torch.testing.assert_close(units, units.round(), rtol=0, atol=5e-3)
    assert ((fine - x.view(3, 2, 32)).abs() <= step / 254 * 0.51 + 1e-7).all()


def half_exact(weight: GroupAffineWeight) -> GroupAffineWeight:
    """The weight with scales and offsets exact in float16 (as Q4_0/Q4_1/Q8_0 have them), some of
    them float16 subnormals, so the kernel keeps them as float16."""
    scale, offset = weight.scale.half().float(), weight.offset.half().float()
    scale[0, 0], offset[-1, -1] = 2.0**-20, -(2.0**-24)
    return GroupAffineWeight(weight.codes, scale, offset, weight.bits, weight.group)


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
@pytest.mark.parametrize("activation_bits", [0, 8, 16])
@pytest.mark.parametrize("scales", ["float32", "float16"])
@pytest.mark.parametrize(("rows", "groups"), [(1, 8), (5, 8), (9, 8), (64, 8), (7, 25), (131, 2)])
def test_cpu_kernel_matches_its_twin(
    bits: int, group: int, activation_bits: int, scales: str, rows: int, groups: int
) -> None:
    # 37 rows of W: a partial tile of 16; 5, 9, 7 and 131 rows of x: partial blocks of eight (131:
    # three sweeps of at most 64 rows); 25 groups
    # of 16 are not whole blocks of 32, which integer activations need (the C kernel declines those).
    if cpu.library() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built (the torch reference runs)")
    weight = make_weight(37, groups * group, bits, group, seed=rows)
    if scales == "float16":
        weight = half_exact(weight)
    assert tile(weight).scale.dtype == getattr(torch, scales)
    x = torch.randn(rows, groups * group, generator=torch.Generator().manual_seed(9))
    if activation_bits and x.shape[-1] % 32:
        assert not cpu.supports(x, tile(weight), activation_bits)
        return
    expected = (
        group_affine_linear_int(x, weight, activation_bits)
        if activation_bits
        else group_affine_linear(x, weight)
    )
    for kernel in KERNELS:  # the best here, and the versions other CPUs run
        close(cpu.tiled_linear(x, tile(weight), activation_bits, kernel=kernel), expected)


@pytest.mark.parametrize("activation_bits", [8, 16])
def test_int_twin_differs_from_the_exact_product_by_the_rounding_only(activation_bits: int) -> None:
    # The twin is not a copy of the kernel's mistakes: its error against the exact product is the
    # one the rounding of x explains, |W| |x - x^|, and no more.
    weight = make_weight(64, 256, 4, 32, seed=5)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(6))
    w = dequantize(weight).double()
    got = group_affine_linear_int(x, weight, activation_bits).double()
    error = (got - torch.nn.functional.linear(x.double(), w)).abs()
    bound = torch.nn.functional.linear((x - round_activations(x, activation_bits)).abs().double(), w.abs())
    assert (error <= bound * 1.001 + 1e-5).all()
    assert error.max() > (1e-4 if activation_bits == 8 else 1e-6)  # it does round


def test_cpu_kernel_declines_what_it_does_not_take() -> None:
    tiled = tile(make_weight(8, 64, 4, 32, seed=0))
    assert not cpu.supports(torch.randn(2, 64, dtype=torch.bfloat16), tiled, 0)

    assert not cpu.supports(torch.randn(2, 64), tiled, 4)
    if cpu.library() is not None:
        with pytest.raises(ValueError, match="x has 32 features, the weight takes 64"):
            cpu.tiled_linear(torch.randn(2, 32), tiled, 8)


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
    from kvasir.kernels.group_affine import tiles_on

    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no-such-folder")
    clear_cache()
    try:
        weight = make_weight(8, 64, 4, 32, seed=0)
        x = torch.randn(2, 64)
        assert cpu.library() is None and not tiles_on(torch.device("cpu"), 4, 32)
        assert "CPU kernels unavailable" in caplog.text
        torch.testing.assert_close(dispatched(x, weight), group_affine_linear(x, weight))
    finally:
        clear_cache()  # the next test builds (or finds) the library again


@pytest.mark.parametrize("activation_bits", [8, 16])
def test_vector_and_portable_versions_round_activations_alike(activation_bits: int) -> None:
    # One group of 32 and no offsets: y = isum * (scale * step) rounded once in both versions, so
    # any difference in the rounded activations would show as a difference in y.
    if cpu.library() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built")
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (48, 32), generator=g, dtype=torch.uint8)
    weight = GroupAffineWeight(
        pack_codes(codes, 8, 32), torch.rand(48, 1, generator=g), torch.zeros(48, 1), 8, 32
    )
    x = torch.randn(64, 32, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    vector = cpu.tiled_linear(x, tile(weight), activation_bits)
    for kernel in KERNELS:
        assert torch.equal(vector, cpu.tiled_linear(x, tile(weight), activation_bits, kernel=kernel))


@pytest.mark.parametrize("kernel", ["avx2", "avx_vnni"])
@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("rows", [1, 2, 3, 67])
def test_256_bit_versions_equal_the_best_bit_for_bit(
    kernel: str, bits: int, group: int, activation_bits: int, rows: int
) -> None:
    # The AVX2 and AVX-VNNI kernels sum the same integers (AVX2: one int16 activation for both
    # limbs) and scale them with the same operations in the same order as the AVX512-VNNI kernel:
    # equal results, not close ones. 37 rows of W end in a partial tile; 67 rows of x cross a
    # 64-row sweep and end in an odd row; float16 scales (the half path) in every case.
    if not cpu.runs_here(kernel) or cpu.kernel_isa() != "AVX512-VNNI":
        pytest.skip(f"needs a CPU with both {kernel} and AVX512-VNNI to compare them")
    weight = half_exact(make_weight(37, 8 * group, bits, group, seed=rows))
    x = torch.randn(rows, 8 * group, generator=torch.Generator().manual_seed(rows))
    best = cpu.tiled_linear(x, tile(weight), activation_bits)
    assert torch.equal(cpu.tiled_linear(x, tile(weight), activation_bits, kernel=kernel), best)


def test_kernel_versions_are_named() -> None:
    if cpu.library() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built")
    assert cpu.kernel_isa() in cpu.KERNEL_ISAS.values()
    with pytest.raises(ValueError, match="kernel must be one of"):
        cpu.TiledGemm(tile(make_weight(8, 64, 4, 32, seed=0)), 8, kernel="neon")


@pytest.mark.parametrize("activation_bits", [0, 8, 16])
def test_a_row_with_nan_or_infinity_stays_non_finite_as_in_the_twin(activation_bits: int) -> None:
    # Rounding must not hide a broken activation: the twin's row is NaN or infinite, so is the
    # kernel's (with integer activations every value of such a row is NaN).
    if cpu.library() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built")
    weight = make_weight(20, 64, 4, 32, seed=1)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    x[0, 5], x[2, 40] = float("nan"), float("inf")
    twin = (
        group_affine_linear_int(x, weight, activation_bits)
        if activation_bits
        else group_affine_linear(x, weight)
    )
    for kernel in KERNELS:
        got = cpu.tiled_linear(x, tile(weight), activation_bits, kernel=kernel)
        assert not got[[0, 2]].isfinite().any() and not twin[[0, 2]].isfinite().any()
        close(got[1:2], twin[1:2])


@pytest.mark.parametrize("activation_bits", [8, 16])
def test_kernel_rounds_activations_bit_for_bit_as_the_twin(activation_bits: int) -> None:
    # W = identity (8-bit code 1 on the diagonal, scale 1, offset 0): y = isum * step is the
    # rounded x itself, one float32 rounding in both, so any difference in rounding shows exactly.
    # Rows include exact ties (amax 127: x * 127 / amax = x) and magnitudes from 1e-3 to 1e3.
    if cpu.library() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built")
    k = 64
    identity = torch.eye(k, dtype=torch.uint8)
    weight = GroupAffineWeight(pack_codes(identity, 8, 32), torch.ones(k, 2), torch.zeros(k, 2), 8, 32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, k, generator=g) * torch.logspace(-3, 3, 200)[:, None]
    ties = torch.arange(-31, 33, dtype=torch.float32) + 0.5
    x[0] = ties.clamp(-127, 127)
    x[0, 31], x[0, 63] = 127.0, 127.0  # amax 127 in both blocks: every .5 is a tie
    expected = round_activations(x, activation_bits)
    for kernel in KERNELS:
        assert torch.equal(cpu.tiled_linear(x, tile(weight), activation_bits, kernel=kernel), expected)
