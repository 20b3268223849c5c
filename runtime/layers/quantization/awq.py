"""AWQ checkpoints (AutoAWQ's "gemm" packing, which Hugging Face and vLLM read) -> `Int4Weight`.

Per linear layer `W` [out, in] an AWQ checkpoint holds:

- `qweight` int32 [in, out / 8]: each word packs eight 4-bit codes of consecutive OUTPUT columns,
  in AWQ's interleaved order: field i (bits 4i..4i+3) holds column `AWQ_ORDER[i]` of the eight;
- `qzeros` int32 [in / group_size, out / 8]: the zero points, packed the same way;
- `scales` float16 [in / group_size, out].

    W[n, k] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n]

The order comes from the CUDA kernel AutoAWQ shipped with: it unpacks a word into two registers of
four values each with one shift, so fields 0..3 hold the even columns and 4..7 the odd ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvasir.kernels.int4_packing import PACK, unpack_int32
from kvasir.runtime.layers.quantization.int4 import Int4Weight, check_group_tensors
from kvasir.runtime.layers.quantization.int4_linear import Int4CheckpointWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
TENSOR_NAMES = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class AwqConfig:
    """A checkpoint's `quantization_config` with `quant_method: awq`."""

    group_size: int  # (modules_to_not_convert are stored as float tensors and load as such)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> AwqConfig:
        """Read the fields AutoAWQ and transformers write (`bits`/`w_bit`, `group_size`/`q_group_size`)."""
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"quantization_config.bits is {bits!r}: AWQ is read with 4 bits only")
        if not config.get("zero_point", True):
            raise ValueError(
                "quantization_config.zero_point is false: AWQ's GEMM format always stores zero points"
            )
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"quantization_config.version is {version!r}: only AWQ's 'gemm' packing is supported"
            )
        group_size = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
            raise ValueError(
                f"quantization_config.group_size must be a positive integer or -1, got {group_size!r}"
            )
        return cls(group_size=group_size)


def awq_to_int4(qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int) -> Int4Weight:
    """Read one AWQ layer; `group_size` -1 means one group over all inputs. Raises ValueError naming
    the tensor whose shape or dtype does not fit."""
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [in, out/8], got {list(qweight.shape)}")
    in_features, out_features = qweight.shape[0], qweight.shape[1] * PACK
    group_size = in_features if group_size == -1 else group_size
    if in_features % group_size:
        raise ValueError(f"qweight has {in_features} inputs, not a multiple of group_size {group_size}")
    num_groups = in_features // group_size
    check_group_tensors(
        qweight, qzeros, scales, num_groups=num_groups, out_features=out_features, group_size=group_size
    )
    codes = unpack_int32(qweight, dim=1, order=AWQ_ORDER)  # [in, out]
    zeros = unpack_int32(qzeros, dim=1, order=AWQ_ORDER)  # [groups, out]
    return Int4Weight(
        codes=codes.t().contiguous(),
        scales=scales.t().contiguous(),
        zeros=zeros.t().contiguous(),
        group_size=group_size,
    )


class AwqWeight(Int4CheckpointWeight):
    """One AWQ linear weight as the checkpoint stores it (`qweight`, `qzeros`, `scales`)."""

    method = "awq"

    @property
    def shape(self) -> tuple[int, int]:
        in_features, words = self.tensors["qweight"].shape
        return int(words) * PACK, int(in_features)

    def to_int4(self, device: torch.device | None = None) -> Int4Weight:
        t = self.tensors_on(device)
        return awq_to_int4(t["qweight"], t["qzeros"], t["scales"], self.group_size)
