"""AWQ, GPTQ and FP8 checkpoint tensors read into Kvasir's forms, against the formats' published
packing and readers (tests/quantized_checkpoints.py, element by element over numpy words)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvasir.kernels.int4_packing import pack_int32, unpack_int32
from kvasir.runtime.layers.quantization.awq import AwqConfig, awq_to_int4
from kvasir.runtime.layers.quantization.fp8 import (
    FP8_DTYPE,
    Fp8Config,
    fp8_from_checkpoint,
    quantize_weight,
)
from kvasir.runtime.layers.quantization.fp8 import stack_outputs as stack_fp8
from kvasir.runtime.layers.quantization.gptq import GptqConfig, gptq_to_int4
from kvasir.runtime.layers.quantization.int4 import stack_outputs
from tests.quantized_checkpoints import (
    act_order_g_idx,
    dequantize_awq,
    dequantize_gptq,
    fp8_config,
    pack_awq,
    pack_gptq,
    quantize_fp8,
    quantize_rtn,
)


def random_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


def rtn(weight: torch.Tensor, group_size: int, sym: bool = False, act_order: bool = False, seed: int = 0):
    in_features = weight.shape[1]
    g_idx = (
        act_order_g_idx(in_features, group_size, seed) if act_order else np.arange(in_features) // group_size
    )
    num_groups = -(-in_features // group_size)
    return (*quantize_rtn(weight, g_idx, num_groups, sym), g_idx)


# --- the published bit layouts, by hand -----------------------------------------------------------


def test_awq_word_layout_is_the_interleaved_order() -> None:
    # Columns 0..7 holding their own index: AutoAWQ puts even columns in fields 0-3, odd in 4-7.
    codes = np.arange(8)[:, None]  # [out=8, in=1]: output column n holds n
    packed = pack_awq(codes, np.zeros((8, 1), dtype=np.int64), np.ones((8, 1), dtype=np.float16))
    assert packed["qweight"].item() & 0xFFFFFFFF == 0x75316420
    int4 = awq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], group_size=1)
    assert int4.codes[:, 0].tolist() == list(range(8))


def test_gptq_word_layout_is_sequential_over_inputs() -> None:
    codes = np.arange(8)[None, :].repeat(8, axis=0)  # [out=8, in=8]: input row k holds k
    g_idx = np.zeros(8, dtype=np.int32)
    packed = pack_gptq(codes, np.full((8, 1), 8), np.ones((8, 1), dtype=np.float16), g_idx, v1=True)
    assert (packed["qweight"] & 0xFFFFFFFF == 0x76543210).all()
    assert packed["qzeros"].item() & 0xFFFFFFFF == 0x77777777  # the original format stores zero - 1
    int4 = gptq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 8, 1)
    assert int4.codes[0].tolist() == list(range(8)) and int4.zeros.unique().tolist() == [8]


def test_pack_and_unpack_invert_each_other_in_any_order_and_dimension() -> None:
    codes = torch.randint(0, 16, (16, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for dim, values in ((1, codes), (0, codes.t().contiguous())):
        for order in (None, (0, 2, 4, 6, 1, 3, 5, 7), (7, 6, 5, 4, 3, 2, 1, 0)):
            assert torch.equal(unpack_int32(pack_int32(values, dim, order), dim, order), values)


# --- AWQ and GPTQ against their published readers -------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 64, -1])
def test_awq_dequantizes_as_autoawq_reads_it(group_size: int) -> None:
    weight = random_weight(48, 128, seed=group_size)
    size = 128 if group_size == -1 else group_size
    codes, zeros, scales, _ = rtn(weight, size)
    packed = pack_awq(codes, zeros, scales)
    int4 = awq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], group_size)
    torch.testing.assert_close(int4.dequantize(torch.float64), dequantize_awq(packed, size), rtol=0, atol=0)
    assert int4.input_perm is None and int4.group_size == size
    # and the quantization itself is sane: within half a step of the float weight
    step = torch.from_numpy(scales.astype(np.float64)).repeat_interleave(size, dim=1)
    assert ((int4.dequantize(torch.float64) - weight.double()).abs() <= step * 0.5 + 1e-3).all()


@pytest.mark.parametrize(
    ("group_size", "sym", "act_order", "v1"),
    [
        (32, True, False, True),
        (32, False, False, True),
        (64, False, True, True),
        (32, True, True, False),
        (-1, False, False, False),
        (48, False, False, True),  # a partial last group (120 inputs in groups of 48)
    ],
)
def test_gptq_dequantizes_as_autogptq_reads_it(group_size: int, sym: bool, act_order: bool, v1: bool) -> None:
    in_features = 120 if group_size == 48 else 128
    weight = random_weight(40, in_features, seed=7)
    size = in_features if group_size == -1 else group_size
    codes, zeros, scales, g_idx = rtn(weight, size, sym=sym, act_order=act_order, seed=3)
    packed = pack_gptq(codes, zeros, scales, g_idx, v1=v1)
    int4 = gptq_to_int4(
        packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], group_size, int(v1)
    )
    torch.testing.assert_close(int4.dequantize(torch.float64), dequantize_gptq(packed, v1), rtol=0, atol=0)
    assert (int4.input_perm is not None) == act_order
    if act_order:  # the permutation makes every group a run of group_size columns
        groups = torch.from_numpy(g_idx).long()[int4.input_perm]
        assert torch.equal(groups, torch.arange(in_features) // size)


def test_gptq_v1_zero_point_overflow_reads_as_sixteen() -> None:
    # A zero point of 0 is stored as (0 - 1) & 0xF = 15 in the original format, and its readers add
    # one back: 16. That is what such a checkpoint means; reading it as 0 would shift the weights.
    codes = np.full((8, 8), 3)
    packed = pack_gptq(
        codes,
        np.zeros((8, 1), dtype=np.int64),
        np.ones((8, 1), dtype=np.float16),
        np.zeros(8, dtype=np.int32),
        v1=True,
    )
    int4 = gptq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 8, 1)
    assert int4.zeros.unique().tolist() == [16]
    assert torch.equal(int4.dequantize(), torch.full((8, 8), 3.0 - 16.0))
    torch.testing.assert_close(int4.dequantize(torch.float64), dequantize_gptq(packed, True), rtol=0, atol=0)


def test_gptq_without_g_idx_uses_consecutive_groups() -> None:
    weight = random_weight(16, 64, seed=2)
    codes, zeros, scales, g_idx = rtn(weight, 32)
    packed = pack_gptq(codes, zeros, scales, g_idx, v1=True)
    with_idx = gptq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 32, 1)
    without = gptq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], None, 32, 1)
    assert torch.equal(with_idx.dequantize(), without.dequantize())


def test_stacked_projections_dequantize_to_the_stacked_weights() -> None:
    parts = []
    for seed, rows in enumerate((16, 8, 8)):
        codes, zeros, scales, _ = rtn(random_weight(rows, 64, seed), 32)
        packed = pack_awq(codes, zeros, scales)
        parts.append(awq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], 32))
    stacked = stack_outputs(parts)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_stacking_refuses_act_order_parts_with_different_input_orders() -> None:
    parts = []
    for seed in (1, 2):
        codes, zeros, scales, g_idx = rtn(random_weight(8, 64, 0), 32, act_order=True, seed=seed)
        packed = pack_gptq(codes, zeros, scales, g_idx, v1=True)
        parts.append(
            gptq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 32, 1)
        )
    with pytest.raises(ValueError, match="input order"):
        stack_outputs(parts)


@pytest.mark.parametrize(
    ("tensor", "change", "message"),
    [
        ("qzeros", lambda t: t[:-1], "qzeros must be"),
        ("scales", lambda t: t[:, :-1], "scales must be"),
        ("qweight", lambda t: t.float(), "must be int32"),
    ],
)
def test_awq_tensors_that_do_not_fit_are_named(tensor: str, change, message: str) -> None:
    codes, zeros, scales, _ = rtn(random_weight(16, 64, 0), 32)
    packed = pack_awq(codes, zeros, scales)
    packed[tensor] = change(packed[tensor])
    with pytest.raises(ValueError, match=message):
        awq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], 32)


def test_gptq_g_idx_that_is_not_a_grouping_is_refused() -> None:
    codes, zeros, scales, g_idx = rtn(random_weight(8, 64, 0), 32)
    packed = pack_gptq(codes, zeros, scales, g_idx, v1=True)
    uneven = torch.zeros(64, dtype=torch.int32)
    uneven[-1] = 1  # 63 inputs in group 0, one in group 1
    with pytest.raises(ValueError, match="groups of 32"):
        gptq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], uneven, 32, 1)


# --- configs --------------------------------------------------------------------------------------


def test_awq_config_reads_both_spellings_and_names_bad_fields() -> None:
    assert AwqConfig.from_hf({"quant_method": "awq", "w_bit": 4, "q_group_size": 64}).group_size == 64
    assert AwqConfig.from_hf({"quant_method": "awq", "bits": 4, "group_size": -1}).group_size == -1
    for bad, field in (
        ({"bits": 8}, "bits"),
        ({"version": "gemv"}, "version"),
        ({"zero_point": False}, "zero_point"),
        ({"group_size": 0}, "group_size"),
    ):
        with pytest.raises(ValueError, match=f"quantization_config.{field}"):
            AwqConfig.from_hf({"quant_method": "awq", **bad})


def test_gptq_config_formats_and_refusals() -> None:
    config = GptqConfig.from_hf({"bits": 4, "group_size": 128, "desc_act": True, "sym": False})
    assert (config.desc_act, config.sym, config.zero_offset) == (True, False, 1)
    assert GptqConfig.from_hf({"checkpoint_format": "gptq_v2"}).zero_offset == 0
    for bad, field in (
        ({"bits": 3}, "bits"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"lm_head": True}, "lm_head"),
        ({"dynamic": {"-:.*": {}}}, "dynamic"),
    ):
        with pytest.raises(ValueError, match=f"quantization_config.{field}"):
            GptqConfig.from_hf(bad)


# --- FP8 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_checkpoint_weights_dequantize_as_torch_computes_them(per_channel: bool) -> None:
    weight = random_weight(32, 64, seed=5)
    q, scale = quantize_fp8(weight, per_channel)
    fp8 = fp8_from_checkpoint(q, scale, None)
    assert fp8.scale.shape == (32,)
    torch.testing.assert_close(fp8.dequantize(), q.float() * scale, rtol=0, atol=0)


def test_fp8_scale_shapes_and_values_are_checked() -> None:
    q = torch.zeros(8, 16).to(FP8_DTYPE)
    with pytest.raises(ValueError, match="weight_scale must hold one value or one per output row"):
        fp8_from_checkpoint(q, torch.ones(3), None)
    with pytest.raises(ValueError, match="weight_scale must be positive"):
        fp8_from_checkpoint(q, torch.tensor(0.0), None)
    with pytest.raises(ValueError, match="input_scale must be one value"):
        fp8_from_checkpoint(q, torch.tensor(1.0), torch.ones(2))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_from_checkpoint(torch.zeros(8, 16), torch.tensor(1.0), None)


def test_online_fp8_quantization_is_per_row_and_within_e4m3_precision() -> None:
    weight = random_weight(16, 64, seed=9) * torch.logspace(-3, 1, 16)[:, None]  # rows of very different size
    fp8 = quantize_weight(weight)
    assert fp8.weight.float().abs().amax(dim=1).eq(448.0).all()  # every row uses the full range
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for values in its normal range
    err = (fp8.dequantize() - weight).abs()
    assert (err <= weight.abs() * 2**-4 + fp8.scale[:, None] * 2**-9).all()


def test_stacked_fp8_parts_keep_their_own_scales() -> None:
    parts = [
        fp8_from_checkpoint(*quantize_fp8(random_weight(8, 32, s), False), torch.tensor(0.01 * (s + 1)))
        for s in range(3)
    ]
    stacked = stack_fp8(parts)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert stacked.input_scale is not None and float(stacked.input_scale) == pytest.approx(0.03)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_configs_as_vllm_reads_them(per_channel: bool, static: bool) -> None:
    for kind in ("fp8", "compressed-tensors"):
        config = Fp8Config.from_hf(fp8_config(kind, per_channel, static))
        assert config.static_activations == static


def test_fp8_configs_name_what_is_not_supported() -> None:
    with pytest.raises(ValueError, match="weight_block_size"):
        Fp8Config.from_hf({"quant_method": "fp8", "weight_block_size": [128, 128]})
    block = fp8_config("compressed-tensors", True, False)
    block["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    with pytest.raises(ValueError, match=r"config_groups.group_0.weights.strategy"):
        Fp8Config.from_hf(block)
    int8 = fp8_config("compressed-tensors", True, False)
    int8["config_groups"]["group_0"]["weights"].update(type="int")
    with pytest.raises(ValueError, match="must be 8-bit 'float'"):
        Fp8Config.from_hf(int8)
