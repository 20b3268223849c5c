"""GPTQ checkpoints (AutoGPTQ / GPTQModel, as Hugging Face and vLLM read them) -> `Int4Weight`.

Per linear layer `W` [out, in] a GPTQ checkpoint holds:

- `qweight` int32 [in / 8, out]: each word packs eight 4-bit codes of consecutive INPUT rows,
  field i (bits 4i..4i+3) holding row 8j + i;
- `qzeros` int32 [num_groups, out / 8]: zero points, eight consecutive output columns per word;
- `scales` float16 [num_groups, out];
- `g_idx` int32 [in]: the group of each input row (optional; `k // group_size` when absent).

    W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

Two details matter. With act-order (`desc_act: true`) the quantizer visited the inputs in order of
decreasing activation magnitude, so `g_idx` is a permuted grouping: sorting the inputs by it
makes every group a run again (the kernels' layout), at the price of gathering the activations
in that order. And the original format (`checkpoint_format: gptq`, the default) stores every zero
point minus one; the kernels it was written for add the one back (so a stored 15 reads as 16: the
format's known overflow, reproduced here because it is what those checkpoints mean).
`gptq_v2` (GPTQModel) stores the zero points as they are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvasir.kernels.int4_packing import PACK, unpack_int32
from kvasir.runtime.layers.quantization.int4 import Int4Weight, check_group_tensors
from kvasir.runtime.layers.quantization.int4_linear import Int4CheckpointWeight

TENSOR_NAMES = ("qweight", "qzeros", "scales", "g_idx")
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> what its stored zero points lack


@dataclass(frozen=True)
class GptqConfig:
    """A checkpoint's `quantization_config` with `quant_method: gptq`."""

    group_size: int
    desc_act: bool
    sym: bool
    zero_offset: int  # added to every stored zero point: 1 for the original format, 0 for gptq_v2

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> GptqConfig:
        bits = config.get("bits", 4)
        if bits != 4:
            raise ValueError(f"quantization_config.bits is {bits!r}: GPTQ is read with 4 bits only")
        group_size = config.get("group_size", 128)
        if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
            raise ValueError(
                f"quantization_config.group_size must be a positive integer or -1, got {group_size!r}"
            )
        checkpoint_format = str(config.get("checkpoint_format") or "gptq")
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"quantization_config.checkpoint_format is {checkpoint_format!r}; "
                f"supported: {', '.join(CHECKPOINT_FORMATS)}"
            )
        if config.get("lm_head"):
            raise ValueError("quantization_config.lm_head is true: a quantized lm_head is not supported")
        if config.get("dynamic"):
            raise ValueError(
                "quantization_config.dynamic (per-module overrides) is not supported: "
                "every layer must use the top-level bits and group_size"
            )
        return cls(
            group_size=group_size,
            desc_act=bool(config.get("desc_act", False)),
            sym=bool(config.get("sym", True)),
            zero_offset=CHECKPOINT_FORMATS[checkpoint_format],
        )


def gptq_to_int4(
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor | None,
    group_size: int,
    zero_offset: int,
) -> Int4Weight:
    """Read one GPTQ layer; `group_size` -1 means one group over all inputs; `zero_offset` is
    `GptqConfig.zero_offset`. Raises ValueError naming the tensor that does not fit."""
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [in/8, out], got {list(qweight.shape)}")
    in_features, out_features = qweight.shape[0] * PACK, qweight.shape[1]
    group_size = in_features if group_size == -1 else group_size
    num_groups = -(-in_features // group_size)
    check_group_tensors(
        qweight, qzeros, scales, num_groups=num_groups, out_features=out_features, group_size=group_size
    )
    codes = unpack_int32(qweight, dim=0).t()  # [out, in]
    zeros = unpack_int32(qzeros, dim=1).t().to(torch.int16) + zero_offset  # [out, groups]; may reach 16
    scales_t = scales.t()
    input_perm = _act_order_perm(g_idx, in_features, group_size, num_groups)
    if input_perm is not None:
        codes = codes[:, input_perm]
    return Int4Weight(
        codes=codes.contiguous(),
        scales=scales_t.contiguous(),
        zeros=zeros.to(torch.uint8).contiguous(),
        group_size=group_size,
        input_perm=input_perm,
    )


def _act_order_perm(
    g_idx: Tensor | None, in_features: int, group_size: int, num_groups: int
) -> Tensor | None:
    """The input order that makes each group a run (None when the checkpoint's order already does)."""
    if g_idx is None:
        return None
    if tuple(g_idx.shape) != (in_features,) or g_idx.is_floating_point():
        raise ValueError(
            f"g_idx must be an integer tensor [{in_features}], got {g_idx.dtype} {list(g_idx.shape)}"
        )
    g_idx = g_idx.long()
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups:
        raise ValueError(f"g_idx holds groups outside 0..{num_groups - 1}")
    runs = torch.arange(in_features, device=g_idx.device) // group_size
    if torch.equal(g_idx, runs):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], runs):
        raise ValueError(
            f"g_idx does not split the inputs into groups of {group_size} (each group must have "
            "exactly group_size rows, as GPTQ's act-order writes them)"
        )
    return perm


class GptqWeight(Int4CheckpointWeight):
    """One GPTQ linear weight as the checkpoint stores it (`qweight`, `qzeros`, `scales`, `g_idx`)."""

    method = "gptq"

    def __init__(self, tensors: dict[str, Tensor], group_size: int, zero_offset: int) -> None:
        super().__init__(tensors, group_size)
        self.zero_offset = zero_offset
        g_idx = tensors.get("g_idx")
        size = self.shape[1] if group_size == -1 else group_size
        self.act_order = g_idx is not None and not torch.equal(
            g_idx.long(), torch.arange(g_idx.numel()) // size
        )

    @property
    def shape(self) -> tuple[int, int]:
        words, out_features = self.tensors["qweight"].shape
        return int(out_features), int(words) * PACK

    @property
    def scheme(self) -> str:
        return f"int4 g{self.group_size}" + (" act-order" if self.act_order else "")

    @property
    def merge_key(self) -> Hashable:
        # Act-order parts stack only when they permute their (shared) input alike.
        if not self.act_order:
            return (self.method, self.scheme)
        g_idx = self.tensors["g_idx"].to(torch.int32).contiguous()
        return (self.method, self.scheme, hashlib.sha1(g_idx.numpy().tobytes()).hexdigest())

    def to_int4(self, device: torch.device | None = None) -> Int4Weight:
        t = self.tensors_on(device)
        return gptq_to_int4(
            t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), self.group_size, self.zero_offset
        )
